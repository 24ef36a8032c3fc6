"""The portable reference backend: plain PyTorch, one request at a time.

It is the ground truth the conformance tests compare every other backend
with, so it favours obviousness over speed: gather the request's blocks,
build the causal (and sliding-window) mask explicitly, softmax in float32.
"""

from __future__ import annotations

import torch

from tokenmill.interfaces.attention import (
    AttentionCapabilities,
    AttentionLayerSpec,
    AttentionMetadata,
)
from tokenmill.interfaces.hookspecs import hookimpl


class TorchReferenceAttention:
    name = "torch"
    capabilities = AttentionCapabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        sliding_window=True,
        logits_soft_cap=True,
        kv_cache_dtypes=(torch.bfloat16,),
    )

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        copy_blocks(src, dst, pairs)

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
        output = torch.empty_like(query)
        block_size = metadata.block_size
        group = layer.num_heads // layer.num_kv_heads
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            q = query[starts[i]:starts[i + 1]]  # [q_len, num_heads, head_dim]
            q_len = q.shape[0]
            blocks = metadata.block_table[i, : -(-seq_len // block_size)].long()
            k = key_cache[blocks].flatten(0, 1)[:seq_len]  # [seq_len, num_kv_heads, head_dim]
            v = value_cache[blocks].flatten(0, 1)[:seq_len]
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * layer.scale
            if layer.logits_soft_cap is not None:
                scores = layer.logits_soft_cap * torch.tanh(scores / layer.logits_soft_cap)
            q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            allowed = k_pos <= q_pos
            if layer.sliding_window is not None:
                allowed &= q_pos - k_pos < layer.sliding_window
            scores.masked_fill_(~allowed, float("-inf"))
            probs = scores.softmax(dim=-1)
            output[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(query.dtype)
        return output


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """``swap_blocks`` of the [2, num_blocks, ...] layout: (source block, destination block)
    pairs from ``src`` to ``dst``, which may be on another device (the host swap space)."""
    dst[:, pairs[:, 1].to(dst.device)] = src[:, pairs[:, 0].to(src.device)].to(dst.device)


def write_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]; -1 = skip
) -> None:
    """Scatter new K/V into their slots (slot = block_id * block_size + offset), rounded
    to the cache's dtype."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep].to(value_cache.dtype)


@hookimpl
def register_attention_backends(register):
    register("torch", TorchReferenceAttention)
    # lazy: listing plugins never imports triton (or compiles anything)
    register("triton", "tokenmill.plugins.attention.triton_paged.backend:TritonPagedAttention")
    register("flex", "tokenmill.plugins.attention.flex.backend:FlexAttentionBackend")


@hookimpl(trylast=True)
def select_attention_backend(device, model_config):
    return "torch"
