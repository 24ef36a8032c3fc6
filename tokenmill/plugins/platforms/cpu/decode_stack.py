"""A model's decoder layers as one C++ call for steps of a few rows (a FusedDecoder): decode
steps of 1-2 rows (up to 5 on AVX2 cores, whose GEMV reads the packed panels) and speculative
verify steps of up to 8.

Batch-1 decode is bound by reading the weights; what the eager layers add to
that read is ~14 Python-level ops per layer, each slowed by the caches the
weight stream just flushed. Where every part of every layer already runs on
the C++ kernels (fused ops and the GEMV path on, an attention backend with
``fused_decode``), ``kernels.DecodeStack`` runs the same kernels in the same
order, so a decode step's result is bit-identical to the eager layers'. Anything else
(quantized or LoRA layers, other norms or activations, longer steps) keeps the
layer-by-layer path.

A verify step (k + 1 query rows per request) is what makes speculation pay at batch 1:
layer by layer its rows go to oneDNN and the prefill attention, and the step cost ~4x a
decode step on the demo model, more than prompt lookup's acceptance wins back. Here
the GEMV reads each weight once for all rows, and the prompt-chunk attention kernel reads
each request's keys and values once for all its rows, each row causal to its own position
(where that kernel takes the layer: head sizes a multiple of 32; elsewhere every row attends
as a sequence of its own, its request's blocks up to its own length, reading them once per
row): 1.4x a decode step on the demo model (benchmarks/README.md).
That holds while the stack's weights fit in the last-level cache, where a step's cost is
its calls and its arithmetic. Weights streamed from memory are read better by oneDNN's
blocked GEMM, which reads each weight once for all rows at the memory's pace where the
GEMV's rows cost ~1.8x (52M fp32 Llama on a Zen 4: a 5-row verify step 1.84x a decode
step layer by layer, 2.3x here), so larger models verify layer by layer. On AVX2 cores the
GEMV reading the panels in place is the faster of the two up to 5 rows, from memory too
(52M fp32 and 350M bf16 on a Zen 3), so there the stack takes verify steps of that many rows
whatever the model's size.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional, Sequence

import numpy as np
import torch

from tokenmill.core.layers.fused_decoder import DecoderLayerParts
from tokenmill.core.layers.norm import RMSNorm
from tokenmill.interfaces.attention import AttentionMetadata
from tokenmill.plugins.platforms.cpu.cache_size import last_level_cache_bytes
from tokenmill.plugins.platforms.cpu.fused_ops import FUSED_OPS
from tokenmill.plugins.platforms.cpu.kernels import FUSED_DTYPES, MIXED_CACHE_DTYPES
from tokenmill.plugins.platforms.cpu.prepacked_linear import PrepackedLinearMethod


class DecodeStack:
    """Built at the first step it is asked about: adapters attach, and KV caches are bound,
    after the optimisation pass; ``stack`` is None where some part is not on the kernels."""

    #: rows of a step with several query tokens per request (a verify step, a short prompt)
    MAX_VERIFY_ROWS = 8

    def __init__(self, layers: Sequence[DecoderLayerParts], kernels: ModuleType) -> None:
        self._layers = list(layers)
        self._kernels = kernels
        self._built = False
        #: the C++ stack, or None where the layers must run one by one
        self.stack = None
        #: the cache the stack writes to (a rebound cache makes the stack stale)
        self._kv_cache: Optional[torch.Tensor] = None
        #: decode rows (one query token per request) the stack takes: as many as the eager layers'
        #: linears give the GEMV kernel (more rows go to the packed GEMMs there, measured faster)
        self.decode_rows = 0
        #: rows of a multi-token step the stack takes: MAX_VERIFY_ROWS while its weights fit in
        #: the last-level cache; else the decode rows where the GEMV reads AVX2 panels in place
        #: (faster than the packed GEMM there, from memory too), none elsewhere
        self.verify_rows = 0
        #: whether a multi-token step's rows attend per request in the prompt-chunk kernel
        self.verify_by_request = False

    def _build(self) -> None:
        self._built = True
        first = self._layers[0]
        if not all(_fusable(parts, first) for parts in self._layers):
            return
        spec = first.attn.spec
        stack = self._kernels.DecodeStack(spec.num_heads, spec.num_kv_heads, spec.head_dim)
        for parts in self._layers:
            key_cache, value_cache = parts.attn.kv_cache[0], parts.attn.kv_cache[1]
            qkv, o, gate_up, down = (linear.method.gemv_weight(linear)
                                     for linear in (parts.qkv, parts.o, parts.gate_up, parts.down))
            stack.add_layer(
                parts.input_norm.weight, parts.input_norm.eps, qkv, parts.qkv.bias, o, parts.o.bias,
                parts.post_norm.weight, parts.post_norm.eps, gate_up, parts.gate_up.bias, down, parts.down.bias,
                key_cache, value_cache, parts.attn.spec.scale, parts.attn.spec.sliding_window or 0)
        self.stack, self._kv_cache = stack, first.attn.kv_cache
        self.verify_by_request = first.attn.backend.prefill_kernel_takes(spec, first.qkv.dtype)
        weight_bytes = sum(linear.method.gemv_weight(linear).nbytes for parts in self._layers
                           for linear in (parts.qkv, parts.o, parts.gate_up, parts.down))
        cache = last_level_cache_bytes()
        self.decode_rows = min(linear.method.gemv_max_rows for parts in self._layers
                               for linear in (parts.qkv, parts.o, parts.gate_up, parts.down))
        if cache is not None and weight_bytes <= cache:
            self.verify_rows = self.MAX_VERIFY_ROWS
        elif self.decode_rows > PrepackedLinearMethod.GEMV_MAX_ROWS:
            self.verify_rows = self.decode_rows

    def accepts(self, x: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """A few rows, into the caches bound at build."""
        if not self._built:
            self._build()
        limit = self.decode_rows if metadata.max_query_len == 1 else self.verify_rows
        return (self.stack is not None and x.shape[0] <= limit
                and self._layers[0].attn.kv_cache is self._kv_cache)

    def __call__(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                 metadata: AttentionMetadata) -> torch.Tensor:
        cos, sin = cos_sin
        block_table, seq_lens, query_start = metadata.block_table, metadata.seq_lens, None
        if metadata.max_query_len > 1 and self.verify_by_request:
            query_start = metadata.query_start_loc
        elif metadata.max_query_len > 1:
            block_table, seq_lens = rows_as_sequences(metadata)
        return self.stack.forward(x, cos, sin, metadata.slot_mapping, block_table, seq_lens, query_start)


def rows_as_sequences(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row as a sequence of its own: its request's block table row, and the context
    up to and including its token (a request with ``q`` query rows and ``L`` tokens of context:
    ``L - q + 1`` .. ``L``)."""
    starts = np.asarray(metadata.query_start_loc_cpu)
    owners = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    # a row's context ends at its own token: its request's length less the rows after it
    lengths = np.asarray(metadata.seq_lens_cpu)[owners] - (starts[1:][owners] - 1 - np.arange(starts[-1]))
    return metadata.block_table[torch.from_numpy(owners)], torch.from_numpy(lengths.astype(np.int32))


def _fusable(parts: DecoderLayerParts, first: DecoderLayerParts) -> bool:
    dtype = parts.qkv.dtype
    linears = (parts.qkv, parts.o, parts.gate_up, parts.down)
    spec, first_spec = parts.attn.spec, first.attn.spec
    cache = parts.attn.kv_cache
    return (
        dtype in FUSED_DTYPES
        and all(type(norm) is RMSNorm and norm.op_impl is FUSED_OPS["rms_norm"] and norm.weight.dtype == dtype
                for norm in (parts.input_norm, parts.post_norm))
        and all(isinstance(linear.method, PrepackedLinearMethod) and linear.method.gemv is not None
                and linear.output_delta is None and linear.dtype == dtype for linear in linears)
        and parts.act.op_impl is FUSED_OPS["silu_and_mul"]
        and parts.rotary.op_impl is FUSED_OPS["rotary_embedding"]
        and parts.attn.backend.capabilities.fused_decode and spec.logits_soft_cap is None
        and (spec.num_heads, spec.num_kv_heads, spec.head_dim)
        == (first_spec.num_heads, first_spec.num_kv_heads, first_spec.head_dim)
        and cache is not None and (cache.dtype == dtype or (dtype, cache.dtype) in MIXED_CACHE_DTYPES)
    )
