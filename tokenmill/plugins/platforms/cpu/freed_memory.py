"""Freed activation buffers kept in the process for the next step, not handed back to the OS.

glibc's malloc serves blocks over its mmap threshold (adjusted at run time, at most
32 MB) with a fresh ``mmap`` and unmaps them on ``free``; it also returns the heap's
free top to the OS past a trim threshold. A prompt chunk's MLP activations are such
blocks (4096 tokens x 2816 x 4 bytes = 46 MB for the 52M benchmark model), so every
prefill step faulted its activations in again, 4 KB page by page, each page zeroed
by the kernel: ~550,000 page faults and 1.3-1.5 s of kernel time per W1 run (32 s),
and the GEMM writing into fresh pages ran 1.2x slower (benchmarks/README.md).

Raising both thresholds makes such blocks come from the heap and stay there once
freed, so steady-state steps reuse them. The price is that the process keeps its
peak activation memory until it exits, which a serving engine reuses every step
anyway. Allocators other than glibc's (musl, macOS; jemalloc or tcmalloc preloaded)
are left alone: they either lack ``mallopt`` or ignore glibc's settings.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import structlog

log = structlog.get_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: blocks below this come from the heap; larger ones (a KV cache) are still mapped
#: on their own and returned when freed
THRESHOLD_BYTES = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds to ``THRESHOLD_BYTES`` (process-wide, once);
    False where the C library is not glibc or refuses the setting."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, THRESHOLD_BYTES))
    if not applied:
        log.warning("glibc refused the malloc thresholds; freed activations go back to the OS")
    return applied
