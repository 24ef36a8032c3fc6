"""The model-facing API is enough for a model written outside tokenmill.

``ThirdPartyLlama`` is a Llama decoder built the way an out-of-tree plugin would build it:
from ``tokenmill.core.layers`` (the public layers) and ``tokenmill.interfaces`` only. The
conformance kit serves it through the engine and holds it to HF parity, with the platform's
fast paths (its CustomOps get the cpu platform's kernels, its FusableDecoder stack the fused
decoder) and as plain PyTorch.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Optional

import torch
from torch import nn

from tokenmill.core.layers import (
    ApplyRotary,
    Attention,
    DecoderLayerParts,
    FusableDecoder,
    GatedActivation,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    load_weights,
    rotary_dim,
)
from tokenmill.interfaces.attention import AttentionLayerSpec, AttentionMetadata
from tokenmill.interfaces.models import ModelContext
from tokenmill.testing.model_conformance import check_model


class Block(nn.Module):
    def __init__(self, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        cfg, dtype = ctx.hf_config, ctx.dtype
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        kv_heads, head_dim = cfg["num_key_value_heads"], cfg["hidden_size"] // heads
        self.shape = (heads, kv_heads, head_dim)
        self.split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.input_layernorm = RMSNorm(hidden, cfg["rms_norm_eps"], dtype)
        self.post_attention_layernorm = RMSNorm(hidden, cfg["rms_norm_eps"], dtype)
        self.qkv_proj = Linear(hidden, self.split, bias=False, dtype=dtype, prefix=f"{prefix}.qkv_proj")
        self.o_proj = Linear(heads * head_dim, [hidden], bias=False, dtype=dtype, prefix=f"{prefix}.o_proj")
        self.rotary = ApplyRotary(rotary_dim(head_dim, cfg["rope_parameters"]))
        self.attn = Attention(AttentionLayerSpec(heads, kv_heads, head_dim, head_dim**-0.5), ctx.attention)
        inter = cfg["intermediate_size"]
        self.gate_up_proj = Linear(hidden, [inter, inter], bias=False, dtype=dtype, prefix=f"{prefix}.gate_up_proj")
        self.act = GatedActivation(cfg["hidden_act"])
        self.down_proj = Linear(inter, [hidden], bias=False, dtype=dtype, prefix=f"{prefix}.down_proj")

    def forward(self, cos_sin, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        heads, kv_heads, head_dim = self.shape
        q, k, v = self.qkv_proj(self.input_layernorm(x)).split(self.split, dim=-1)
        q, k = self.rotary(q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), *cos_sin)
        x = x + self.o_proj(self.attn(q, k, v.view(-1, kv_heads, head_dim), metadata).flatten(1))
        return x + self.down_proj(self.act(self.gate_up_proj(self.post_attention_layernorm(x))))


class Decoder(nn.Module, FusableDecoder):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], dtype=ctx.dtype)
        self.layers = nn.ModuleList(Block(ctx, f"model.layers.{i}") for i in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], ctx.dtype)
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        self.rotary_emb = RotaryEmbedding(head_dim, cfg["rope_parameters"], cfg["max_position_embeddings"])

    def decoder_layer_parts(self) -> Optional[list[DecoderLayerParts]]:
        return [DecoderLayerParts(b.input_layernorm, b.qkv_proj, b.rotary, b.attn, b.o_proj,
                                  b.post_attention_layernorm, b.gate_up_proj, b.act, b.down_proj)
                for b in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb(positions, x.dtype)
        if self.fused_decoder is not None and self.fused_decoder.accepts(x, metadata):
            return self.norm(self.fused_decoder(x, cos_sin, metadata))
        for layer in self.layers:
            x = layer(cos_sin, x, metadata)
        return self.norm(x)


class ThirdPartyLlama(nn.Module):
    STACKED = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        self.model = Decoder(ctx)
        self.lm_head = Linear(ctx.hf_config["hidden_size"], [ctx.hf_config["vocab_size"]], bias=False,
                              dtype=ctx.dtype)

    def forward(self, input_ids, positions, metadata):
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # HF's block keeps q/k/v under self_attn and gate/up/down under mlp; ours is flat
        renamed = ((name.replace("self_attn.", "").replace("mlp.", ""), tensor) for name, tensor in weights)
        return load_weights(self, renamed, self.STACKED)


def test_a_model_built_from_the_public_layers_matches_hf(model_dir, tmp_path):
    check_model(ThirdPartyLlama, model_dir("llama"), tmp_path)


def test_the_third_party_model_gets_the_platforms_fast_paths(model_dir, tmp_path):
    """Its CustomOps and its FusableDecoder stack reach the cpu platform's kernels, though the
    model never names them."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
    from tokenmill.interfaces.hookspecs import hookimpl

    check_model(ThirdPartyLlama, model_dir("llama"), tmp_path, prompts=[[3, 4]], max_tokens=2)

    class Plugin:
        @hookimpl
        def register_model_architectures(self, register):
            register("ConformanceThirdPartyLlama", ThirdPartyLlama)

    pm = make_plugin_manager()
    pm.register_plugin(Plugin(), "third-party")
    llm = LLM(str(tmp_path / "ConformanceThirdPartyLlama"), plugin_manager=pm, kv_cache_memory_bytes=2**24)
    model = llm.llm_engine.runner.model
    assert all(m.op_impl is not None for m in model.modules() if isinstance(m, (RMSNorm, GatedActivation, ApplyRotary)))
    llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert model.model.fused_decoder.stack is not None  # built at the first decode step


def test_this_model_imports_only_the_public_surface():
    """What an out-of-tree model may import: the public layers and the interfaces."""
    tree = ast.parse(Path(__file__).read_text())
    top_level = {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert {m for m in top_level if m.startswith("tokenmill")} == {
        "tokenmill.core.layers", "tokenmill.interfaces.attention", "tokenmill.interfaces.models",
        "tokenmill.testing.model_conformance"}
