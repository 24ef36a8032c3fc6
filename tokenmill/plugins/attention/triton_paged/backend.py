"""The ``triton`` attention backend: paged KV write and varlen paged attention in Triton.

It needs a CUDA GPU for real use; without one, selecting it fails at startup
with that reason, unless the Triton interpreter was requested explicitly
(``TRITON_INTERPRET=1``, read when this module is imported), which is how the
CPU test suite runs its kernels.
"""

from __future__ import annotations

import os

import torch

from tokenmill.interfaces.attention import AttentionCapabilities, AttentionLayerSpec, AttentionMetadata
from tokenmill.plugins.attention.triton_paged import kernels

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
class TritonPagedAttention:
    name = "triton"
    capabilities = AttentionCapabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        block_sizes=(4, 8, 16, 32, 64, 128),  # tl.arange needs powers of two
        sliding_window=True,
        logits_soft_cap=True,
        requires_device=None if _INTERPRETED else "cuda",
        kv_cache_dtypes=(torch.bfloat16,),  # K/V rounded before the write kernel; loads widen to fp32
    )

    def __init__(self, tokens_per_split: int = 256) -> None:
        #: contexts longer than this are split across programs (flash-decoding), then merged
        self.tokens_per_split = tokens_per_split

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        dst[:, pairs[:, 1].to(dst.device)] = src[:, pairs[:, 0].to(src.device)].to(dst.device)

    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        kernels.write_kv(kv_cache, key, value, metadata.slot_mapping)
        starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        token_req, token_pos = [], []
        for i, seq_len in enumerate(seq_lens):
            q_len = starts[i + 1] - starts[i]
            token_req += [i] * q_len
            token_pos += range(seq_len - q_len, seq_len)
        device = query.device
        num_splits = max(1, min(16, -(-metadata.max_seq_len // self.tokens_per_split)))
        return kernels.paged_attention(
            query.contiguous(), kv_cache, metadata.block_table,
            torch.tensor(token_req, dtype=torch.int32, device=device),
            torch.tensor(token_pos, dtype=torch.int32, device=device),
            layer.scale, layer.logits_soft_cap, layer.sliding_window, num_splits,
        )
