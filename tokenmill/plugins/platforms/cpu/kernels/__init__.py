"""tokenmill's C++ CPU kernels (paged decode attention, fused layer ops, GEMV, a packed fp32 GEMM,
the fused decode stack, screened greedy argmax), built at first use.

Compiled by torch's extension builder rather than at install time, so that
installing tokenmill never needs torch inside a build environment (which
would pull a CUDA build from PyPI). Builds are cached per source and CPU
feature set (``-march=native``), source directory and torch version. Where no compiler is available, or with
``TOKENMILL_CPU_KERNELS=0``, callers fall back to PyTorch ops; the reason is
logged once.

Builds of one directory are serialised by a lock the kernel releases when its holder dies,
so a build killed half way (torch's own lock file left behind) cannot hang the next start.
A build logs its progress every 10 s, so a first start never looks hung.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator, Optional

import structlog
import torch
from filelock import FileLock

log = structlog.get_logger(__name__)

#: dtypes the fused layer kernels (rms_norm, silu_and_mul, rotary_embedding) implement
FUSED_DTYPES = (torch.float32, torch.bfloat16)
#: (compute dtype, cache dtype) pairs the attention kernels take besides equal ones: a bf16
#: cache under fp32 compute (cache.kv_cache_dtype), widened as it is read
MIXED_CACHE_DTYPES = ((torch.float32, torch.bfloat16),)

_CSRC = Path(__file__).parent / "csrc"
#: two units (all_kernels.cpp includes the kernel files: see its comment)
_SOURCES = ("bindings.cpp", "all_kernels.cpp")
#: -fassociative-math lets the compiler vectorize the scalar tails' reductions. -fopenmp makes
#: ``at::parallel_for`` (inlined from ATen's headers) parallel: without it the pragma is ignored
#: and every kernel runs on one thread whatever ``--num-threads`` says. The module then needs
#: ``libgomp.so.1``, which resolves to the copy torch has already loaded: one OpenMP runtime,
#: one thread pool, sized by ``torch.set_num_threads``.
_CFLAGS = ["-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]


def _build_digest() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    # the sources' directory too: ninja rebuilds when a build's paths change, so two checkouts
    # sharing one build directory would rebuild each other's kernels on every start; and torch's
    # version, whose headers and ABI the module is built against (two environments with two
    # torches would otherwise rebuild each other's kernels, or load one built for the other)
    sources = "".join(path.read_text() for path in sorted(_CSRC.iterdir()))
    text = str(_CSRC) + torch.__version__ + flags + " ".join(_CFLAGS + _LDFLAGS) + sources
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def build_progress(build_dir: Path, units: int, every: float = 10.0) -> Iterator[None]:
    """Logs the build's elapsed time and finished units every ``every`` seconds while it
    runs, and its total time at the end."""
    done = threading.Event()
    start = time.monotonic()

    def report() -> None:
        while not done.wait(every):
            log.info("compiling the C++ CPU kernels", elapsed_s=round(time.monotonic() - start),
                     units_done=f"{len(list(build_dir.glob('*.o')))}/{units}")

    reporter = threading.Thread(target=report, name="kernel-build-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()
        log.info("compiled the C++ CPU kernels", seconds=round(time.monotonic() - start, 1))


@functools.cache
def cpu_kernels() -> Optional[ModuleType]:
    """The compiled module, or None (logged) when it cannot be built here."""
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "kernels"
        build_dir = cache / f"cpu-{_build_digest()}"
        build_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(build_dir / "tokenmill.lock"):
            # holding the lock, no other tokenmill process builds here: torch's lock is stale
            (build_dir / "lock").unlink(missing_ok=True)
            building = not any(build_dir.glob("*.so"))
            if building:
                log.info("compiling the C++ CPU kernels (first use on this CPU; 30-45 s on 2 cores)",
                         build_directory=str(build_dir))
            with build_progress(build_dir, len(_SOURCES)) if building else contextlib.nullcontext():
                return load(name="tokenmill_cpu_kernels", sources=[str(_CSRC / name) for name in _SOURCES],
                            extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, extra_include_paths=[str(_CSRC)],
                            build_directory=str(build_dir),
                            verbose=False)
    except Exception as exc:  # no compiler or ninja, unsupported platform: PyTorch ops still work
        log.warning("C++ CPU kernels unavailable, using PyTorch ops", error=str(exc)[-2000:])
        return None
