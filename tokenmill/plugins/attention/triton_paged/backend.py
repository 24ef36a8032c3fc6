"""The ``triton`` attention backend: paged KV write, decode and tiled prefill attention in Triton.

It needs a CUDA GPU for real use; without one, selecting it fails at startup
with that reason, unless the Triton interpreter was requested explicitly
(``TRITON_INTERPRET=1``, read when this module is imported), which is how the
CPU test suite runs its kernels.

The step's layout is worked out once, by ``build_metadata`` (which the model runner calls
once per step): which tokens are decode rows and their positions, which query tiles the
prefill kernel runs, how many ways to split long decode contexts. It goes to the device
as a handful of tensors, so a layer's forward does no Python work per token or request.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton

from tokenmill.interfaces.attention import AttentionCapabilities, AttentionLayerSpec, AttentionMetadata
from tokenmill.plugins.attention.torch_ref import copy_blocks
from tokenmill.plugins.attention.triton_paged import kernels
from tokenmill.plugins.triton_env import INTERPRETED

_COMMON_FIELDS = tuple(f.name for f in fields(AttentionMetadata))


@dataclass(frozen=True, slots=True)
class TritonMetadata(AttentionMetadata):
    """The common metadata, and the step's plan for the kernels (all on the device)."""

    #: decode rows (requests with one query token): their flat token index, request, position
    decode_tokens: torch.Tensor = None
    decode_req: torch.Tensor = None
    decode_pos: torch.Tensor = None
    #: every token is a decode row (then the decode kernel reads and writes in place)
    decode_only: bool = False
    #: the prefill kernel's query tiles: each one's request and first flat token
    tile_req: torch.Tensor = None
    tile_start: torch.Tensor = None
    #: ways to split the longest decode context (flash-decoding)
    num_splits: int = 1


class TritonPagedAttention:
    name = "triton"
    capabilities = AttentionCapabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        block_sizes=(4, 8, 16, 32, 64, 128),  # tl.arange needs powers of two
        sliding_window=True,
        logits_soft_cap=True,
        requires_device=None if INTERPRETED else "cuda",
        kv_cache_dtypes=(torch.bfloat16,),  # K/V rounded before the write kernel; loads widen to fp32
        cuda_graph=True,
    )

    def __init__(self, tokens_per_split: int = kernels.MIN_SPLIT_TOKENS,
                 block_m: int = 16 if INTERPRETED else 32) -> None:
        #: decode contexts longer than this are split across programs (flash-decoding), then merged
        self.tokens_per_split = tokens_per_split
        #: query tokens per prefill program (context positions per step: ``kernels.prefill_tiles``)
        self.block_m = block_m

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        copy_blocks(src, dst, pairs)

    def build_metadata(self, common: AttentionMetadata) -> TritonMetadata:
        """Once per step: from the host copies of the layout, no device synchronisation."""
        starts, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu
        decode_tokens, decode_req, decode_pos, tile_req, tile_start = [], [], [], [], []
        longest_decode = 0
        for i, seq_len in enumerate(seq_lens):
            start, end = starts[i], starts[i + 1]
            if end - start == 1:
                decode_tokens.append(start)
                decode_req.append(i)
                decode_pos.append(seq_len - 1)
                longest_decode = max(longest_decode, seq_len)
            else:
                for first in range(start, end, self.block_m):
                    tile_req.append(i)
                    tile_start.append(first)
        device = common.seq_lens.device

        def on_device(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)

        return TritonMetadata(
            *(getattr(common, name) for name in _COMMON_FIELDS),
            decode_tokens=on_device(decode_tokens).long(), decode_req=on_device(decode_req),
            decode_pos=on_device(decode_pos), decode_only=len(decode_tokens) == starts[-1],
            tile_req=on_device(tile_req), tile_start=on_device(tile_start),
            num_splits=self.num_splits(longest_decode))

    def graph_metadata(self, common: AttentionMetadata, positions: torch.Tensor, max_seq_len: int) -> TritonMetadata:
        """A recorded decode step's plan: row i is request i, at ``positions[i]`` (the graph's
        position buffer), split as many ways as the longest context allowed would be; a
        shorter context leaves the splits past its blocks empty, and the merge skips them."""
        rows = torch.arange(positions.shape[0], dtype=torch.int32, device=positions.device)
        return TritonMetadata(
            *(getattr(common, name) for name in _COMMON_FIELDS),
            decode_tokens=rows.long(), decode_req=rows, decode_pos=positions, decode_only=True,
            tile_req=rows[:0], tile_start=rows[:0], num_splits=self.num_splits(max_seq_len))

    def num_splits(self, longest_decode: int) -> int:
        """Ways to split the decode contexts: a power of two up to 16, as ``NUM_SPLITS`` is a
        kernel constant: five compiled variants (tokenmill/testing/triton_aot.py compiles
        them), not sixteen compiled on first use in the middle of serving. Splits past a
        context's blocks stay empty, and the merge skips them."""
        return min(16, triton.next_power_of_2(max(1, -(-longest_decode // self.tokens_per_split))))

    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if not isinstance(metadata, TritonMetadata):  # a caller that skipped build_metadata
            metadata = self.build_metadata(metadata)
        kernels.write_kv(kv_cache, key, value, metadata.slot_mapping)
        query = query.contiguous()
        window, cap = layer.sliding_window, layer.logits_soft_cap
        if metadata.decode_only:
            return kernels.paged_attention(query, kv_cache, metadata.block_table, metadata.decode_req,
                                           metadata.decode_pos, layer.scale, cap, window, metadata.num_splits,
                                           self.tokens_per_split)
        out = torch.empty_like(query)
        if metadata.decode_tokens.numel():
            out[metadata.decode_tokens] = kernels.paged_attention(
                query[metadata.decode_tokens], kv_cache, metadata.block_table, metadata.decode_req,
                metadata.decode_pos, layer.scale, cap, window, metadata.num_splits, self.tokens_per_split)
        kernels.prefill_attention(query, kv_cache, metadata.block_table, out, metadata.tile_req, metadata.tile_start,
                                  metadata.query_start_loc, metadata.seq_lens, layer.scale, cap, window,
                                  self.block_m)
        return out
