"""KV-cache tensors: each attention layer's paged cache on the device, and its host twin
for swapped-out blocks. The builder decides how many blocks; the worker side allocates."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from tokenmill.core.layers.attention import Attention
from tokenmill.interfaces.attention import AttentionBackend, AttentionLayerSpec


def allocate_kv_caches(model: nn.Module, backend: AttentionBackend, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: str) -> list[tuple[AttentionLayerSpec, torch.Tensor]]:
    """Allocate and bind each ``Attention`` layer's cache on ``device``; returns (spec, cache) per layer."""
    layers = []
    for module in model.modules():
        if isinstance(module, Attention):
            spec = module.spec
            shape = backend.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
            module.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
            layers.append((spec, module.kv_cache))
    return layers


@dataclass(frozen=True)
class SwapCaches:
    """Per layer, the device KV cache and its host-side swap twin."""

    backend: AttentionBackend
    device: list[torch.Tensor]
    host: list[torch.Tensor]

    @classmethod
    def allocate(cls, backend: AttentionBackend, layers: list[tuple[AttentionLayerSpec, torch.Tensor]],
                 num_blocks: int, block_size: int, dtype: torch.dtype,
                 host_buffer: Callable[[Sequence[int], torch.dtype], torch.Tensor]) -> "SwapCaches":
        """A host twin of ``num_blocks`` blocks for each layer's cache, from the platform's host
        memory in one allocation: torch's pinned allocator rounds each request up to a power of
        two, so a buffer per layer pinned up to twice the swap space (1.75 GiB for 1 GiB over 28
        layers)."""
        shapes = [backend.kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
                  for spec, _ in layers]
        sizes = [math.prod(shape) for shape in shapes]
        flat = host_buffer((sum(sizes),), dtype)
        starts = itertools.accumulate(sizes, initial=0)
        host = [flat[start:start + size].view(shape) for start, size, shape in zip(starts, sizes, shapes)]
        return cls(backend, [cache for _, cache in layers], host)

    def copy(self, pairs: Sequence[Sequence[int]], to_host: bool) -> None:
        """``pairs`` are (device block, host block); copies in the given direction."""
        if not pairs:
            return
        index = torch.tensor(pairs, dtype=torch.long)
        if not to_host:
            index = index.flip(1)
        for device, host in zip(self.device, self.host):
            src, dst = (device, host) if to_host else (host, device)
            self.backend.swap_blocks(src, dst, index)
