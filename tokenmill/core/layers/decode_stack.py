"""A model's decoder layers as one C++ call for decode steps of 1-2 rows.

Batch-1 decode is bound by reading the weights; what the eager layers add to
that read is ~14 Python-level ops per layer, each slowed by the caches the
weight stream just flushed. Where every part of every layer already runs on
the C++ kernels (fused ops and the GEMV path on, an attention backend with
``fused_decode``), ``kernels.DecodeStack`` runs the same kernels in the same
order, so the result is bit-identical to the eager layers'. Anything else
(quantized or LoRA layers, other norms or activations, prompt chunks, 3+
rows) keeps the layer-by-layer path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from tokenmill.core.kernels import FUSED_DTYPES, MIXED_CACHE_DTYPES
from tokenmill.core.layers.activation import GatedActivation
from tokenmill.core.layers.attention import Attention
from tokenmill.core.layers.linear import Linear, PrepackedLinearMethod
from tokenmill.core.layers.norm import RMSNorm
from tokenmill.core.layers.rotary import RotaryEmbedding
from tokenmill.interfaces.attention import AttentionMetadata


@dataclass(frozen=True)
class DecodeLayerParts:
    """One pre-norm decoder layer: ``x += o(attn(rotary(qkv(norm(x)))))``, then
    ``x += down(act(gate_up(post_norm(x))))``; q, k, v fused along qkv's outputs."""

    input_norm: nn.Module
    qkv: Linear
    rotary: RotaryEmbedding
    attn: Attention
    o: Linear
    post_norm: nn.Module
    gate_up: Linear
    act: nn.Module
    down: Linear


class DecodeStack:
    #: the rows the GEMV kernel takes (more go to oneDNN, which the stack does not call)
    MAX_ROWS = PrepackedLinearMethod.GEMV_MAX_ROWS

    def __init__(self, layers: Sequence[DecodeLayerParts]) -> None:
        first = layers[0]
        spec = first.attn.spec
        self._stack = first.input_norm.kernels.DecodeStack(spec.num_heads, spec.num_kv_heads, spec.head_dim)
        for parts in layers:
            key_cache, value_cache = parts.attn.kv_cache[0], parts.attn.kv_cache[1]
            self._stack.add_layer(
                parts.input_norm.weight, parts.input_norm.eps, parts.qkv.weight, parts.qkv.bias,
                parts.o.weight, parts.o.bias, parts.post_norm.weight, parts.post_norm.eps,
                parts.gate_up.weight, parts.gate_up.bias, parts.down.weight, parts.down.bias,
                key_cache, value_cache, parts.attn.spec.scale, parts.attn.spec.sliding_window or 0)
        self._rotary = first.rotary
        #: the cache the stack writes to (a rebound cache makes the stack stale)
        self._attn, self._kv_cache = first.attn, first.attn.kv_cache

    @classmethod
    def build(cls, layers: Sequence[DecodeLayerParts]) -> Optional["DecodeStack"]:
        """The stack, or None where any part would not run on the C++ kernels."""
        if not layers or not all(_fusable(parts, layers[0]) for parts in layers):
            return None
        return cls(layers)

    def accepts(self, x: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Decode rows only, as few as the GEMV kernel takes, into the caches bound at build."""
        return (x.shape[0] <= self.MAX_ROWS and metadata.max_query_len == 1
                and self._attn.kv_cache is self._kv_cache)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """The residual stream after the last layer (the final norm is the model's)."""
        cos, sin = self._rotary.cos_sin(positions, x.dtype)
        return self._stack.forward(x, cos, sin, metadata.slot_mapping, metadata.block_table, metadata.seq_lens)


def _fusable(parts: DecodeLayerParts, first: DecodeLayerParts) -> bool:
    kernels = first.input_norm.kernels if type(first.input_norm) is RMSNorm else None
    if kernels is None or not hasattr(kernels, "DecodeStack"):
        return False
    dtype = parts.qkv.dtype
    linears = (parts.qkv, parts.o, parts.gate_up, parts.down)
    spec, first_spec = parts.attn.spec, first.attn.spec
    cache = parts.attn.kv_cache
    return (
        dtype in FUSED_DTYPES
        and all(type(norm) is RMSNorm and norm.kernels is not None and norm.weight.dtype == dtype
                for norm in (parts.input_norm, parts.post_norm))
        and all(isinstance(linear.method, PrepackedLinearMethod) and linear.method.gemv is not None
                and linear.output_delta is None and linear.dtype == dtype for linear in linears)
        and isinstance(parts.act, GatedActivation) and parts.act.name == "silu" and parts.act.kernels is not None
        and type(parts.rotary) is RotaryEmbedding and parts.rotary.kernels is not None
        and parts.rotary.shares_cos_sin(first.rotary)
        and parts.attn.backend.capabilities.fused_decode and spec.logits_soft_cap is None
        and (spec.num_heads, spec.num_kv_heads, spec.head_dim)
        == (first_spec.num_heads, first_spec.num_kv_heads, first_spec.head_dim)
        and cache is not None and (cache.dtype == dtype or (dtype, cache.dtype) in MIXED_CACHE_DTYPES)
    )
