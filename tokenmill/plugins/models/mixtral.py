"""Mixtral: the Mistral block with a sparse mixture-of-experts MLP (top-k, renormalised)."""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from tokenmill.core.layers.moe import FusedMoE
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.models import ModelContext
from tokenmill.plugins.models.llama import LlamaForCausalLM
from tokenmill.plugins.models.qwen2 import load_moe_weights

_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


class MixtralForCausalLM(LlamaForCausalLM):
    def make_mlp(self, ctx: ModelContext, prefix: str, layer: int) -> nn.Module:
        cfg = ctx.hf_config
        return FusedMoE(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["hidden_size"],
                        cfg["intermediate_size"], True, cfg.get("hidden_act", "silu"), ctx.dtype, ctx.parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = self.checkpoint_skips()
        # checkpoints name the MoE block "block_sparse_moe" (transformers 4) or "mlp" (5)
        return load_moe_weights(self, weights, _EXPERT, {"w1": "gate", "w3": "up", "w2": "down"},
                                self.stacked_params, skip, rename={".block_sparse_moe.": ".mlp."})


@hookimpl
def register_model_architectures(register):
    register("MixtralForCausalLM", MixtralForCausalLM)
