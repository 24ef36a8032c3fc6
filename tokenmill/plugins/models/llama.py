"""Llama and the families that share its decoder block.

Covers ``LlamaForCausalLM`` (Llama 1-3.x, incl. Llama-3.1 ``llama3`` rope
scaling; Yi and DeepSeek dense checkpoints use this name too) and
``MistralForCausalLM`` (sliding-window attention). Other families reuse the
block by overriding the class-level switches (see qwen2.py).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from tokenmill.core.layers.activation import gated_activation
from tokenmill.core.layers.attention import Attention
from tokenmill.core.layers.linear import Linear
from tokenmill.core.layers.norm import RMSNorm
from tokenmill.core.layers.rotary import RotaryEmbedding
from tokenmill.core.layers.weights import load_weights
from tokenmill.interfaces.attention import AttentionLayerSpec, AttentionMetadata
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.models import ModelContext


class LlamaAttention(nn.Module):
    def __init__(self, ctx: ModelContext, cfg: Mapping[str, Any], prefix: str,
                 qkv_bias: bool, o_bias: bool, sliding_window: Optional[int]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads") or self.num_heads
        self.head_dim = cfg.get("head_dim") or hidden // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(hidden, self.split, bias=qkv_bias, dtype=ctx.dtype,
                               quantization=ctx.quantization, prefix=f"{prefix}.qkv_proj")
        self.o_proj = Linear(q_size, [hidden], bias=o_bias, dtype=ctx.dtype,
                             quantization=ctx.quantization, prefix=f"{prefix}.o_proj")
        self.rotary_emb = RotaryEmbedding(self.head_dim, cfg["rope_parameters"])
        spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scale=self.head_dim**-0.5,
            sliding_window=sliding_window,
        )
        self.attn = Attention(spec, ctx.attention)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, metadata)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, ctx: ModelContext, cfg: Mapping[str, Any], prefix: str) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        bias = bool(cfg.get("mlp_bias", False))
        self.gate_up_proj = Linear(hidden, [inter, inter], bias=bias, dtype=ctx.dtype,
                                   quantization=ctx.quantization, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = Linear(inter, [hidden], bias=bias, dtype=ctx.dtype,
                                quantization=ctx.quantization, prefix=f"{prefix}.down_proj")
        self.act = gated_activation(cfg.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, ctx: ModelContext, cfg: Mapping[str, Any], prefix: str,
                 qkv_bias: bool, o_bias: bool, sliding_window: Optional[int]) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = LlamaAttention(ctx, cfg, f"{prefix}.self_attn", qkv_bias, o_bias, sliding_window)
        self.mlp = LlamaMLP(ctx, cfg, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, ctx.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, ctx: ModelContext, layers: list[LlamaDecoderLayer]) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], dtype=ctx.dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, metadata)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The Llama decoder; subclasses change the switches below, not the code."""

    stacked_params = (
        ("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        layers = [
            LlamaDecoderLayer(ctx, cfg, f"model.layers.{i}", self.qkv_bias(cfg), self.o_bias(cfg),
                              self.sliding_window(cfg, i))
            for i in range(cfg["num_hidden_layers"])
        ]
        self.model = LlamaModel(ctx, layers)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(cfg["hidden_size"], [cfg["vocab_size"]], bias=False, dtype=ctx.dtype)

    @staticmethod
    def qkv_bias(cfg: Mapping[str, Any]) -> bool:
        return bool(cfg.get("attention_bias", False))

    @staticmethod
    def o_bias(cfg: Mapping[str, Any]) -> bool:
        return bool(cfg.get("attention_bias", False))

    @staticmethod
    def sliding_window(cfg: Mapping[str, Any], layer: int) -> Optional[int]:
        """The window of layer ``layer``: per ``layer_types`` when given, else global."""
        window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if window is None or (layer_types and layer_types[layer] != "sliding_attention"):
            return None
        return int(window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tie_word_embeddings:
            return nn.functional.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ["rotary_emb.inv_freq"] + (["lm_head."] if self.tie_word_embeddings else [])
        return load_weights(self, weights, self.stacked_params, skip)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama block with sliding-window attention on every layer."""


@hookimpl
def register_model_architectures(register):
    register("LlamaForCausalLM", LlamaForCausalLM)
    register("MistralForCausalLM", MistralForCausalLM)
