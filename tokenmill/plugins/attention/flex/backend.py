"""The ``flex`` attention backend: torch's FlexAttention over the paged KV cache.

A second implementation beside the project's own kernels, built on a well-kept one that
ships with torch: compiled, FlexAttention generates a fused kernel (Triton on a GPU, C++ on
the CPU) for the mask it is given, so ``tokenmill compare --attention-backend triton,flex``
checks and times the Triton kernels against an independent implementation on the same
engine. The paged layout is expressed as block masks (``paged_block_mask.py``); the cache
layout is the reference's and the Triton backend's (block swaps are the reference's
``copy_blocks``), and the new K/V are written by the
Triton backend's kernel on a GPU (the reference's boolean mask of the slots to write would
wait for the device in every layer) and by the reference's code on the CPU.

On a GPU the kernel's tiles are set to the mask's (``kernel_options``): FlexAttention's
default tiles (64-128 query rows, 64 keys) must divide the mask's tiles, which are one cache
block of keys and ``Q_TILE`` / ``PREFILL_Q_TILE`` queries.

Compilation happens at the first steps (about 10-20 s per shape family on a CPU; shapes
that vary are marked dynamic after the second) and again per distinct layer configuration
(head counts, head size, dtype, sliding window, soft cap). ``compile=False`` runs the same
masks through FlexAttention's unfused reference path, which materialises the scores over
the whole cache: for tests and debugging on small caches only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

import torch
from torch.nn.attention.flex_attention import flex_attention

from tokenmill.interfaces.attention import AttentionCapabilities, AttentionLayerSpec, AttentionMetadata
from tokenmill.plugins.attention.flex.paged_block_mask import (PREFILL_Q_TILE, Q_TILE, LayoutBuffers, StepLayout,
                                                              decode_mask, prefill_mask)
from tokenmill.plugins.attention.torch_ref import copy_blocks, write_kv

_COMMON_FIELDS = tuple(f.name for f in fields(AttentionMetadata))


@dataclass(frozen=True, slots=True)
class FlexMetadata(AttentionMetadata):
    """The common metadata, the step's layout, and its block masks (one per sliding window
    and cache size, made by the first layer that needs it)."""

    layout: StepLayout = None
    masks: dict = field(default_factory=dict)


class FlexAttentionBackend:
    name = "flex"
    capabilities = AttentionCapabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        # the mask's key tiles are cache blocks: FlexAttention's GPU kernels take tiles of 16 and up
        block_sizes=(16, 32, 64, 128),
        sliding_window=True,
        logits_soft_cap=True,
    )

    def __init__(self, compile: bool = True) -> None:
        self._attend: Callable[..., torch.Tensor] = _compiled() if compile else _unfused
        self._buffers = LayoutBuffers()

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        copy_blocks(src, dst, pairs)

    def build_metadata(self, common: AttentionMetadata) -> FlexMetadata:
        layout = StepLayout(common.query_start_loc_cpu, common.seq_lens_cpu, common.block_table, common.block_size,
                            self._buffers)
        return FlexMetadata(*(getattr(common, name) for name in _COMMON_FIELDS), layout=layout)

    def forward(self, layer: AttentionLayerSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        if not isinstance(metadata, FlexMetadata):  # a caller that skipped build_metadata
            metadata = self.build_metadata(metadata)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        on_gpu = query.device.type == "cuda"
        if on_gpu:
            from tokenmill.plugins.attention.triton_paged import kernels

            kernels.write_kv(kv_cache, key, value, metadata.slot_mapping)
        else:
            write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
        num_blocks, layout = key_cache.shape[0], metadata.layout
        pad = not on_gpu
        # [batch, heads, tokens, head_dim] views of every slot of the cache
        slots = num_blocks * metadata.block_size
        keys = key_cache.view(slots, layer.num_kv_heads, layer.head_dim).transpose(0, 1)[None]
        values = value_cache.view(slots, layer.num_kv_heads, layer.head_dim).transpose(0, 1)[None]
        options = dict(score_mod=_soft_cap(layer.logits_soft_cap), scale=layer.scale,
                       enable_gqa=layer.num_heads != layer.num_kv_heads)
        out = None
        if layout.decode is not None:
            group, rows = layout.decode, layout.decode.count
            mask = self._mask(metadata, decode_mask, num_blocks, layer.sliding_window, pad)
            q = (query if group.whole_step else query[group.index]).unsqueeze(2)
            decoded = self._attend(q, keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1),
                                   block_mask=mask, **options, **_tiles(on_gpu, Q_TILE, metadata.block_size))[:, :, 0]
            if group.whole_step:
                return decoded
            out = torch.empty_like(query)
            out[group.index] = decoded
        group = layout.prefill
        mask = self._mask(metadata, prefill_mask, num_blocks, layer.sliding_window, pad)
        q = (query if group.whole_step else query[group.index]).transpose(0, 1)[None]
        attended = self._attend(q, keys, values, block_mask=mask, **options,
                                **_tiles(on_gpu, PREFILL_Q_TILE, metadata.block_size))[0].transpose(0, 1)
        if group.whole_step:
            return attended
        out[group.index] = attended
        return out

    @staticmethod
    def _mask(metadata: "FlexMetadata", build, num_blocks: int, window: Optional[int], pad: bool):
        """The step's mask ``build`` makes for a cache of ``num_blocks`` and this window, made by
        the first layer that needs it and shared by the others."""
        key = (build, num_blocks, window)
        mask = metadata.masks.get(key)
        if mask is None:
            mask = metadata.masks[key] = build(metadata.layout, num_blocks, window, pad)
        return mask


def _tiles(on_gpu: bool, q_tile: int, block_size: int) -> dict:
    """The GPU kernel's tiles, dividing the mask's: ``q_tile`` queries, keys a cache block (at most 64)."""
    if not on_gpu:
        return {}
    return {"kernel_options": {"BLOCK_M": q_tile, "BLOCK_N": min(block_size, 64)}}


def _soft_cap(cap: Optional[float]):
    if cap is None:
        return None

    def score_mod(score, b, h, q, kv):
        return cap * torch.tanh(score / cap)

    return score_mod


_COMPILED: Optional[Callable[..., torch.Tensor]] = None


#: compilations of FlexAttention a process keeps: one per layer configuration (head counts and size,
#: dtype, window, soft cap) and kind of mask (decode rows, flat tokens), and per growth of the layout
#: buffers. Dynamo counts them all against flex_attention's one code object, 8 by default.
RECOMPILE_LIMIT = 64


def _compiled() -> Callable[..., torch.Tensor]:
    """One compiled FlexAttention per process: its cache of generated kernels is shared by
    every engine and layer. Raises dynamo's process-wide recompile limit to RECOMPILE_LIMIT
    (as vLLM's flex backend raises it to 16): past it, a fullgraph compile raises."""
    global _COMPILED
    if _COMPILED is None:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        _COMPILED = torch.compile(flex_attention, fullgraph=True)
    return _COMPILED


def _unfused(*args, **kwargs) -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that this path is not the fused kernel: chosen here
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(*args, **kwargs)
