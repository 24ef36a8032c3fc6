"""Gemma and Gemma-2: (1 + w) RMSNorm, scaled embeddings, GeGLU, tied embeddings by default.

Gemma-2 adds norms around the attention and MLP outputs, a query scale of
``query_pre_attn_scalar ** -0.5``, attention and final-logit soft-capping, and
alternating sliding-window layers (``layer_types``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from tokenmill.core.layers.norm import GemmaRMSNorm
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.plugins.models.llama import LlamaForCausalLM


class GemmaForCausalLM(LlamaForCausalLM):
    norm_class = GemmaRMSNorm
    tie_word_embeddings_default = True

    @staticmethod
    def embed_scale(cfg: Mapping[str, Any]) -> Optional[float]:
        return math.sqrt(cfg["hidden_size"])


class Gemma2ForCausalLM(GemmaForCausalLM):
    sandwich_norms = True

    @staticmethod
    def attention_scale(cfg: Mapping[str, Any], head_dim: int) -> float:
        return cfg.get("query_pre_attn_scalar", head_dim) ** -0.5


@hookimpl
def register_model_architectures(register):
    register("GemmaForCausalLM", GemmaForCausalLM)
    register("Gemma2ForCausalLM", Gemma2ForCausalLM)
