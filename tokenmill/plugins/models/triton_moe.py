"""The GPU path for mixture-of-experts layers: routing and expert GEMMs with no host sync.

``FusedMoE.forward_native`` counts each expert's tokens on the host (a device-to-host
copy per layer) and loops over experts in Python; on a GPU that stalls the stream and
cannot be recorded in a CUDA graph. Here, as in vLLM's ``fused_moe``:

- ``align_block_size`` sorts the (token, k) pairs by expert and pads each expert's run
  to a multiple of ``BLOCK_M`` with torch ops whose output shapes depend only on
  (tokens, top_k, experts, BLOCK_M), never on the routing: the padded length is bounded
  by ``pairs + min(experts, pairs) * (BLOCK_M - 1)`` and the true length stays on the
  device (``num_padded``);
- ``_fused_moe_kernel`` runs one program per (block of ``BLOCK_M`` sorted pairs, block
  of ``BLOCK_N`` outputs). Every block holds one expert's pairs, so it multiplies the
  gathered rows by that expert's weight; blocks past ``num_padded`` (the kernel reads it
  from memory) return at once, so the grid is sized from the bound.

``fused_moe(layer, x)`` is ``FusedMoE``'s implementation for a platform to return from
``Platform.custom_op`` for op ``"fused_moe"``. It lives beside the MoE models, as the
other Triton paths live beside what they serve (quantization, adapters, attention); the
core may not import Triton.

Written for GPUs; tested on CPU with ``TRITON_INTERPRET=1`` against the loop path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.core.layers.moe import FusedMoE
from tokenmill.plugins.triton_env import ieee_fp32_dots


class ExpertBlocks(NamedTuple):
    """The (token, k) pairs (pair ``p`` is token ``p // top_k``'s ``p % top_k``-th choice)
    grouped by expert in blocks of ``block_m``; shapes fixed by the batch's shape alone."""

    #: ``[num_blocks * block_m]`` int32: pair ids, expert by expert, each expert's run padded
    #: to a whole number of blocks with ``num_pairs`` (out of range)
    sorted_pair_ids: torch.Tensor
    #: ``[num_blocks]`` int32: the expert of each block; -1 for blocks past ``num_padded``
    expert_ids: torch.Tensor
    #: ``[1]`` int32: how many entries of ``sorted_pair_ids`` the experts' padded runs fill
    num_padded: torch.Tensor


def align_block_size(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Group ``experts [T, top_k]`` (each token's chosen experts) into ``block_m``-pair blocks
    of one expert each, on the device: no op here reads a value back to the host."""
    flat = experts.flatten()
    num_pairs = flat.numel()
    device = flat.device
    # each non-empty expert pads by at most block_m - 1, and at most min(E, pairs) are non-empty
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = flat.argsort(stable=True)  # pair ids by expert
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    slots = (padded_ends - padded)[sorted_experts] + rank_in_expert
    sorted_pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, slots, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    num_padded = padded_ends[-1:]
    # the expert whose padded run holds the block: the first one ending after its start
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(block_starts < num_padded, expert_ids, -1).to(torch.int32)
    return ExpertBlocks(sorted_pair_ids, expert_ids, num_padded.to(torch.int32))


@triton.jit
def _fused_moe_kernel(
    a_ptr, w_ptr, c_ptr, routed_weight_ptr, sorted_pair_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_pairs, pairs_per_row,
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    """``c[p, :] = a[p // pairs_per_row, :] @ w[expert(p)]^T`` (times ``routed_weight[p]``
    with MUL_ROUTED_WEIGHT) for the pairs ``p`` of this program's block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ptr + offs_m).to(tl.int64)
    mask_m = pairs < num_pairs  # padding holds num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_rows = a_ptr + (pairs // pairs_per_row)[:, None] * stride_am
    w_cols = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn  # w[expert] read as [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_cols + offs_k[:, None] * stride_wk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IEEE_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:  # fp16/bf16: tensor cores, fp32 accumulation
            acc += tl.dot(a, w)
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(routed_weight_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


#: (BLOCK_M, BLOCK_N, BLOCK_K): vLLM's default tiles, the small one where experts get few
#: pairs each; fp32's IEEE dots take 32 rows where fp16/bf16 take 64 (a 64-row fp32 tile
#: spills registers on sm_80)
SMALL_TILES = (16, 32, 64)
LARGE_TILES = (64, 64, 32)
FP32_LARGE_TILES = (32, 64, 32)


def tiles_for(num_pairs: int, num_experts: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """The tiles for a batch of ``num_pairs`` (token, k) pairs: 16-row blocks while the average
    expert gets at most 16 pairs (larger blocks would be mostly padding), else the large tile."""
    if num_pairs <= 16 * num_experts:
        return SMALL_TILES
    return FP32_LARGE_TILES if dtype == torch.float32 else LARGE_TILES


def expert_gemm(a: torch.Tensor, weights: torch.Tensor, blocks: ExpertBlocks, routed_weights: torch.Tensor,
                pairs_per_row: int, tiles: tuple[int, int, int], mul_routed_weight: bool) -> torch.Tensor:
    """``[num_pairs, N]``: row ``p`` is ``a[p // pairs_per_row] @ weights[expert of p]^T``, times
    ``routed_weights[p]`` (fp32, one per pair) with ``mul_routed_weight``; ``weights`` is ``[E, N, K]``."""
    block_m, block_n, block_k = tiles
    n, k = weights.shape[1], weights.shape[2]
    num_pairs = routed_weights.numel()
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (blocks.expert_ids.numel(), triton.cdiv(n, block_n))
    _fused_moe_kernel[grid](
        a, weights, c, routed_weights, blocks.sorted_pair_ids, blocks.expert_ids, blocks.num_padded,
        n, k, num_pairs, pairs_per_row,
        a.stride(0), a.stride(1), weights.stride(0), weights.stride(1), weights.stride(2), c.stride(0), c.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, MUL_ROUTED_WEIGHT=mul_routed_weight,
        IEEE_FP32=ieee_fp32_dots(a.dtype),
    )
    return c


def fused_moe(layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """``layer``'s output for ``x [T, hidden]``: gate/up GEMM, activation, down GEMM weighted
    by the routing, summed over each token's top-k, then the tensor-parallel all-reduce."""
    weights, experts = layer.route(x)
    num_tokens, top_k = experts.shape
    num_pairs = num_tokens * top_k
    tiles = tiles_for(num_pairs, layer.num_experts, x.dtype)
    blocks = align_block_size(experts, layer.num_experts, tiles[0])
    routed_weights = weights.flatten()
    gate_up = expert_gemm(x, layer.w13, blocks, routed_weights, top_k, tiles, False)
    down = expert_gemm(layer.act_and_mul(gate_up), layer.w2, blocks, routed_weights, 1, tiles, True)
    return layer.all_reduce(down.view(num_tokens, top_k, down.shape[1]).sum(dim=1))
