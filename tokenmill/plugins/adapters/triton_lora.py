"""The GPU path for LoRA: a batched gather matrix-vector kernel (BGMV, as in Punica/S-LoRA).

``y[t, :] (+)= x[t, :] @ W[slot[t]]^T`` for every token ``t`` whose slot is not
-1: one program per (token, block of outputs) gathers its own adapter's
weights, so a batch mixing adapters and base-only tokens needs no sorting.
LoRA runs it twice: shrink (``A``: in -> rank) and expand (``B``: rank ->
out, accumulating into the base layer's output).

Written for GPUs; tested on CPU with ``TRITON_INTERPRET=1`` against the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bgmv_kernel(x_ptr, w_ptr, slot_ptr, y_ptr, N, K,
                 stride_xt, stride_xk, stride_ws, stride_wn, stride_wk, stride_yt, stride_yn,
                 ACCUMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # token * stride passes 2**31 at 37k tokens of a 57k-wide layer
    pid_n = tl.program_id(1)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + token * stride_xt + offs_k * stride_xk, mask=mask_k, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + slot * stride_ws + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        y_ptrs = y_ptr + token * stride_yt + offs_n * stride_yn
        if ACCUMULATE:
            acc += tl.load(y_ptrs, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


def bgmv(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, y: torch.Tensor, accumulate: bool,
         block_n: int = 32, block_k: int = 64) -> None:
    """``x [T, K]``, ``weights [slots, N, K]``, ``slots [T]`` (-1 = skip), ``y [T, N]`` written in place."""
    tokens, k = x.shape
    n = weights.shape[1]
    grid = (tokens, triton.cdiv(n, block_n))
    _bgmv_kernel[grid](x, weights, slots, y, n, k, x.stride(0), x.stride(1), weights.stride(0), weights.stride(1),
                       weights.stride(2), y.stride(0), y.stride(1),
                       ACCUMULATE=accumulate, BLOCK_N=block_n, BLOCK_K=block_k)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor) -> None:
    """``y[t] += (x[t] @ A[slot]^T) @ B[slot]^T`` for tokens with an adapter."""
    shrunk = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    bgmv(x, a, slots, shrunk, accumulate=False)
    bgmv(shrunk, b, slots, y, accumulate=True)
