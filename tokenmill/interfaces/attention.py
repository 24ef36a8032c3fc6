"""The AttentionBackend contract and the metadata every backend understands.

Paged KV cache: each layer owns one cache tensor whose shape the backend
declares. Tokens live in fixed-size blocks; a request's ``block_table`` row
lists its physical blocks in order, and a token's slot is
``block_id * block_size + offset``. Slot -1 means "do not write".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Protocol, runtime_checkable

import torch


@dataclass(frozen=True, slots=True)
class AttentionCapabilities:
    """What a backend supports; the engine validates a model against it at startup."""

    dtypes: tuple[torch.dtype, ...]
    #: None means any head size
    head_sizes: Optional[tuple[int, ...]] = None
    #: None means any block size
    block_sizes: Optional[tuple[int, ...]] = None
    sliding_window: bool = False
    logits_soft_cap: bool = False
    #: a device type ("cpu", "cuda") the backend needs; None runs anywhere
    requires_device: Optional[str] = None
    #: the cache is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, new K/V
    #: go to ``slot_mapping``, and decode rows are computed by the cpu platform's
    #: ``paged_decode_attention`` kernel: its fused decode stack may then do both itself
    fused_decode: bool = False
    #: cache dtypes besides the compute dtype it can keep K/V in (``cache.kv_cache_dtype``):
    #: new K/V rounded to it on write, widened again on read
    kv_cache_dtypes: tuple[torch.dtype, ...] = ()
    #: decode steps can be recorded once and replayed (CUDA graphs): the backend has
    #: ``graph_metadata``, and a decode step's forward reads only that metadata's tensors
    cuda_graph: bool = False


@dataclass(frozen=True, slots=True)
class AttentionLayerSpec:
    """The per-layer constants of an attention layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    #: attend only to the last ``sliding_window`` positions (incl. itself); None = all
    sliding_window: Optional[int] = None
    logits_soft_cap: Optional[float] = None


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Per-step batch layout, shared by all layers (vLLM's common metadata).

    The batch is flat: requests' new tokens are concatenated. Request ``i``'s
    query tokens are ``query_start_loc[i]:query_start_loc[i+1]``; its context
    (cached + new tokens) has ``seq_lens[i]`` tokens, so its first query token
    sits at position ``seq_lens[i] - query_len``. Causality is against that
    position, which covers prefill chunks on top of a cached prefix and decodes.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int
    max_seq_len: int
    #: the same as python lists, so CPU backends need no tensor->list sync
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


@runtime_checkable
class AttentionBackend(Protocol):
    """Writes new K/V into the paged cache and attends over it.

    Optional: ``build_metadata(common: AttentionMetadata) -> AttentionMetadata``. Where a
    backend defines it, the model runner calls it once per step and every layer gets its
    result (a subclass carrying what the layers share: vLLM's metadata builder), so no
    backend keeps per-step state of its own.

    Optional, with the ``cuda_graph`` capability: ``graph_metadata(common, positions,
    max_seq_len) -> AttentionMetadata``, the metadata of a recorded decode step. Every row
    has one query token at ``positions``; ``common``'s tensors are the graph's fixed input
    buffers, refilled before each replay, and its host copies hold no step's values, so
    nothing in the result may depend on them: a replay runs whatever the recording
    launched, with the same grid (``max_seq_len`` bounds every row's context).
    """

    name: ClassVar[str]
    capabilities: ClassVar[AttentionCapabilities]

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache tensor (keys and values together)."""

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        """Copy blocks between two caches of this backend's layout (device <-> host swap).

        ``pairs`` is ``[n, 2]`` int64: (source block, destination block).
        """

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write ``key``/``value`` at ``metadata.slot_mapping``, then attend causally."""
