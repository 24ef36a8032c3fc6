"""A step's paged KV cache as FlexAttention ``BlockMask``s.

FlexAttention attends query sequences to key sequences under a mask; here every key
sequence is the whole cache, every slot of every block (``block * block_size + offset``).
Two things make that paged attention:

- the mask (``mask_mod``) maps a cache slot back to its place in a request: the block's
  logical index (one map for the whole step: a block shared by prefix caching sits at the
  same logical index in every request that holds it, since its hash chains from the
  start of the prompt), checks that the query's request holds that block there, and
  applies causality and the sliding window in positions;
- the block sparsity (``kv_indices``) lists, per query tile, only the blocks its tokens may
  read: the kernel never touches the rest of the cache.

A step's tokens form two groups, each one FlexAttention call. Decode rows (one query token
per request) are a batch of one-token sequences, each listing only its own request's
blocks: in one flat sequence, a tile of 16 decode rows from 16 requests would read all 16
requests' blocks for each row. The other requests' tokens (prompt chunks, verify steps) are
one flat sequence in tiles of ``PREFILL_Q_TILE`` tokens, each tile listing the union of its
tokens' blocks. Everything is built with tensor operations on the step's device, without reading
values back to the host.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

#: query rows per tile of the decode rows' mask (FlexAttention's smallest on a GPU)
Q_TILE = 16
#: query tokens per tile of the flat sequence's mask: a GPU kernel's query tile (64 rows, as
#: FlexAttention's own defaults take), whose blocks are a union over its tokens
PREFILL_Q_TILE = 64


class TokenGroup:
    """Some of a step's tokens, attended in one call: their flat indices (to gather the
    queries and scatter the outputs) and, for the mask, the same in a buffer of fixed shape."""

    def __init__(self, tokens: np.ndarray, buffer: torch.Tensor, whole_step: bool) -> None:
        self.count = len(tokens)
        self.buffer = buffer
        self.index = torch.from_numpy(tokens).to(buffer.device, non_blocking=True)
        #: the group is every token of the step, in order: no gather or scatter needed
        self.whole_step = whole_step


class StepLayout:
    """Per-step tensors every layer's masks read: each query token's request and position,
    the block table, and the logical index of every physical block the step uses.

    The masks read them from buffers that keep their shape from step to step (``LayoutBuffers``):
    a compiled mask whose captured tensors change shape is compiled again for dynamic
    shapes, and torch's CPU code generation fails on that form of this mask (torch 2.13).
    Entries past this step's tokens, requests and blocks are left from earlier steps. No
    query token's result depends on them: a token reads only its own request's row, and only
    columns up to its own position's block; the padding rows of a last query tile, which a
    compiled kernel evaluates too, read left-over entries (in bounds: the buffers are at least
    as large as any step's) and their results are discarded."""

    def __init__(self, query_start_loc_cpu: tuple[int, ...], seq_lens_cpu: tuple[int, ...],
                 block_table: torch.Tensor, block_size: int, buffers: "LayoutBuffers") -> None:
        starts = np.asarray(query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(seq_lens_cpu, dtype=np.int64)
        query_lens = np.diff(starts)
        num_tokens = int(starts[-1])
        request = np.repeat(np.arange(len(seq_lens)), query_lens)
        # a query token's position: its request's first new position plus its offset among them
        position = seq_lens[request] - query_lens[request] + np.arange(num_tokens) - starts[:-1][request]
        self.block_size = block_size
        self.step_table = block_table
        self.request, self.position, self.block_table = buffers.fill(request, position, block_table)
        self.num_request_blocks = torch.from_numpy(-(-seq_lens // block_size)).to(block_table.device,
                                                                                  non_blocking=True)
        decoding = query_lens[request] == 1
        groups = []
        for name, member in (("decode", decoding), ("prefill", ~decoding)):
            tokens = np.flatnonzero(member)
            groups.append(None if not len(tokens) else
                          TokenGroup(tokens, buffers.group(name, tokens), len(tokens) == num_tokens))
        self.decode, self.prefill = groups
        self._logical: dict[int, torch.Tensor] = {}

    def logical_block(self, num_blocks: int) -> torch.Tensor:
        """[num_blocks] int32: the logical index of each physical block a request of the step
        holds, -1 for the others (written through a spare last entry, no boolean indexing)."""
        logical = self._logical.get(num_blocks)
        if logical is None:
            table = self.step_table
            columns = torch.arange(table.shape[1], device=table.device, dtype=torch.int32)
            held = columns[None, :] < self.num_request_blocks[:, None]
            target = torch.where(held, table.long(), num_blocks)
            logical = torch.full((num_blocks + 1,), -1, dtype=torch.int32, device=table.device)
            logical.scatter_(0, target.flatten(), columns.expand_as(target).flatten())
            logical = self._logical[num_blocks] = _static(logical[:num_blocks])
        return logical


class LayoutBuffers:
    """A backend's step layout buffers on one device, grown to the next power of two when a
    step needs more: each growth is a compilation per layer configuration and kind of mask, so
    they start at sizes few engines outgrow (8,192 tokens a step, 256 requests, contexts of
    1,024 blocks; a few MB)."""

    def __init__(self) -> None:
        self._vectors: dict[str, torch.Tensor] = {}
        self._table: Optional[torch.Tensor] = None

    def fill(self, request: np.ndarray, position: np.ndarray, table: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if (self._table is None or self._table.device != table.device or self._table.shape[0] < table.shape[0]
                or self._table.shape[1] < table.shape[1]):
            rows, columns = table.shape if self._table is None else \
                (max(table.shape[0], self._table.shape[0]), max(table.shape[1], self._table.shape[1]))
            self._table = _static(torch.zeros((_capacity(rows, 256), _capacity(columns, 1024)), dtype=torch.int32,
                                              device=table.device))
        self._table[:table.shape[0], :table.shape[1]].copy_(table)
        return self.vector("request", request, table.device), self.vector("position", position, table.device), \
            self._table

    def group(self, name: str, tokens: np.ndarray) -> torch.Tensor:
        return self.vector(name, tokens, self._table.device)

    def vector(self, name: str, values: np.ndarray, device: torch.device) -> torch.Tensor:
        """The int32 buffer ``name``, its first entries set to ``values``."""
        buffer = self._vectors.get(name)
        if buffer is None or buffer.shape[0] < len(values) or buffer.device != device:
            buffer = self._vectors[name] = _static(torch.zeros(_capacity(len(values), 8192), dtype=torch.int32,
                                                               device=device))
        buffer[:len(values)].copy_(torch.from_numpy(values.astype(np.int32)), non_blocking=True)
        return buffer


def _capacity(needed: int, least: int) -> int:
    return max(least, 1 << (needed - 1).bit_length())


def _static(tensor: torch.Tensor) -> torch.Tensor:
    """Compiled with its shape as a constant, also after a growth: the dynamic-shape form of the
    mask is the one torch's CPU code generation fails on."""
    torch._dynamo.mark_static(tensor)
    return tensor


def decode_mask(layout: StepLayout, num_blocks: int, sliding_window: Optional[int], pad_to_cache: bool
                ) -> BlockMask:
    """The decode rows as a batch of one-token sequences (``b``: the row), each listing its own
    request's blocks. ``pad_to_cache``: each block list spans the whole cache (the CPU
    kernel asks that of the mask's shape)."""
    return _block_mask(layout, layout.decode, num_blocks, sliding_window, pad_to_cache, by_batch=True)


def prefill_mask(layout: StepLayout, num_blocks: int, sliding_window: Optional[int], pad_to_cache: bool
                 ) -> BlockMask:
    """The other tokens as one flat sequence, in tiles of ``PREFILL_Q_TILE``."""
    return _block_mask(layout, layout.prefill, num_blocks, sliding_window, pad_to_cache, by_batch=False)


def _block_mask(layout: StepLayout, group: TokenGroup, num_blocks: int, sliding_window: Optional[int],
                pad_to_cache: bool, by_batch: bool) -> BlockMask:
    """``group``'s mask: with ``by_batch`` one sequence of one query per token (the batch
    dimension), else one flat sequence in tiles of PREFILL_Q_TILE."""
    tile = 1 if by_batch else PREFILL_Q_TILE
    counts, indices = _block_lists(layout, group, tile, num_blocks, sliding_window, pad_to_cache)
    # kv_num_blocks / kv_indices are [batch, heads, query tiles(, blocks)]: one head dimension for all
    counts, indices = (counts[:, None, None], indices[:, None, None]) if by_batch else \
        (counts[None, None], indices[None, None])
    return BlockMask.from_kv_blocks(
        counts, indices, torch.zeros_like(counts), torch.zeros_like(indices),
        BLOCK_SIZE=(Q_TILE if by_batch else PREFILL_Q_TILE, layout.block_size),
        mask_mod=_mask_mod(layout, group.buffer, num_blocks, sliding_window, by_batch),
        seq_lengths=(1 if by_batch else group.count, num_blocks * layout.block_size), compute_q_blocks=False)


def _block_lists(layout: StepLayout, group: TokenGroup, tile: int, num_blocks: int, sliding_window: Optional[int],
                 pad_to_cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of ``tile`` tokens of the group: how many blocks its tokens may read, and
    which (the union over its tokens, each block once, first in the row)."""
    bs, table = layout.block_size, layout.step_table
    device = table.device
    columns = torch.arange(table.shape[1], device=device)
    tokens = group.index
    position = layout.position[tokens]
    # each token's blocks: from the window's first (or 0) to its own position's
    last = (position // bs).long()
    first = torch.zeros_like(last) if sliding_window is None else \
        ((position - sliding_window + 1).clamp(min=0) // bs).long()
    needed = (columns[None, :] >= first[:, None]) & (columns[None, :] <= last[:, None])
    blocks = torch.where(needed, table[layout.request[tokens].long()].long(), -1)
    num_tiles = -(-group.count // tile)
    if tile > 1:
        blocks = torch.nn.functional.pad(blocks, (0, 0, 0, num_tiles * tile - group.count), value=-1)
        blocks = blocks.reshape(num_tiles, -1).sort(dim=1).values
        repeated = torch.zeros_like(blocks, dtype=torch.bool)
        repeated[:, 1:] = blocks[:, 1:] == blocks[:, :-1]
        blocks = torch.where(repeated, -1, blocks)
    blocks = blocks.sort(dim=1, descending=True).values
    counts = (blocks >= 0).sum(dim=1).to(torch.int32)
    width = num_blocks if pad_to_cache else min(num_blocks, blocks.shape[1])
    indices = torch.zeros((num_tiles, width), dtype=torch.int32, device=device)
    kept = min(width, blocks.shape[1])
    indices[:, :kept] = blocks[:, :kept].clamp(min=0).to(torch.int32)
    return counts, indices


def _mask_mod(layout: StepLayout, group_tokens: torch.Tensor, num_blocks: int, sliding_window: Optional[int],
              by_batch: bool):
    """mask_mod(b, h, q, kv): the group's token ``b`` (decode rows) or ``q`` (a flat sequence)
    may read cache slot ``kv``."""
    bs, table = layout.block_size, layout.block_table
    request, position, logical = layout.request, layout.position, layout.logical_block(num_blocks)
    last_column = table.shape[1] - 1

    def mask_mod(b, h, q, kv):
        token = group_tokens[b if by_batch else q]
        block = kv // bs
        index = logical[block]
        key_position = index * bs + kv % bs
        held = table[request[token], index.clamp(0, last_column)] == block
        allowed = (index >= 0) & held & (key_position <= position[token])
        if sliding_window is not None:
            allowed = allowed & (position[token] - key_position < sliding_window)
        return allowed

    return mask_mod
