"""Which low-precision dtypes this CPU computes in natively.

bf16 matmuls need AVX512-BF16 or AMX (oneDNN's bf16 kernels); elsewhere, AMD Zen 2/3 and
Intel before Cooper Lake among them, PyTorch widens bf16 element by element: a bf16 GEMM ran
at ~10 GFLOP/s on a Zen 3 core where fp32 runs at ~70-100, and at 11 vs 42 on an Ice Lake
core (AVX-512 without its BF16 extension).

oneDNN's own ``_is_mkldnn_bf16_supported`` is not the test: it says yes for any AVX-512 core
(AVX512BW/VL/DQ), where its bf16 kernels emulate the bf16 instructions at a quarter of fp32's
speed. The instruction sets are asked for instead.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def native_bf16() -> bool:
    """Whether bf16 GEMMs run on bf16 hardware here (else fp32 is several times faster)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
