"""Qwen2: the Llama block with q/k/v bias (no o_proj bias), often tied embeddings."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.plugins.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(cfg: Mapping[str, Any]) -> bool:
        return True

    @staticmethod
    def o_bias(cfg: Mapping[str, Any]) -> bool:
        return False

    @staticmethod
    def sliding_window(cfg: Mapping[str, Any], layer: int) -> Optional[int]:
        # transformers 5 writes layer_types; 4 used use_sliding_window + max_window_layers
        if cfg.get("layer_types") is None:
            if not cfg.get("use_sliding_window") or layer < cfg.get("max_window_layers", 0):
                return None
            return cfg.get("sliding_window")
        return LlamaForCausalLM.sliding_window(cfg, layer)


@hookimpl
def register_model_architectures(register):
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
