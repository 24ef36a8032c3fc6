"""A step's inputs, assembled on the host and copied to the device in one non-blocking copy each.

The host side is one persistent buffer per input (token ids, positions, the attention
metadata's arrays), from the platform's ``host_buffer``: pinned memory on a GPU, so each
copy is a DMA that overlaps with the host's work instead of a synchronous, pageable copy.
The DMA reads the buffer when the device's queue reaches it, so a set of buffers is refilled
only once the copies its last step queued have run: that step marks the queue after its
copies (``mark_copies``: after its inputs, and again after the rows it samples) and
``next_step`` waits for the mark of the set it turns to. A step whose result the host read
has long passed it (a free wait); a prompt chunk that samples nothing has no result, and the
next chunk waits for the last one's copies, not its forward.
The next step reuses the set; under async scheduling (``sets=2``: buffers taking turns) the
one after it. A step's sampled tokens come back the same way (``to_host``): copied into host
buffers as soon as they are sampled, then read once the device passed the step's mark, so
that reading them never waits for a step launched since.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from tokenmill.interfaces.platform import DeviceEvent, Platform


class InputStaging:
    def __init__(self, device: str, host_buffer: Callable[[Sequence[int], torch.dtype], torch.Tensor],
                 sets: int = 1, record_event: Optional[Callable[[], DeviceEvent]] = None) -> None:
        self.device = device
        self._host_buffer = host_buffer
        self._record_event = record_event
        self._sets: list[dict[str, torch.Tensor]] = [{} for _ in range(sets)]
        #: each set's mark after the copies its last step queued
        self._copied: list[Optional[DeviceEvent]] = [None] * sets
        self._buffers = self._sets[0]
        self._turn = 0

    @classmethod
    def for_platform(cls, platform: Platform, sets: int = 1) -> "InputStaging | None":
        """Staging for a platform whose device is not the host; None where the model runs on it."""
        if platform.device_type == "cpu":
            return None
        return cls(platform.device_type, platform.host_buffer, sets, platform.record_event)

    def next_step(self) -> None:
        """A new step stages its inputs: in the next set of buffers, once the copies out of
        them that the set's last step queued have run."""
        self._turn = (self._turn + 1) % len(self._sets)
        self._buffers = self._sets[self._turn]
        copied, self._copied[self._turn] = self._copied[self._turn], None
        if copied is not None:
            copied.synchronize()

    def mark_copies(self) -> None:
        """Mark the device's queue after the copies this step has queued so far."""
        if self._record_event is not None:
            self._copied[self._turn] = self._record_event()

    def to_device(self, name: str, values: np.ndarray) -> torch.Tensor:
        """``values`` on the device, through the host buffer ``name`` (grown as needed)."""
        tensor = torch.from_numpy(np.ascontiguousarray(values))
        staged = self._staged(name, tensor)
        staged.copy_(tensor)
        return staged.to(self.device, non_blocking=True)

    def to_host(self, tensors: Sequence[torch.Tensor], name: str = "to_host") -> "HostCopies":
        """Copies of device ``tensors`` into this step's host buffers ``name``, queued without
        waiting (a step's sampled tokens, read once the step is done: ``HostCopies.wait``)."""
        copies = []
        for index, tensor in enumerate(tensors):
            staged = self._staged(f"{name}{index}", tensor)
            staged.copy_(tensor, non_blocking=True)
            copies.append(staged)
        return HostCopies(copies, self._record_event())

    def _staged(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The host buffer ``name`` of this turn, shaped as ``like`` (grown as needed)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < like.numel() or buffer.dtype != like.dtype:
            size = max(like.numel(), 2 * buffer.numel() if buffer is not None else 0, 1)
            buffer = self._buffers[name] = self._host_buffer((size,), like.dtype)
        return buffer[:like.numel()].view(like.shape)


@dataclass(frozen=True, slots=True)
class HostCopies:
    """Host copies of device tensors, and the mark after the copies in the device's queue."""

    tensors: list[torch.Tensor]
    event: DeviceEvent

    def wait(self) -> list[torch.Tensor]:
        """The copies, once they have landed: a wait for the step that queued them alone."""
        self.event.synchronize()
        return self.tensors
