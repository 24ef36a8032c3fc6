"""Qwen2 (q/k/v bias, no o_proj bias) and Qwen3 (q/k RMSNorm, optional bias), dense and MoE."""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from tokenmill.core.layers.linear import Linear
from tokenmill.core.layers.moe import FusedMoE
from tokenmill.core.model_loader.weights import copy_tensor, load_weights
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.models import ModelContext
from tokenmill.plugins.models.bert import num_labels
from tokenmill.plugins.models.llama import LlamaForCausalLM, LlamaMLP


def qwen_sliding_window(cfg: Mapping[str, Any], layer: int) -> Optional[int]:
    # transformers 5 writes layer_types; 4 used use_sliding_window + max_window_layers
    if cfg.get("layer_types") is None:
        if not cfg.get("use_sliding_window") or layer < cfg.get("max_window_layers", 0):
            return None
        return cfg.get("sliding_window")
    return LlamaForCausalLM.sliding_window(cfg, layer)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(cfg: Mapping[str, Any]) -> bool:
        return True

    @staticmethod
    def o_bias(cfg: Mapping[str, Any]) -> bool:
        return False

    sliding_window = staticmethod(qwen_sliding_window)


class Qwen2ForSequenceClassification(Qwen2ForCausalLM):
    """Qwen2 with HF's sequence-classification head (``score``: one row per label) in place of
    the language-model head: a prompt's class logits are the head's output at its last token
    (``LLM.classify``, the pooling routes). It does not generate."""

    is_classifier = True

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        cfg = ctx.hf_config
        self.tie_word_embeddings = False
        self.lm_head = Linear(cfg["hidden_size"], [num_labels(cfg)], bias=False, dtype=ctx.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((name.replace("score.", "lm_head.", 1) if name.startswith("score.") else name, tensor)
                   for name, tensor in weights)
        return super().load_weights(renamed)


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    sliding_window = staticmethod(qwen_sliding_window)


_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")


def load_moe_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], expert_pattern: re.Pattern,
                     parts: Mapping[str, str], stacked, skip, rename: Mapping[str, str] = {}) -> set[str]:
    """Route per-expert tensors (or transformers-5 fused 3D ones) into FusedMoE modules;
    everything else goes through the generic loader, which also reports expert tensors
    no MoE module takes (a dense layer's, an expert beyond ``num_experts``).

    A module's ``w13`` counts as filled once every expert's gate and up have arrived,
    ``w2`` once every expert's down has.
    """
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    arrived: dict[str, set[tuple[int, str]]] = {}  # MoE module -> its (expert, part)s loaded

    def others():
        for name, tensor in weights:
            for old, new in rename.items():
                name = name.replace(old, new)
            match = expert_pattern.match(name)
            if match and _takes_expert(modules.get(match.group(1)), int(match.group(2))):
                moe, expert, part = match.groups()
                copy_tensor(name, modules[moe].expert_weight(int(expert), parts[part]),
                            modules[moe].rank_slice(parts[part], tensor))
                arrived.setdefault(moe, set()).add((int(expert), parts[part]))
                continue
            fused = _FUSED_EXPERTS.match(name)
            if fused and isinstance(modules.get(fused.group(1)), FusedMoE):
                moe, kind = fused.groups()
                param = "w13" if kind == "gate_up_proj" else "w2"
                copy_tensor(name, getattr(modules[moe], param), modules[moe].rank_slice(param, tensor))
                loaded.add(f"{moe}.{param}")
                continue
            yield name, tensor
        # the checkpoint is exhausted: this runs before load_weights reports what it lacks
        for moe, seen in arrived.items():
            experts = range(modules[moe].num_experts)
            if {(e, p) for e in experts for p in ("gate", "up")} <= seen:
                loaded.add(f"{moe}.w13")
            if {(e, "down") for e in experts} <= seen:
                loaded.add(f"{moe}.w2")

    return load_weights(model, others(), stacked, skip, loaded)


def _takes_expert(module: Optional[nn.Module], expert: int) -> bool:
    return isinstance(module, FusedMoE) and expert < module.num_experts


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3 with sparse MoE MLPs (top-k softmax routing, optional renormalisation)."""

    def make_mlp(self, ctx: ModelContext, prefix: str, layer: int) -> nn.Module:
        cfg = ctx.hf_config
        # transformers 5 writes num_local_experts; 4 (and the Qwen releases) num_experts
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        sparse = (num_experts > 0 and layer not in (cfg.get("mlp_only_layers") or [])
                  and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)
        if not sparse:
            return LlamaMLP(ctx, cfg, prefix)
        return FusedMoE(num_experts, cfg["num_experts_per_tok"], cfg["hidden_size"],
                        cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False)),
                        cfg.get("hidden_act", "silu"), ctx.dtype, ctx.parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = self.checkpoint_skips()
        return load_moe_weights(self, weights, _EXPERT, {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
                                self.stacked_params, skip)


@hookimpl
def register_model_architectures(register):
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
    register("Qwen2ForSequenceClassification", Qwen2ForSequenceClassification)
    register("Qwen3ForCausalLM", Qwen3ForCausalLM)
    register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)
