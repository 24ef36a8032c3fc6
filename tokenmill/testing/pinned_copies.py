"""The order of copies out of and into pinned host memory, for the CUDA stand-in (``fake_cuda``).

On a GPU a non-blocking copy between pinned host memory and the device is a DMA the device
runs when its queue reaches it: the host must not write that buffer again before it knows
the copy ran (it waited for an event recorded after it, or for the whole device), and what
it reads from a buffer the device copies into is the old contents until then. The stand-in
keeps the queue's order: it refuses such a write, and a copy into pinned memory lands when
the host waits for a point of the queue past it, so an early read sees the old values.
"""

from __future__ import annotations

import weakref

import torch


class PinnedBufferRace(RuntimeError):
    """The host wrote pinned memory that a queued copy may not have read (or written) yet."""


def _address(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class CopyQueue:
    """The device's queue as far as pinned host memory is concerned: each non-blocking copy out
    of or into a pinned buffer takes the next position; the host knows every position up to
    ``done`` has run (it waited for an event recorded there, or for the whole device)."""

    def __init__(self) -> None:
        self.queued = 0
        self.done = 0
        #: pinned storage address -> the queue position of its last copy
        self.pending: dict[int, int] = {}
        #: pinned storage address -> the pinned tensor (an address freed and reused is not pinned)
        self.pinned: dict[int, weakref.ref] = {}
        #: copies into pinned memory not landed yet: (queue position, destination, its values)
        self.landing: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        address = _address(tensor)
        self.pinned[address] = weakref.ref(tensor)
        self.pending.pop(address, None)  # memory freed and pinned anew: no copy of its own yet
        return tensor

    def _is_pinned(self, address: int) -> bool:
        pinned = self.pinned.get(address)
        return pinned is not None and pinned() is not None

    def copied(self, host: torch.Tensor) -> bool:
        """A non-blocking copy between ``host`` and the device was queued: whether ``host`` is
        pinned (a copy from pageable memory is staged at once)."""
        address = _address(host)
        if not self._is_pinned(address):
            return False
        self.queued += 1
        self.pending[address] = self.queued
        return True

    def copied_to_host(self, host: torch.Tensor, values: torch.Tensor) -> bool:
        """A non-blocking copy of a device tensor's ``values`` into ``host``. Pinned memory
        gets them when the host next waits past the copy (True); pageable memory at once, as
        CUDA returns from such a copy only once it landed (False: the caller notes the wait)."""
        if not self.copied(host):
            return False
        # the device's values as the copy reads them: later kernels come after it in the queue
        self.landing.append((self.queued, host, values.clone()))
        return True

    def _land(self, upto: int) -> None:
        landed = [copy for copy in self.landing if copy[0] <= upto]
        self.landing = [copy for copy in self.landing if copy[0] > upto]
        with torch._C.DisableTorchFunction():  # the device's write, not the host's (no race check)
            for _, host, values in landed:
                host.copy_(values)

    def mark(self) -> int:
        self.queued += 1
        return self.queued

    def reach(self, mark: int) -> bool:
        """The host waits for ``mark``; whether that was a wait (False: it had already passed)."""
        if mark <= self.done:
            return False
        self.done = mark
        self.pending = {address: at for address, at in self.pending.items() if at > mark}
        self._land(mark)
        return True

    def drain(self) -> None:
        """The host waited for the device: everything queued so far has run."""
        self.done = self.queued
        self.pending.clear()
        self._land(self.queued)

    def check_write(self, host: torch.Tensor) -> None:
        """The host writes ``host``: refused while a copy queued from or into it may not have run
        (a write by the device, a copy from it, is ordered on the stream and is not checked)."""
        address = _address(host)
        at = self.pending.get(address)
        if at is not None and at > self.done and self._is_pinned(address):
            raise PinnedBufferRace(f"pinned host memory {tuple(host.shape)} written while a copy queued from it "
                                   f"may not have run: on a GPU that copy would carry the new values")
