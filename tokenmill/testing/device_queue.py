"""The CUDA stand-in's queue of copies and its record of the host's waits for the device.

``fake_cuda`` keeps one queue of the non-blocking copies in and out of pinned memory
(``pinned_copies.CopyQueue``) per block, and notes here each point where a GPU's host would
wait for the device (``host_syncs``) and the shape of each host tensor copied to the device
(``host_to_device_copies``), so that tests can hold code meant to run ahead of the device to it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from tokenmill.testing.pinned_copies import CopyQueue

_queue = CopyQueue()


def queue() -> CopyQueue:
    """The stand-in device's queue of copies (a fresh one per ``fake_cuda()`` block)."""
    return _queue


def reset_queue() -> None:
    global _queue
    _queue = CopyQueue()


_syncs = threading.local()


def queue_mark() -> int:
    """A position in the device's queue after every copy queued so far (an event's)."""
    return _queue.mark()


def wait_for_mark(mark: int) -> None:
    """The host waits until the device reached ``mark``: a wait in ``host_syncs`` where it
    had not passed it already."""
    if _queue.reach(mark):
        _record("events", "waited for a recorded event")


@contextmanager
def host_syncs() -> Iterator[list[str]]:
    """The host's waits for the device inside the block, one line each: a read back
    (``.tolist()``, ``.item()``, ``bool()``, ``int()``), a copy to the host, and a blocking copy
    to the device, which on a GPU waits for every kernel queued before it (``.to("cuda")``
    or ``copy_`` without ``non_blocking``, ``torch.tensor(..., device="cuda")``, a host index
    or a list indexing a device tensor)."""
    with _recording("events") as events:
        yield events


def synced(what: str) -> None:
    """Note a wait of the host for the device (in ``host_syncs``' list, where one is open),
    after which every copy queued before it has run."""
    _queue.drain()
    _record("events", what)


@contextmanager
def host_to_device_copies() -> Iterator[list[tuple[int, ...]]]:
    """The shape of every host tensor copied to the device inside the block (``.to("cuda")``,
    ``copy_`` into a device tensor, a host value set into one): on a GPU each crosses PCIe,
    so the per-step ones say what a step costs the bus."""
    with _recording("copies") as copies:
        yield copies


def copied_to_device(tensor: torch.Tensor) -> None:
    _record("copies", tuple(tensor.shape))


@contextmanager
def _recording(name: str) -> Iterator[list]:
    """A list this thread's ``_record(name, ...)`` calls append to inside the block (nested
    blocks: the innermost)."""
    outer = getattr(_syncs, name, None)
    items: list = []
    setattr(_syncs, name, items)
    try:
        yield items
    finally:
        setattr(_syncs, name, outer)


def _record(name: str, item: Any) -> None:
    items = getattr(_syncs, name, None)
    if items is not None:
        items.append(item)
