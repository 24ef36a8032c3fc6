"""Weights on 2 MB transparent huge pages (Linux THP), for the batch-1 weight stream.

Batch-1 decode reads every weight once per token, one long sequential read. With
4 KB pages every page crossing costs a TLB miss and restarts the hardware
prefetcher; with 2 MB pages the streaming GEMV read the 350M model's bf16 weights
at 24-27 GB/s instead of 18-21 GB/s (1 thread, this project's CPU), and batch-1
TPOT fell 1.16x (benchmarks/README.md).

The kernel gives huge pages to anonymous mappings that ask for them with
``madvise(MADV_HUGEPAGE)`` when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``always`` or ``madvise`` (the usual default). Where it is ``never``, or off Linux,
the same call returns ordinary memory: placement changes speed, never values.

Weights only: KV caches stay on ordinary pages, because faulting huge pages in as blocks
fill cost more than they saved (benchmarks/README.md), and faulting a 2 GB cache in up
front took 8 s.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE_BYTES = 2 * 1024 * 1024
#: tensors smaller than this stay where they are: under one huge page they gain nothing
MIN_BYTES = HUGE_PAGE_BYTES
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: Linux's madvise advice values (Python's mmap module names them only for its own mappings)
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25


@functools.cache
def huge_pages_available() -> bool:
    """Whether this kernel hands out transparent huge pages on request (read once: it is
    asked for every tensor moved)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def huge_page_zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled tensor starting on a 2 MB boundary of a mapping advised to use huge
    pages (``torch.zeros`` where the OS has none). The tensor keeps its mapping alive
    (``torch.frombuffer`` holds a reference to it)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not huge_pages_available():
        return torch.zeros(shape, dtype=dtype)
    # anonymous mappings are zero-filled and page (not huge-page) aligned: map one
    # huge page more and start at the first 2 MB boundary
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def move_parameters_to_huge_pages(model: nn.Module) -> int:
    """Copy each parameter and buffer of at least ``MIN_BYTES`` into huge-page memory;
    returns how many moved. Done once after loading and prepacking (the plain weights the
    GEMV streams are parameters; oneDNN's packed copies are not movable)."""
    if not huge_pages_available():
        return 0
    seen: set[int] = set()  # tied weights appear under two modules
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for tensor in tensors.values():
                if (tensor is None or id(tensor) in seen or tensor.device.type != "cpu"
                        or tensor.layout != torch.strided or not tensor.is_contiguous()
                        or tensor.nbytes < MIN_BYTES):
                    continue
                seen.add(id(tensor))
                tensor.data = huge_page_zeros(tensor.shape, tensor.dtype).copy_(tensor.data)
    return len(seen)


def collapse_in_place(address: int, nbytes: int) -> bool:
    """Back the whole 2 MB pages of memory someone else allocated (oneDNN's packed weights,
    which cannot be moved) with huge pages, now: ``MADV_COLLAPSE`` (Linux 6.1) rewrites the
    range's already-faulted 4 KB pages into huge ones. False where the kernel cannot."""
    if not huge_pages_available():
        return False
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return (madvise(start, end - start, _MADV_HUGEPAGE) == 0
            and madvise(start, end - start, _MADV_COLLAPSE) == 0)
