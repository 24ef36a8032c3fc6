"""Which low-precision dtypes this CPU computes in natively.

bf16 matmuls need AVX512-BF16 or AMX (oneDNN's bf16 kernels); elsewhere, AMD Zen 2/3 and
Intel before Cooper Lake among them, PyTorch widens bf16 element by element: a bf16 GEMM ran
at ~10 GFLOP/s on a Zen 3 core where fp32 runs at ~70-100.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def native_bf16() -> bool:
    """Whether bf16 GEMMs run on bf16 hardware here (else fp32 is several times faster)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
