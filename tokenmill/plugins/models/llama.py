"""The Llama decoder block and the families that are Llama with switches.

Covers ``LlamaForCausalLM`` (Llama 1-3.x incl. ``llama3`` rope scaling; Yi
and DeepSeek dense checkpoints use this name too, with ``attention_bias``,
``head_dim`` and ``linear``/``dynamic``/``yarn`` rope scaling) and
``MistralForCausalLM`` (sliding-window attention). Other families (Qwen2/3,
Gemma, Phi-3, Mixtral) subclass ``LlamaForCausalLM`` and override the
class-level switches below instead of copying the block.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from tokenmill.core.layers.activation import GatedActivation
from tokenmill.core.layers.attention import Attention
from tokenmill.core.layers.fused_decoder import DecoderLayerParts, FusableDecoder
from tokenmill.core.layers.linear import Linear
from tokenmill.core.layers.linear_shard import column_shard, qkv_shard, row_shard, vocab_shard
from tokenmill.core.layers.norm import RMSNorm
from tokenmill.core.layers.pipeline import MissingLayer, stage_skips
from tokenmill.core.layers.rotary import ApplyRotary, RotaryEmbedding, rotary_dim
from tokenmill.core.layers.vocab_parallel import VocabParallelEmbedding
from tokenmill.core.model_loader.weights import load_weights
from tokenmill.interfaces.attention import AttentionLayerSpec, AttentionMetadata
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.models import ModelContext


class LlamaAttention(nn.Module):
    def __init__(self, model: "LlamaForCausalLM", ctx: ModelContext, prefix: str, layer: int) -> None:
        super().__init__()
        cfg = ctx.hf_config
        hidden = cfg["hidden_size"]
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        self.head_dim = cfg.get("head_dim") or hidden // num_heads
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        qkv, self.num_heads, self.num_kv_heads = qkv_shard(hidden, num_heads, num_kv_heads, self.head_dim,
                                                           ctx.parallel, f"{prefix}.qkv_proj")
        self.split = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.qkv_proj = Linear(hidden, [q_size, kv_size, kv_size], bias=model.qkv_bias(cfg), dtype=ctx.dtype,
                               quantization=ctx.quantization, prefix=f"{prefix}.qkv_proj", shard=qkv)
        self.o_proj = Linear(q_size, [hidden], bias=model.o_bias(cfg), dtype=ctx.dtype,
                             quantization=ctx.quantization, prefix=f"{prefix}.o_proj",
                             shard=row_shard(q_size, hidden, ctx.parallel, f"{prefix}.o_proj"))
        if model.qk_norm:
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm = model.norm_class(self.head_dim, eps, ctx.dtype)
            self.k_norm = model.norm_class(self.head_dim, eps, ctx.dtype)
        self.rotary = ApplyRotary(rotary_dim(self.head_dim, cfg["rope_parameters"]))
        spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            scale=model.attention_scale(cfg, self.head_dim),
            sliding_window=model.sliding_window(cfg, layer),
            logits_soft_cap=cfg.get("attn_logit_softcapping"),
        )
        self.attn = Attention(spec, ctx.attention)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, *cos_sin)
        out = self.attn(q, k, v, metadata)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, ctx: ModelContext, cfg: Mapping[str, Any], prefix: str,
                 intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], intermediate_size or cfg["intermediate_size"]
        bias = bool(cfg.get("mlp_bias", False))
        self.gate_up_proj = Linear(hidden, [inter, inter], bias=bias, dtype=ctx.dtype,
                                   quantization=ctx.quantization, prefix=f"{prefix}.gate_up_proj",
                                   shard=column_shard(hidden, [inter, inter], ctx.parallel, f"{prefix}.gate_up_proj"))
        self.down_proj = Linear(inter, [hidden], bias=bias, dtype=ctx.dtype,
                                quantization=ctx.quantization, prefix=f"{prefix}.down_proj",
                                shard=row_shard(inter, hidden, ctx.parallel, f"{prefix}.down_proj"))
        self.act = GatedActivation(cfg.get("hidden_activation") or cfg.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, model: "LlamaForCausalLM", ctx: ModelContext, prefix: str, layer: int) -> None:
        super().__init__()
        cfg = ctx.hf_config
        eps, hidden = cfg.get("rms_norm_eps", 1e-6), cfg["hidden_size"]
        self.sandwich = model.sandwich_norms
        self.self_attn = LlamaAttention(model, ctx, f"{prefix}.self_attn", layer)
        self.mlp = model.make_mlp(ctx, f"{prefix}.mlp", layer)
        self.input_layernorm = model.norm_class(hidden, eps, ctx.dtype)
        # Llama: post_attention_layernorm is the pre-MLP norm. Gemma-2 ("sandwich"):
        # it normalises the attention output, and the MLP has its own pre/post norms.
        self.post_attention_layernorm = model.norm_class(hidden, eps, ctx.dtype)
        if self.sandwich:
            self.pre_feedforward_layernorm = model.norm_class(hidden, eps, ctx.dtype)
            self.post_feedforward_layernorm = model.norm_class(hidden, eps, ctx.dtype)

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: Optional[torch.Tensor],
                metadata: AttentionMetadata) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The residual stream is ``x + residual`` (``x`` alone where ``residual`` is None): each
        norm adds a sublayer's output to the stream and normalises the sum in one call (one
        kernel where the platform fuses them), so the layer returns its MLP output and the
        stream apart, and the next layer's first norm adds them."""
        if self.sandwich:  # Gemma-2 normalises the sublayers' outputs before adding: its stream stays whole
            x = x + self.post_attention_layernorm(self.self_attn(cos_sin, self.input_layernorm(x), metadata))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), None
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(cos_sin, h, metadata), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module, FusableDecoder):
    """The decoder stack; under pipeline parallelism, this stage's layers of it (the first
    stage embeds, the last normalises, and hidden states travel between them)."""

    def __init__(self, model: "LlamaForCausalLM", ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.parallel = stage = ctx.parallel
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.hidden_size, self.dtype = cfg["hidden_size"], ctx.dtype
        self.rotary_emb = RotaryEmbedding(head_dim, cfg["rope_parameters"], cfg.get("max_position_embeddings") or 2048)
        # a tied head computes the logits from the embedding: the last stage needs it too
        if stage.is_first_stage or (stage.is_last_stage and model.tie_word_embeddings):
            self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"], ctx.dtype, stage)
        else:
            self.embed_tokens = MissingLayer()
        self.embed_scale = model.embed_scale(cfg)
        self.held = stage.layer_range(cfg["num_hidden_layers"])
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(model, ctx, f"model.layers.{i}", i) if i in self.held else MissingLayer()
            for i in range(cfg["num_hidden_layers"]))
        self.norm = (model.norm_class(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), ctx.dtype)
                     if stage.is_last_stage else MissingLayer())

    def decoder_layer_parts(self) -> Optional[list[DecoderLayerParts]]:
        if self.parallel.world_size > 1:  # the fused stack has no collectives in it
            return None
        if not all(type(layer) is LlamaDecoderLayer and not layer.sandwich and type(layer.mlp) is LlamaMLP
                   and type(layer.self_attn) is LlamaAttention and not hasattr(layer.self_attn, "q_norm")
                   for layer in self.layers):
            return None
        return [DecoderLayerParts(layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.rotary,
                                  layer.self_attn.attn, layer.self_attn.o_proj, layer.post_attention_layernorm,
                                  layer.mlp.gate_up_proj, layer.mlp.act, layer.mlp.down_proj)
                for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        stage = self.parallel
        if stage.is_first_stage:
            x = self.embed_tokens(input_ids)
            if self.embed_scale is not None:
                x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        else:
            x = stage.comm.recv_prev((input_ids.shape[0], self.hidden_size), self.dtype)
        cos_sin = self.rotary_emb(positions, x.dtype)  # once per step, shared by every layer
        if self.fused_decoder is not None and self.fused_decoder.accepts(x, metadata):
            return self.norm(self.fused_decoder(x, cos_sin, metadata))
        residual = None
        for i in self.held:
            x, residual = self.layers[i](cos_sin, x, residual, metadata)
        if not stage.is_last_stage:  # the next stage gets the stream whole
            x = x if residual is None else x + residual
            stage.comm.send_next(x)
            return x
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """The Llama decoder; subclasses change the switches below, not the code."""

    stacked_params = (
        ("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    )
    norm_class: type[nn.Module] = RMSNorm
    #: RMSNorm on each head's q and k before rotary (Qwen3)
    qk_norm = False
    #: Gemma-2's extra norms around attention and MLP outputs
    sandwich_norms = False
    #: HF's ``tie_word_embeddings`` default for the family: transformers 4 omits the key
    #: from config.json when it equals that default
    tie_word_embeddings_default = False
    #: the stack splits into pipeline stages (LlamaModel)
    supports_pipeline_parallel = True

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", self.tie_word_embeddings_default))
        self.model = LlamaModel(self, ctx)
        self.final_logit_softcapping = cfg.get("final_logit_softcapping")
        self.parallel = ctx.parallel
        if not self.tie_word_embeddings and ctx.parallel.is_last_stage:
            self.lm_head = Linear(cfg["hidden_size"], [cfg["vocab_size"]], bias=False, dtype=ctx.dtype,
                                  shard=vocab_shard(cfg["hidden_size"], cfg["vocab_size"], ctx.parallel))

    # --- switches ----------------------------------------------------------
    @staticmethod
    def qkv_bias(cfg: Mapping[str, Any]) -> bool:
        return bool(cfg.get("attention_bias", False))

    @staticmethod
    def o_bias(cfg: Mapping[str, Any]) -> bool:
        return bool(cfg.get("attention_bias", False))

    @staticmethod
    def attention_scale(cfg: Mapping[str, Any], head_dim: int) -> float:
        return head_dim**-0.5

    @staticmethod
    def embed_scale(cfg: Mapping[str, Any]) -> Optional[float]:
        return None

    @staticmethod
    def sliding_window(cfg: Mapping[str, Any], layer: int) -> Optional[int]:
        """The window of layer ``layer``: per ``layer_types`` when given, else global."""
        window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        if window is None or (layer_types and layer_types[layer] != "sliding_attention"):
            return None
        return int(window)

    def make_mlp(self, ctx: ModelContext, prefix: str, layer: int) -> nn.Module:
        return LlamaMLP(ctx, ctx.hf_config, prefix)

    # --- CausalLM ----------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of this rank's vocabulary range (all of it without tensor parallelism)."""
        if self.tie_word_embeddings:
            logits = nn.functional.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def output_projection(self) -> Optional[torch.Tensor]:
        # a soft cap is monotonic but can round large logits to ties that the raw ones lack
        if self.final_logit_softcapping is not None:
            return None
        # a pipeline stage before the last holds no head; prepacking may drop a head's plain weight
        head = getattr(self.model, "embed_tokens", None) if self.tie_word_embeddings else getattr(self, "lm_head", None)
        return getattr(head, "weight", None)

    def checkpoint_skips(self) -> list[str]:
        """Checkpoint tensors this rank does not load: rotary caches, a tied head's copy, and
        under pipeline parallelism what other stages hold."""
        stage = self.parallel
        skip = ["rotary_emb.inv_freq"]
        if self.tie_word_embeddings or not stage.is_last_stage:
            skip.append("lm_head.")
        if isinstance(self.model.embed_tokens, MissingLayer):
            skip.append("model.embed_tokens.")
        if not stage.is_last_stage:
            skip.append("model.norm.")
        return skip + self.other_stages()

    def other_stages(self) -> list[str]:
        """Checkpoint name fragments of the layers other pipeline stages hold (adapters skip them too)."""
        return stage_skips(self.parallel, len(self.model.layers), "model.layers.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights(self, weights, self.stacked_params, self.checkpoint_skips())


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama block with sliding-window attention on every layer."""


@hookimpl
def register_model_architectures(register):
    register("LlamaForCausalLM", LlamaForCausalLM)
    register("MistralForCausalLM", MistralForCausalLM)
