"""``flat``: attention over a flat (block-free) view of the paged cache.

An example of a third-party backend: it stores K/V through the slot mapping
like any backend, then attends for the whole batch at once over one padded
gather with a single masked softmax, instead of a loop over requests. It uses
only ``tokenmill.interfaces`` and is tested with tokenmill's conformance kit.
"""

from __future__ import annotations

import torch

from tokenmill.interfaces.attention import AttentionCapabilities
from tokenmill.interfaces.hookspecs import hookimpl


class FlatAttention:
    name = "flat"
    capabilities = AttentionCapabilities(dtypes=(torch.float32, torch.bfloat16), sliding_window=True,
                                         logits_soft_cap=True)

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def swap_blocks(self, src, dst, pairs):
        dst[:, pairs[:, 1]] = src[:, pairs[:, 0]]

    def forward(self, layer, query, key, value, kv_cache, metadata):
        keys, values = kv_cache[0], kv_cache[1]
        slots = metadata.slot_mapping
        keep = slots >= 0
        keys.view(-1, *keys.shape[2:])[slots[keep]] = key[keep]
        values.view(-1, *values.shape[2:])[slots[keep]] = value[keep]
        block_size = metadata.block_size
        width = -(-metadata.max_seq_len // block_size) * block_size
        table = metadata.block_table.long()
        # [requests, width, kv_heads, head_dim] for every request at once (padding masked below)
        k = keys[table].flatten(1, 2)[:, :width].float()
        v = values[table].flatten(1, 2)[:, :width].float()
        starts = metadata.query_start_loc_cpu
        request_of = torch.repeat_interleave(torch.arange(metadata.num_reqs),
                                             torch.tensor([starts[i + 1] - starts[i] for i in range(metadata.num_reqs)]))
        seq_lens = metadata.seq_lens.long()
        query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
        positions = (seq_lens - query_lens)[request_of] + torch.arange(query.shape[0]) - metadata.query_start_loc[:-1].long()[request_of]
        group = layer.num_heads // layer.num_kv_heads
        k_tok = k[request_of].repeat_interleave(group, dim=2)  # [tokens, width, heads, dim]
        v_tok = v[request_of].repeat_interleave(group, dim=2)
        scores = torch.einsum("thd,tkhd->thk", query.float(), k_tok) * layer.scale
        if layer.logits_soft_cap is not None:
            scores = layer.logits_soft_cap * torch.tanh(scores / layer.logits_soft_cap)
        kpos = torch.arange(width)[None, :]
        allowed = kpos <= positions[:, None]
        if layer.sliding_window is not None:
            allowed &= positions[:, None] - kpos < layer.sliding_window
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        return torch.einsum("thk,tkhd->thd", scores.softmax(-1), v_tok).to(query.dtype)


@hookimpl
def register_attention_backends(register):
    register("flat", FlatAttention)
