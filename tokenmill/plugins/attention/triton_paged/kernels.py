"""Triton kernels: KV-cache write by slot mapping, paged decode attention with split-K, and
tiled paged prefill attention.

Cache layout (the reference's): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
A token at absolute position ``p`` attends to positions ``[max(0, p - window + 1), p]`` of
its own request, read through the block table with an online softmax.

``paged_attention`` (decode rows: one query token per request) runs one program per
(token, KV head, KV split), the query heads of the KV head's group as the rows of
``tl.dot`` so that each K/V tile is read once for the group; long contexts are split across
``num_splits`` programs whose partial (max, sum, accumulator) triples a second kernel
merges (flash-decoding).
``prefill_attention`` (requests with several query tokens: prompt chunks over a cached
prefix, speculative verification) runs one program per (tile of query tokens, head), in
the manner of flash attention: each step multiplies the query tile by a tile of context
keys and values with ``tl.dot``, so the tensor cores do the work and K/V are read once per
tile rather than once per query token.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tokenmill.plugins.triton_env import INTERPRETED, ieee_fp32_dots

#: decode context positions a split takes at the least (flash-decoding's split size)
MIN_SPLIT_TOKENS = 256


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, stride_kt, stride_vt,
                     stride_c_kv, stride_c_block, stride_c_off, BLOCK_SIZE: tl.constexpr,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        cols = tl.arange(0, ROW_PAD)
        mask = cols < ROW  # a token's row: num_kv_heads * head_dim contiguous values
        base = cache_ptr + block * stride_c_block + offset * stride_c_off
        tl.store(base + cols, tl.load(key_ptr + token * stride_kt + cols, mask=mask), mask=mask)
        tl.store(base + stride_c_kv + cols, tl.load(value_ptr + token * stride_vt + cols, mask=mask), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr, cache_ptr, block_table_ptr, token_req_ptr, token_pos_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    scale, soft_cap, window,
    stride_qt, stride_qh, stride_c_kv, stride_c_block, stride_c_off, stride_c_head, stride_bt,
    stride_pt, stride_ph, stride_ps,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_TOKENS: tl.constexpr, TILE_N: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    """One program per (decode token, KV head, split): the GROUP query heads that share the KV
    head are the rows of ``tl.dot`` (padded to GROUP_PAD, the dot's least), so each K/V tile is
    read once for all of them; tiles of TILE_N positions gathered through the block table
    (several small blocks, or part of a large one); online softmax per query head."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(token_req_ptr + token)
    pos = tl.load(token_pos_ptr + token)
    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    first = 0
    if USE_WINDOW:
        first = tl.maximum(pos - window + 1, 0)
    # whole tiles a split, SPLIT_TOKENS (a multiple of TILE_N) at least: a context that many
    # splits of SPLIT_TOKENS cover is split at the same positions whatever NUM_SPLITS is, so a
    # recorded step (split as its longest allowed context) sums as the eager step (split as the
    # batch's longest) does, to the bit
    per_split = tl.maximum(((pos + 1 - first + NUM_SPLITS - 1) // NUM_SPLITS + TILE_N - 1) // TILE_N * TILE_N,
                           SPLIT_TOKENS)
    start = first + split * per_split
    end = tl.minimum(start + per_split, pos + 1)

    m = tl.full((GROUP_PAD,), -float("inf"), dtype=tl.float32)
    l = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_PAD), dtype=tl.float32)
    offsets = tl.arange(0, TILE_N)
    for tile in range(start, end, TILE_N):
        positions = tile + offsets
        valid = positions < end
        physical = tl.load(block_table_ptr + req * stride_bt + positions // BLOCK_SIZE, mask=valid, other=0)
        rows_at = (cache_ptr + physical.to(tl.int64) * stride_c_block + (positions % BLOCK_SIZE) * stride_c_off
                   + kv_head * stride_c_head)
        kv_mask = valid[:, None] & dim_mask[None, :]
        # a 16-bit cache under another dtype's queries (bf16 K/V of an fp16 model) meets them in
        # theirs: tl.dot takes operands of one dtype
        k = tl.load(rows_at[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE_FP32:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if USE_SOFT_CAP:
            scores = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * scores / soft_cap)) - 1.0)  # soft_cap * tanh(s / cap)
        scores = tl.where(valid[None, :], scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        v = tl.load(rows_at[:, None] + stride_c_kv + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    # a split past the context (a recorded step splits every row as its longest context would
    # be) writes only its statistics: m = -inf tells the merge to skip its partial row
    out = part_acc_ptr + token * stride_pt + heads[:, None] * stride_ph + split * stride_ps + dims[None, :]
    written = dims < tl.where(start < end, HEAD_DIM, 0)
    tl.store(out, acc, mask=row_mask[:, None] & written[None, :])
    stats = (token * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
    tl.store(part_m_ptr + stats, m, mask=row_mask)
    tl.store(part_l_ptr + stats, l, mask=row_mask)


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_pt, stride_ph, stride_ps,
                         stride_ot, stride_oh, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_DIM
    row = (token * tl.num_programs(1) + head) * NUM_SPLITS
    m_all = -float("inf")
    for s in range(NUM_SPLITS):
        m_all = tl.maximum(m_all, tl.load(part_m_ptr + row + s))
    total = 0.0
    acc = tl.zeros((HEAD_PAD,), dtype=tl.float32)
    for s in range(NUM_SPLITS):
        m_s = tl.load(part_m_ptr + row + s)
        filled = m_s != -float("inf")  # an empty split left its partial row unwritten
        weight = tl.where(filled, tl.exp(m_s - m_all), 0.0)
        total += tl.load(part_l_ptr + row + s) * weight
        acc += tl.load(part_acc_ptr + token * stride_pt + head * stride_ph + s * stride_ps + dims,
                       mask=dims < tl.where(filled, HEAD_DIM, 0), other=0.0) * weight
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, (acc / total).to(out_ptr.dtype.element_ty),
             mask=dim_mask)


def decode_tiles(group: int, head_pad: int, ieee_fp32: bool) -> tuple[int, int, int]:
    """(GROUP_PAD, TILE_N, num_warps) of the decode kernel: the query heads of a KV head padded
    to 16 (``tl.dot``'s least rows), cache positions a tile, and warps. A gathered tile holds
    a 64-bit address per element, so the tiles are what fits without spilling on sm_80 and
    sm_90 under Triton 3.6 (torch 2.11's, the GPU image's) and 3.9 (tests/test_triton_compile.py;
    benchmarks/README): 64 positions of a 128-wide head over 8 warps (4 spilled), 32 of a
    64-wide one over 4 (8 spilled a window's masks on sm_90) or of a 256-wide one over 8; 16
    where the queries are fp32 (IEEE dots), over 4 warps for 128-wide heads and 8 for the
    others (the other way round, Triton 3.6 spills 8 bytes on sm_80)."""
    if ieee_fp32:
        tile, warps = 16, 4 if head_pad == 128 else 8
    else:
        tile, warps = 64 if head_pad == 128 else 32, 4 if head_pad <= 64 else 8
    return max(16, triton.next_power_of_2(group)), tile, warps


def write_kv(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    tokens = key.shape[0]
    if tokens == 0:
        return
    # rounded to a narrower cache.kv_cache_dtype by torch (to nearest even) rather than by the
    # kernel's store: Triton's interpreter truncates fp32 -> bf16, a GPU rounds to nearest
    key = key.reshape(tokens, -1).to(cache.dtype).contiguous()
    value = value.reshape(tokens, -1).to(cache.dtype).contiguous()
    row = key.shape[1]
    _write_kv_kernel[(tokens,)](key, value, cache, slot_mapping, key.stride(0), value.stride(0),
                                cache.stride(0), cache.stride(1), cache.stride(2),
                                BLOCK_SIZE=cache.shape[2], ROW=row, ROW_PAD=triton.next_power_of_2(row))


def paged_attention(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, token_req: torch.Tensor,
                    token_pos: torch.Tensor, scale: float, soft_cap, window, num_splits: int,
                    split_tokens: int = MIN_SPLIT_TOKENS, tiles: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Decode attention, each context in splits of ``split_tokens`` positions (more where
    ``num_splits`` of them fall short). ``tiles``: (TILE_N, num_warps) in place of
    ``decode_tiles``' (benchmarks/gpu_attention.py's sweep)."""
    tokens, heads, head_dim = query.shape
    kv_heads = cache.shape[3]
    head_pad = triton.next_power_of_2(head_dim)
    ieee = ieee_fp32_dots(query.dtype)
    group_pad, tile_n, num_warps = decode_tiles(heads // kv_heads, head_pad, ieee)
    if tiles is not None:
        tile_n, num_warps = tiles
    acc = torch.empty(tokens, heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    m = torch.empty(tokens, heads, num_splits, dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    grid = (tokens, kv_heads, num_splits)
    _paged_attention_kernel[grid](
        query, cache, block_table, token_req, token_pos, acc, m, l,
        scale, soft_cap or 1.0, window or 0,
        query.stride(0), query.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_table.stride(0), acc.stride(0), acc.stride(1), acc.stride(2),
        GROUP=heads // kv_heads, GROUP_PAD=group_pad, BLOCK_SIZE=cache.shape[2], HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, NUM_SPLITS=num_splits, SPLIT_TOKENS=-(-split_tokens // tile_n) * tile_n, TILE_N=tile_n,
        USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=window is not None, IEEE_FP32=ieee, num_warps=num_warps,
    )
    out = torch.empty_like(query)
    _merge_splits_kernel[(tokens, heads)](acc, m, l, out, acc.stride(0), acc.stride(1), acc.stride(2),
                                          out.stride(0), out.stride(1), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
                                          NUM_SPLITS=num_splits)
    return out


@triton.jit
def _prefill_attention_kernel(
    q_ptr, cache_ptr, block_table_ptr, out_ptr, tile_req_ptr, tile_start_ptr, query_start_ptr, seq_lens_ptr,
    scale, soft_cap, window,
    stride_qt, stride_qh, stride_c_kv, stride_c_block, stride_c_off, stride_c_head, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    """One program per (tile of BLOCK_M query tokens of one request, head): flash attention
    over the request's paged context, BLOCK_N context positions (any number of cache blocks,
    gathered through the block table) per step."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    req = tl.load(tile_req_ptr + tile)
    first_row = tl.load(tile_start_ptr + tile)
    q_start = tl.load(query_start_ptr + req)
    q_end = tl.load(query_start_ptr + req + 1)
    first_pos = tl.load(seq_lens_ptr + req) - (q_end - q_start)  # the request's first query position
    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < q_end
    pos = first_pos + rows - q_start
    dims = tl.arange(0, HEAD_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if IEEE_FP32:
        q = q.to(tl.float32)
    last_pos = first_pos + tl.minimum(first_row + BLOCK_M, q_end) - 1 - q_start
    low = 0
    if USE_WINDOW:
        low = tl.maximum(first_pos + first_row - q_start - window + 1, 0)
    low = (low // BLOCK_N) * BLOCK_N
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_PAD), tl.float32)
    for start in range(low, last_pos + 1, BLOCK_N):
        kv = start + tl.arange(0, BLOCK_N)
        kv_valid = kv <= last_pos
        physical = tl.load(block_table_ptr + req * stride_bt + kv // BLOCK_SIZE, mask=kv_valid, other=0)
        base = (cache_ptr + physical.to(tl.int64) * stride_c_block + (kv % BLOCK_SIZE) * stride_c_off
                + kv_head * stride_c_head)
        kv_mask = kv_valid[:, None] & dim_mask[None, :]
        k = tl.load(base[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE_FP32:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        if USE_SOFT_CAP:
            scores = soft_cap * (2.0 / (1.0 + tl.exp(-2.0 * scores / soft_cap)) - 1.0)  # soft_cap * tanh(s / cap)
        visible = (kv[None, :] <= pos[:, None]) & kv_valid[None, :]
        if USE_WINDOW:
            visible = visible & (kv[None, :] > pos[:, None] - window)
        scores = tl.where(visible, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with nothing visible yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(base[:, None] + stride_c_kv + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE_FP32:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & dim_mask[None, :])


def prefill_attention(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor,
                      tile_req: torch.Tensor, tile_start: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, soft_cap, window, block_m: int,
                      step: Optional[tuple[int, int]] = None) -> None:
    """Attention for the query tiles (``tile_req``, ``tile_start``: each tile's request and
    first flat token), written into ``out`` at those tokens. ``step``: (BLOCK_N, num_warps)
    in place of ``prefill_tiles``' (benchmarks/gpu_attention.py's sweep)."""
    tiles = tile_req.shape[0]
    if tiles == 0:
        return
    _, heads, head_dim = query.shape
    head_pad = max(16, triton.next_power_of_2(head_dim))
    ieee_fp32 = ieee_fp32_dots(query.dtype)
    block_n, num_warps = (32, 4) if INTERPRETED else prefill_tiles(ieee_fp32, head_pad)
    if step is not None:
        block_n, num_warps = step
    _prefill_attention_kernel[(tiles, heads)](
        query, cache, block_table, out, tile_req, tile_start, query_start_loc, seq_lens,
        scale, soft_cap or 1.0, window or 0,
        query.stride(0), query.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        block_table.stride(0), out.stride(0), out.stride(1),
        GROUP=heads // cache.shape[3], BLOCK_SIZE=cache.shape[2], HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=window is not None, IEEE_FP32=ieee_fp32,
        num_warps=num_warps,
    )


def prefill_tiles(ieee_fp32: bool, head_pad: int) -> tuple[int, int]:
    """(context positions per step, warps) of the prefill kernel on a GPU, for its 32-token
    query tiles: the largest that compile without spilling registers on sm_80 and sm_90 under
    Triton 3.6 and 3.9 (fp32 tiles take twice the registers of bf16/fp16 ones;
    tests/test_triton_compile.py). Tensor-core tiles of 64-wide heads step 16 positions: at
    32, Triton 3.6 caps them at 128 registers and spills 16-56 bytes. fp32 tiles of 256-wide
    heads take 16 warps: over 8, either version spills 8-56 bytes for some cache block sizes."""
    if ieee_fp32:
        return (32, 8) if head_pad <= 64 else (16, 4) if head_pad == 128 else (16, 16)
    return (16, 8) if head_pad <= 64 else (32, 8)
