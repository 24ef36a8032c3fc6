"""The GPU path for GPTQ/AWQ: a Triton dequant-GEMM over GPTQ-packed weights.

``C[M, N] = A[M, K] @ W[K, N]`` with ``W[k, n] = (q[k, n] - zeros[g_idx[k], n]) *
scales[g_idx[k], n]``, where ``q`` stays packed ``32 // BITS`` per int32 word
along K (GPTQ's layout; AWQ checkpoints are repacked to it at load). Each
program computes one ``BLOCK_M x BLOCK_N`` tile, unpacking a ``BLOCK_K``
slab of weights per step in registers, so full-precision weights never touch
memory. ``g_idx`` is gathered per row, which covers act-order checkpoints.

Written for GPUs; tested on CPU with ``TRITON_INTERPRET=1`` against the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.plugins.triton_env import INTERPRETED


@triton.jit
def _dequant_gemm_kernel(
    a_ptr, qweight_ptr, zeros_ptr, scales_ptr, g_idx_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn, stride_cm, stride_cn,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    # 64-bit rows: row * stride passes 2**31 at 37k tokens of a 57k-wide layer
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        words = tl.load(qweight_ptr + (offs_k[:, None] // PACK) * stride_qk + offs_n[None, :] * stride_qn,
                        mask=mask_k[:, None] & mask_n[None, :], other=0)
        q = (words >> ((offs_k[:, None] % PACK) * BITS)) & MASK
        groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        zeros = tl.load(zeros_ptr + groups[:, None] * stride_zg + offs_n[None, :] * stride_zn,
                        mask=mask_k[:, None] & mask_n[None, :], other=0)
        scales = tl.load(scales_ptr + groups[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                         mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        w = (q - zeros).to(tl.float32) * scales.to(tl.float32)
        if IEEE_FP32:
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        else:  # fp16/bf16 activations: tensor cores, fp32 accumulation
            acc += tl.dot(a, w.to(a.dtype))
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def dequant_gemm(a: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor, bits: int, block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """``a [M, K]`` times the GPTQ-packed ``qweight [K / (32 / bits), N]``; zeros are unpacked ints."""
    block_k = gemm_block_k(a.dtype)
    if INTERPRETED:  # the interpreter runs a program's tile at numpy's speed: few, large tiles
        block_m, block_n, block_k = 64, 64, 64
    m, k = a.shape
    n = qweight.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _dequant_gemm_kernel[grid](
        a, qweight, zeros, scales, g_idx, c, m, n, k,
        a.stride(0), a.stride(1), qweight.stride(0), qweight.stride(1), zeros.stride(0), zeros.stride(1),
        scales.stride(0), scales.stride(1), c.stride(0), c.stride(1),
        BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE_FP32=a.dtype == torch.float32,
    )
    return c


def gemm_block_k(dtype: torch.dtype) -> int:
    """The K step: 16 for fp32 activations (IEEE dots; 32 spills registers on sm_80), else 32."""
    return 16 if dtype == torch.float32 else 32
