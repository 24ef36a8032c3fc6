"""The flex backend: FlexAttention over the paged cache equals the reference where blocks are
shared (prefix caching), lists only the blocks a query tile may read, never reads an earlier
step's leftovers, and gives the unfused path's results when compiled."""

from __future__ import annotations

import pytest
import torch

from tokenmill.interfaces.attention import AttentionLayerSpec, AttentionMetadata
from tokenmill.plugins.attention.flex.backend import FlexAttentionBackend
from tokenmill.plugins.attention.flex.paged_block_mask import LayoutBuffers, StepLayout, decode_mask, prefill_mask
from tokenmill.plugins.attention.torch_ref import TorchReferenceAttention
from tokenmill.testing.attention_conformance import check_backend, conformance_cases, supports

BS = 16


def step(tables: list[list[int]], requests: list[tuple[int, int]]) -> AttentionMetadata:
    """Metadata for requests of (tokens cached, new tokens) over the given block tables."""
    starts, seq_lens, slots = [0], [], []
    for (cached, new), table in zip(requests, tables):
        starts.append(starts[-1] + new)
        seq_lens.append(cached + new)
        slots += [table[p // BS] * BS + p % BS for p in range(cached, cached + new)]
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), max_query_len=max(n for _, n in requests),
        max_seq_len=max(seq_lens), query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(seq_lens), block_size=BS)


def attend(backend, spec, metadata, cache, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = metadata.query_start_loc_cpu[-1]
    q = torch.randn(tokens, spec.num_heads, spec.head_dim, generator=g)
    k, v = (torch.randn(tokens, spec.num_kv_heads, spec.head_dim, generator=g) for _ in range(2))
    build = getattr(backend, "build_metadata", None)
    return backend.forward(spec, q, k, v, cache, build(metadata) if build else metadata)


@pytest.mark.parametrize("window", [None, 20])
def test_blocks_shared_by_prefix_caching_are_read_by_every_holder(window):
    """Two requests hold the same two prompt blocks (prefix caching: at the same logical index in
    both); each reads them as its own, one decoding and one prefilling a chunk after them."""
    spec = AttentionLayerSpec(4, 2, 32, 32**-0.5, sliding_window=window)
    cache = torch.randn(2, 12, BS, 2, 32, generator=torch.Generator().manual_seed(1))
    metadata = step([[7, 2, 9], [7, 2, 4, 11]], [(40, 1), (35, 20)])
    expected = attend(TorchReferenceAttention(), spec, metadata, cache.clone())
    got = attend(FlexAttentionBackend(compile=False), spec, metadata, cache.clone())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def listed_blocks(mask) -> list[set[int]]:
    counts = mask.kv_num_blocks.flatten().tolist()
    rows = mask.kv_indices.reshape(len(counts), -1)
    return [set(rows[i, :count].tolist()) for i, count in enumerate(counts)]


def test_each_query_tile_lists_only_the_blocks_its_tokens_may_read():
    """Two decodes (one in a 20-token window: its last 2 of 5 blocks) each list their own
    blocks; a fresh 31-token prompt (one tile of 64) lists its two blocks, and a 130-token chunk
    after 70 cached tokens in a 20-token window lists per tile only the blocks from its first
    token's window to its last token."""
    metadata = step([[3, 8, 5, 1, 6], [10, 2], [4, 7], list(range(20, 33))], [(79, 1), (0, 31), (17, 1), (70, 130)])
    layout = StepLayout(metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_table, BS,
                        LayoutBuffers())
    assert layout.decode.index.tolist() == [0, 32] and layout.prefill.count == 161
    assert listed_blocks(decode_mask(layout, 40, 20, pad_to_cache=False)) == [{1, 6}, {4, 7}]
    assert listed_blocks(decode_mask(layout, 40, None, pad_to_cache=False)) == [{3, 8, 5, 1, 6}, {4, 7}]
    prefill = prefill_mask(layout, 40, 20, pad_to_cache=True)
    # tiles of the flat sequence: tokens 0-63 (the prompt's 31, the chunk's positions 70-102),
    # 64-127 (positions 103-166), 128-160 (positions 167-199); blocks b hold positions 16b..16b+15
    assert listed_blocks(prefill) == [{10, 2} | {23, 24, 25, 26}, {25, 26, 27, 28, 29, 30},
                                      {29, 30, 31, 32}] and prefill.kv_indices.shape[-1] == 40


def test_a_step_after_a_larger_one_reads_none_of_its_leftovers():
    """One backend through steps of shrinking and growing layouts: its buffers keep the largest
    step's rows and columns, which a later step must not read."""
    backend = FlexAttentionBackend(compile=False)
    cases = [c for c in conformance_cases(120, seed=3) if supports(backend, c)]
    cases.sort(key=lambda c: -sum(cached + new for cached, new in c.requests))
    for case in cases[:4] + cases[-4:] + cases[:2]:
        check_backend(backend, case)


def test_compiled_flex_equals_its_unfused_path_across_steps():
    """The fused kernel FlexAttention generates (here the CPU's C++) gives the unfused path's
    outputs, over decode, prefill and mixed steps on one cache, as an engine's would be, in a
    sliding window (where the tiles' block lists leave blocks out)."""
    spec = AttentionLayerSpec(4, 2, 32, 32**-0.5, sliding_window=24)
    compiled, unfused = FlexAttentionBackend(), FlexAttentionBackend(compile=False)
    cache = torch.randn(2, 40, BS, 2, 32, generator=torch.Generator().manual_seed(2))
    steps = [step([[5, 9, 2]], [(0, 37)]), step([[5, 9, 2], [30, 31]], [(37, 1), (0, 20)]),
             step([[5, 9, 2], [30, 31], [1]], [(38, 1), (20, 1), (0, 3)]), step([[5, 9, 2]], [(39, 1)])]
    for index, metadata in enumerate(steps):
        expected = attend(unfused, spec, metadata, cache.clone(), seed=index)
        got = attend(compiled, spec, metadata, cache.clone(), seed=index)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
