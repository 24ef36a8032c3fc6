"""The GPU path for block-wise FP8 checkpoints: a Triton GEMM over e4m3 weights with one
scale per 128x128 block.

``C[M, N] = A[M, K] @ W[N, K]^T`` with ``W[n, k] = q[n, k] * scale[scale_row[n], k // GROUP_K]``,
``q`` the checkpoint's e4m3 weights (1 byte per parameter in memory). Each program computes
one ``BLOCK_M x BLOCK_N`` tile and widens a ``BLOCK_K`` slab of weights per step in
registers, ``BLOCK_K`` dividing ``GROUP_K`` so the slab has one scale per output row.
``scale_row`` maps each output row to its row of scales: a fused layer (qkv, gate_up)
stacks each part's block rows, so row ``n`` is not in block ``n // 128`` once a part's size
is not a multiple of 128.

A stays in the compute dtype. The checkpoints' activation scheme is one dynamic scale per
token over the whole row (what their W8A8 references and the dequantizing path compute),
not DeepSeek's per-(token, 128-group) scales, so the caller rounds activations through FP8
in torch and this kernel multiplies them by the widened weights: the same numbers as the
dequantizing path, with weights read at 1 byte each (decode is bound by those reads). It
also runs on sm_80, which has no FP8 tensor cores and where Triton refuses ``fp8e4nv``:
weights are read as bytes and widened by bit arithmetic, which the interpreter runs too.

Written for GPUs; tested on CPU with ``TRITON_INTERPRET=1`` against the torch path.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.plugins.triton_env import INTERPRETED, ieee_fp32_dots


@triton.jit
def _e4m3_to_fp32(bits):
    """e4m3fn bytes to fp32: the sign, exponent and mantissa move into an fp16's fields,
    whose exponent bias (15) exceeds e4m3's (7) by 8, so the fp16 holds the value times
    2^-8 exactly (e4m3's subnormals land on fp16's); widening and scaling by 2^8 is exact."""
    b = bits.to(tl.int32)
    half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.uint16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * 256.0


@triton.jit
def _block_fp8_gemm_kernel(
    a_ptr, w_ptr, scale_ptr, scale_row_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_sr, stride_sk, stride_cm, stride_cn,
    GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # 64-bit rows: row * stride passes 2**31 at 37k-42k tokens of a 51-57k-wide layer
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    scale_rows = tl.load(scale_row_ptr + offs_n, mask=mask_n, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        bits = tl.load(w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                       mask=mask_k[:, None] & mask_n[None, :], other=0)
        scales = tl.load(scale_ptr + scale_rows * stride_sr + (k0 // GROUP_K) * stride_sk, mask=mask_n, other=0.0)
        w = _e4m3_to_fp32(bits) * scales[None, :]  # [BLOCK_K, BLOCK_N], rounded once as fp8.float() * scale
        if IEEE_FP32:
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        else:  # fp16/bf16 activations: tensor cores, fp32 accumulation
            acc += tl.dot(a, w.to(a.dtype))
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def gpu_tiles(dtype: torch.dtype, m: int, group_k: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` for ``m`` tokens in ``dtype``, sized by their registers
    (``tokenmill.testing.triton_aot``). fp16/bf16 take tensor-core tiles: 16 token rows
    (``tl.dot``'s minimum) for decode-sized batches, 64 for prefills, whose 64-wide K slab
    would take every register (32 takes 122-162). fp32's IEEE dot runs on the CUDA cores and
    spills past 16x32x32. ``BLOCK_K`` divides ``group_k``: each slab lies in one column of
    scale blocks."""
    if dtype == torch.float32:
        block_m, block_n, block_k = 16, 32, 32
    else:
        block_m, block_n, block_k = (16, 64, 64) if m <= 16 else (64, 64, 32)
    return block_m, block_n, math.gcd(group_k, block_k)


def block_fp8_gemm(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_rows: torch.Tensor,
                   group_k: int, tile: Optional[tuple[int, int, int]] = None) -> torch.Tensor:
    """``a [M, K]`` times the e4m3 ``weight [N, K]`` transposed, in ``a``'s dtype; ``scale [R,
    ceil(K / group_k)]`` float32 and ``scale_rows [N]`` int32, each output row's scale row.
    ``tile`` (``BLOCK_M, BLOCK_N, BLOCK_K``) defaults to ``gpu_tiles``'s, or in the
    interpreter, which runs one program at a time in Python, to 64x64x64: fewer programs."""
    m, k = a.shape
    n = weight.shape[0]
    if tile is None:
        tile = (64, 64, math.gcd(group_k, 64)) if INTERPRETED else gpu_tiles(a.dtype, m, group_k)
    block_m, block_n, block_k = tile
    if block_k < 16:
        raise ValueError(f"scale blocks {group_k} wide in K: the kernel needs a multiple of 16")
    bits = weight.view(torch.uint8)  # widened in the kernel: sm_80 has no fp8e4nv loads
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_gemm_kernel[grid](
        a, bits, scale, scale_rows, c, m, n, k,
        a.stride(0), a.stride(1), bits.stride(0), bits.stride(1), scale.stride(0), scale.stride(1),
        c.stride(0), c.stride(1),
        GROUP_K=group_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE_FP32=ieee_fp32_dots(a.dtype),
    )
    return c
