"""tokenmill's C++ CPU kernels (paged decode attention, fused layer ops, GEMV, a packed fp32 GEMM,
the fused decode stack, screened greedy argmax), built at first use.

Compiled by torch's extension builder rather than at install time, so that
installing tokenmill never needs torch inside a build environment (which
would pull a CUDA build from PyPI). Builds are cached per source and CPU
feature set (``-march=native``) and source directory. Where no compiler is available, or with
``TOKENMILL_CPU_KERNELS=0``, callers fall back to PyTorch ops; the reason is
logged once.

Builds of one directory are serialised by a lock the kernel releases when its holder dies,
so a build killed half way (torch's own lock file left behind) cannot hang the next start.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from types import ModuleType
from typing import Optional

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
_SOURCES = ("bindings.cpp", "paged_decode.cpp", "layer_ops.cpp", "gemv.cpp", "decode_stack.cpp",
            "paged_prefill.cpp", "screened_argmax.cpp", "packed_gemm.cpp")
#: -fassociative-math lets the compiler vectorize the scalar tails' reductions
_CFLAGS = ["-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


def _build_digest() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    # the sources' directory too: ninja rebuilds when a build's paths change, so two checkouts
    # sharing one build directory would rebuild each other's kernels on every start
    text = str(_CSRC) + flags + "".join(path.read_text() for path in sorted(_CSRC.iterdir()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
            if not any(build_dir.glob("*.so")):
                log.info("compiling the C++ CPU kernels (first use on this CPU; about a minute on 2 cores)",
                         build_directory=str(build_dir))
            return load(name="tokenmill_cpu_kernels", sources=[str(_CSRC / name) for name in _SOURCES],
                        extra_cflags=_CFLAGS, extra_include_paths=[str(_CSRC)], build_directory=str(build_dir),
                        verbose=False)
    except Exception as exc:  # no compiler or ninja, unsupported platform: PyTorch ops still work
        log.warning("C++ CPU kernels unavailable, using PyTorch ops", error=str(exc)[-2000:])
        return None
