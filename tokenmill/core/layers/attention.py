"""The attention layer: model code calls it; the chosen backend does the work."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.interfaces.attention import AttentionBackend, AttentionLayerSpec, AttentionMetadata


class Attention(nn.Module):
    """Holds a layer's spec and, once the engine allocates it, its KV-cache tensor."""

    def __init__(self, spec: AttentionLayerSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.kv_cache: Optional[torch.Tensor] = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        assert self.kv_cache is not None, "KV cache not bound: build the model through the engine"
        return self.backend.forward(self.spec, query, key, value, self.kv_cache, metadata)
