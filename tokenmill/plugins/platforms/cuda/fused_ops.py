"""The cuda platform's implementations of the core's elementwise CustomOps, in Triton.

Eager, RMSNorm is eight kernels (Gemma's nine), rotary embeddings ten (five each for q and k) and SiLU-and-mul
two: per Llama layer about thirty launches of a few microseconds each that move almost no
data. At batch 1 a GPU spends most of a decode step launching them, inside a CUDA graph as
well (each node still costs its launch latency). Here each op is one kernel.

Each kernel rounds where ``forward_native`` rounds (to the compute dtype after the
normalisation, after the activation, after each rotary product), so a 16-bit model computes
what the eager path computes, within the last bit where an fp32 intermediate (a reduction's
order, ``exp``) differs. What a kernel was not written for (mixed dtypes, a strided last
dimension) goes to the layer's ``forward_native``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from tokenmill.core.layers.activation import GatedActivation
from tokenmill.core.layers.norm import GemmaRMSNorm, RMSNorm
from tokenmill.core.layers.rotary import ApplyRotary
from tokenmill.plugins.models.triton_moe import fused_moe

#: the widest row RMSNorm keeps in registers at once; wider rows take a second pass
RMS_NORM_TILE = 8192
#: columns per program of the gated activations
ACT_TILE = 1024
#: the rotary kernel's compile options: no floating-point fusion (``_rotate_heads``)
ROTARY_OPTIONS = {"enable_fp_fusion": False}
#: the gated activations' kernel code per op name (GatedActivation.op_name)
GATED_ACTIVATIONS = {"silu_and_mul": 0, "gelu_pytorch_tanh_and_mul": 1, "gelu_new_and_mul": 1}
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _scaled(normed, w, GEMMA: tl.constexpr):
    """A normalised fp32 row times its weight, rounded as the layer's eager code rounds it."""
    dtype = w.dtype
    if GEMMA:  # (x / rms) * (1 + w) in fp32, one rounding
        return (normed * (1.0 + w.to(tl.float32))).to(dtype)
    return (w.to(tl.float32) * normed.to(dtype).to(tl.float32)).to(dtype)  # weight * (x / rms).to(dtype)


@triton.jit
def _row_values(x_row, residual_row, sum_row, offsets, mask, RESIDUAL: tl.constexpr, STORE: tl.constexpr):
    """The row's values at ``offsets`` in fp32: x, or with RESIDUAL ``x + residual`` rounded to the
    dtype as the eager add rounds it (written to the sum's row with STORE)."""
    x = tl.load(x_row + offsets, mask=mask, other=0.0)
    if not RESIDUAL:
        return x.to(tl.float32)
    dtype = x_row.dtype.element_ty
    total = x.to(tl.float32) + tl.load(residual_row + offsets, mask=mask, other=0.0).to(tl.float32)
    if STORE:
        tl.store(sum_row + offsets, total.to(dtype), mask=mask)
    return total.to(dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, stride_x, stride_residual, stride_out,
                     stride_sum, n, eps, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, GEMMA: tl.constexpr,
                     RESIDUAL: tl.constexpr):
    """One program per row: the row over its root mean square (the sum of squares in fp32),
    times the weight (Gemma's: times 1 + the weight). With RESIDUAL the row is ``x + residual``,
    which is also written out (the residual stream's next value)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    residual_row = residual_ptr + row * stride_residual
    sum_row = sum_ptr + row * stride_sum
    out_row = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = cols < n
        x = _row_values(x_row, residual_row, sum_row, cols, mask, RESIDUAL, True)
        inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        tl.store(out_row + cols, _scaled(x * inv, w, GEMMA), mask=mask)
    else:
        squares = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            x = _row_values(x_row, residual_row, sum_row, start + cols, mask, RESIDUAL, True)
            squares += x * x
        inv = tl.math.rsqrt(tl.sum(squares, axis=0) / n + eps)
        for start in range(0, n, BLOCK):  # the sum again from its parts, not read back from its store
            mask = start + cols < n
            x = _row_values(x_row, residual_row, sum_row, start + cols, mask, RESIDUAL, False)
            w = tl.load(weight_ptr + start + cols, mask=mask, other=0.0)
            tl.store(out_row + start + cols, _scaled(x * inv, w, GEMMA), mask=mask)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, column tile): ``act(gate) * up`` with ``x``'s row holding gate then up.
    ACT 0: SiLU, ``x / (1 + exp(-x))`` as torch computes it; 1: GELU's tanh approximation."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        # 0.5 x (1 + tanh(inner)) without the cancellation of 1 + tanh at large negative x (where
        # torch's own formula loses bits, so the two may differ there in the last few bits)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    act = act.to(dtype).to(tl.float32)  # the activation's own output, rounded as eager rounds it
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)


@triton.jit
def _rotate_heads(base, cos1, sin1, cos2, sin2, heads, stride_h, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  HEADS_PAD: tl.constexpr):
    """NeoX rotation in place of one token's ``heads`` heads at ``base``: the first half of the
    rotary dims becomes ``x1 cos - x2 sin``, the second ``x2 cos + x1 sin``, each product and the
    sum rounded to the dtype as ``rot * cos + rotated * sin`` rounds them. Launched without
    floating-point fusion: on an H200, with it, the first product went unrounded into an FMA
    (a quarter of the values an ulp off eager's; none without)."""
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF_PAD)
    mask = (h < heads)[:, None] & (d < HALF)[None, :]
    first = base + h[:, None].to(tl.int64) * stride_h + d[None, :]
    dtype = base.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = (x1 * cos1).to(dtype).to(tl.float32) + (-x2 * sin1).to(dtype).to(tl.float32)
    out2 = (x2 * cos2).to(dtype).to(tl.float32) + (x1 * sin2).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + HALF, out2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
                   q_heads, k_heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                   K_HEADS_PAD: tl.constexpr):
    """One program per token: all its query and key heads, against its row of cos/sin."""
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_mask = d < HALF
    row = token * stride_ct
    cos1 = tl.load(cos_ptr + row + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + row + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + row + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + row + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, cos1, sin1, cos2, sin2, q_heads, stride_qh, HALF, HALF_PAD,
                  Q_HEADS_PAD)
    _rotate_heads(k_ptr + token * stride_kt, cos1, sin1, cos2, sin2, k_heads, stride_kh, HALF, HALF_PAD,
                  K_HEADS_PAD)


def rms_norm(layer: RMSNorm | GemmaRMSNorm, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
    """``layer(x)``, or with ``residual`` ``(layer(x + residual), x + residual)`` from one kernel."""
    if (x.dtype not in FUSED_DTYPES or x.dtype != layer.weight.dtype or x.numel() == 0
            or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape))):
        return layer.forward_native(x, residual)
    n = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    # without a residual the kernel reads and writes neither of its two extra rows (RESIDUAL is a constexpr)
    residual_rows, total = (rows, out) if residual is None else (_rows(residual), torch.empty_like(out))
    block = min(triton.next_power_of_2(n), RMS_NORM_TILE)
    _rms_norm_kernel[(rows.shape[0],)](rows, residual_rows, layer.weight, out, total, rows.stride(0),
                                       residual_rows.stride(0), out.stride(0), total.stride(0), n, layer.eps,
                                       BLOCK=block, ONE_PASS=block >= n, GEMMA=isinstance(layer, GemmaRMSNorm),
                                       RESIDUAL=residual is not None, num_warps=rms_norm_warps(block))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), total.view(x.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows of its last dimension, each contiguous: a view where it can be (a batch of
    tokens), else a copy (the q/k head norms' views of a fused qkv output)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_warps(block: int) -> int:
    """Warps for a row tile of ``block`` values: 4 up to 1024 (8 values a thread or fewer), 8 above."""
    return 4 if block <= 1024 else 8


def act_and_mul(layer: GatedActivation, x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in FUSED_DTYPES or x.numel() == 0:
        return layer.forward_native(x)
    rows = _rows(x)
    d = x.shape[-1] // 2
    out = torch.empty(rows.shape[0], d, dtype=x.dtype, device=x.device)
    _act_and_mul_kernel[(rows.shape[0], triton.cdiv(d, ACT_TILE))](
        rows, out, rows.stride(0), out.stride(0), d, ACT=GATED_ACTIVATIONS[layer.op_name], BLOCK=ACT_TILE)
    return out.view(*x.shape[:-1], d)


def rotary_embedding(layer: ApplyRotary, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on ``query`` [tokens, heads, head_dim] and ``key`` (views of a fused qkv output
    are fine: only the head dimension must be contiguous)."""
    dtype = query.dtype
    if (dtype not in FUSED_DTYPES or key.dtype != dtype or cos.dtype != dtype or sin.dtype != dtype
            or query.stride(-1) != 1 or key.stride(-1) != 1 or layer.rotary_dim % 2):
        return layer.forward_native(query, key, cos, sin)
    tokens = query.shape[0]
    if tokens == 0:
        return query, key
    cos, sin = cos.contiguous(), sin.contiguous()
    half = layer.rotary_dim // 2
    half_pad, q_heads_pad = triton.next_power_of_2(half), triton.next_power_of_2(query.shape[1])
    _rotary_kernel[(tokens,)](query, key, cos, sin, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
                              cos.stride(0), query.shape[1], key.shape[1], HALF=half, HALF_PAD=half_pad,
                              Q_HEADS_PAD=q_heads_pad, K_HEADS_PAD=triton.next_power_of_2(key.shape[1]),
                              num_warps=rotary_warps(q_heads_pad * half_pad), **ROTARY_OPTIONS)
    return query, key


def rotary_warps(tile: int) -> int:
    """Warps for a token's query-head tile of ``tile`` pairs: 4 up to 2048 (64 heads of a
    128-wide head on 4 warps took 156-166 registers a thread on sm_80/sm_90), 8 above."""
    return 4 if tile <= 2048 else 8


#: op name -> implementation (CustomOp.op_name)
FUSED_OPS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "gemma_rms_norm": rms_norm,
    "rotary_embedding": rotary_embedding,
    "fused_moe": fused_moe,
    **{name: act_and_mul for name in GATED_ACTIVATIONS},
}
