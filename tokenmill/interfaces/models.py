"""The model-architecture contract.

A model plugin registers a class under Hugging Face ``architectures`` names.
The engine constructs it as ``cls(context)`` and then streams the checkpoint's
tensors into ``load_weights``.

A model builds from the public layers in ``tokenmill.core.layers`` (documented there). One is
required: every attention layer must be a ``tokenmill.core.layers.Attention`` built with
``context.attention``, because the engine allocates and binds the paged KV caches to the
``Attention`` modules it finds. ``tokenmill.testing.model_conformance.check_model`` tests a
model plugin against Hugging Face transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Protocol, runtime_checkable

import torch

from tokenmill.interfaces.attention import AttentionBackend, AttentionMetadata
from tokenmill.interfaces.parallel import SINGLE, ParallelContext
from tokenmill.interfaces.quantization import QuantizationMethod


@dataclass(frozen=True)
class ModelContext:
    """What a model needs to build itself.

    ``hf_config`` is config.json normalised to transformers-5 spellings:
    ``rope_parameters`` (with ``rope_theta`` inside) and ``dtype``.
    """

    hf_config: Mapping[str, Any]
    dtype: torch.dtype
    attention: AttentionBackend
    quantization: Optional[QuantizationMethod] = None
    #: this rank's tensor-parallel shard and pipeline stage (tokenmill.interfaces.parallel);
    #: a model that builds from tokenmill.core.layers passes it on to them
    parallel: ParallelContext = SINGLE


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model over a flat batch of tokens."""

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32 logits."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume checkpoint tensors by their checkpoint names; return the parameter names filled."""


@runtime_checkable
class OutputProjection(Protocol):
    """Optional for a CausalLM: lets greedy rows skip computing all logits (the cpu platform's greedy_head.py)."""

    def output_projection(self) -> Optional[torch.Tensor]:
        """The [vocab, hidden] weight W with compute_logits(h) == h @ W.T exactly (no bias,
        scale or cap), or None where the logits are not that."""


@runtime_checkable
class EmbeddingModel(Protocol):
    """An encoder (BERT-style): bidirectional attention over padded batches, no KV cache.

    A model class marks itself with ``is_embedding_model = True``; the engine
    then builds an embedding engine around it instead of a generation engine.
    """

    is_embedding_model: bool

    def encode(
        self,
        input_ids: torch.Tensor,  # [batch, seq] int64, right-padded
        attention_mask: torch.Tensor,  # [batch, seq] 1 = token, 0 = padding
    ) -> torch.Tensor:  # [batch, seq, hidden]
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...
