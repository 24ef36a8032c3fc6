"""GPT-2: learned positions, pre-LayerNorm blocks, Conv1D (transposed) weights, GELU (tanh).

The head is tied to ``wte`` unless the config says ``tie_word_embeddings: false``
(HF's GPT-2 default is tied, and checkpoints saved with the default omit the key).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from tokenmill.core.layers.activation import activation
from tokenmill.core.layers.attention import Attention
from tokenmill.core.layers.linear import Linear
from tokenmill.core.layers.linear_shard import column_shard, row_shard, vocab_shard
from tokenmill.core.layers.vocab_parallel import VocabParallelEmbedding
from tokenmill.core.model_loader.weights import load_weights
from tokenmill.interfaces.attention import AttentionLayerSpec, AttentionMetadata
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.models import ModelContext

#: Conv1D layers store [in, out]; the loader transposes them to Linear's [out, in]
_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


class GPT2Block(nn.Module):
    def __init__(self, ctx: ModelContext, cfg: Mapping[str, Any], layer: int) -> None:
        super().__init__()
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        inner = cfg.get("n_inner") or 4 * hidden
        eps = cfg.get("layer_norm_epsilon", 1e-5)
        tp = ctx.parallel
        if heads % tp.tp_size:
            raise ConfigError("tensor_parallel_size", f"{heads} attention heads, which "
                                                      f"tensor_parallel_size={tp.tp_size} does not divide")
        self.heads, self.head_dim = heads // tp.tp_size, hidden // heads
        self.ln_1 = nn.LayerNorm(hidden, eps=eps, dtype=ctx.dtype)
        name = f"transformer.h.{layer}"
        # q, k and v are each split by heads: every part of the fused layer keeps 1 / tp
        self.c_attn = Linear(hidden, [hidden] * 3, bias=True, dtype=ctx.dtype, quantization=ctx.quantization,
                             prefix=f"{name}.attn.c_attn", shard=column_shard(hidden, [hidden] * 3, tp, name))
        self.c_proj = Linear(hidden, [hidden], bias=True, dtype=ctx.dtype, quantization=ctx.quantization,
                             prefix=f"{name}.attn.c_proj", shard=row_shard(hidden, hidden, tp, name))
        self.ln_2 = nn.LayerNorm(hidden, eps=eps, dtype=ctx.dtype)
        self.c_fc = Linear(hidden, [inner], bias=True, dtype=ctx.dtype, quantization=ctx.quantization,
                           prefix=f"{name}.mlp.c_fc", shard=column_shard(hidden, [inner], tp, name))
        self.mlp_proj = Linear(inner, [hidden], bias=True, dtype=ctx.dtype, quantization=ctx.quantization,
                               prefix=f"{name}.mlp.c_proj", shard=row_shard(inner, hidden, tp, name))
        self.act = activation(cfg.get("activation_function", "gelu_new"))
        scale = self.head_dim**-0.5 if cfg.get("scale_attn_weights", True) else 1.0
        if cfg.get("scale_attn_by_inverse_layer_idx"):
            scale /= layer + 1
        self.attn = Attention(AttentionLayerSpec(self.heads, self.heads, self.head_dim, scale), ctx.attention)

    def forward(self, x: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(x)).view(-1, 3, self.heads, self.head_dim).unbind(1)
        x = x + self.c_proj(self.attn(q, k, v, metadata).flatten(1))
        return x + self.mlp_proj(self.act(self.c_fc(self.ln_2(x))))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        hidden = cfg["hidden_size"]
        self.wte = VocabParallelEmbedding(cfg["vocab_size"], hidden, ctx.dtype, ctx.parallel)
        self.wpe = nn.Embedding(cfg["max_position_embeddings"], hidden, dtype=ctx.dtype)
        self.h = nn.ModuleList(GPT2Block(ctx, cfg, i) for i in range(cfg["num_hidden_layers"]))
        self.ln_f = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_epsilon", 1e-5), dtype=ctx.dtype)
        for param in (*self.wte.parameters(), *self.wpe.parameters(), *self.ln_f.parameters()):
            param.requires_grad_(False)
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(hidden, [cfg["vocab_size"]], bias=False, dtype=ctx.dtype,
                                  shard=vocab_shard(hidden, cfg["vocab_size"], ctx.parallel))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, metadata)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of this rank's vocabulary range (all of it without tensor parallelism)."""
        if self.tie_word_embeddings:
            return nn.functional.linear(hidden, self.wte.weight).float()
        return self.lm_head(hidden).float()

    def output_projection(self) -> Optional[torch.Tensor]:
        if self.tie_word_embeddings:
            return self.wte.weight
        return getattr(self.lm_head, "weight", None)  # prepacking without the GEMV drops it

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed():
            for name, tensor in weights:
                if name.endswith((".attn.bias", ".attn.masked_bias")):
                    continue  # old checkpoints' causal-mask buffers
                if name.endswith(_CONV1D):
                    tensor = tensor.t()
                name = name.removeprefix("transformer.")
                name = name.replace(".attn.c_attn.", ".c_attn.").replace(".attn.c_proj.", ".c_proj.")
                name = name.replace(".mlp.c_fc.", ".c_fc.").replace(".mlp.c_proj.", ".mlp_proj.")
                yield name, tensor

        # a tied head is wte itself: some checkpoints store the copy anyway
        return load_weights(self, renamed(), skip=["lm_head."] if self.tie_word_embeddings else [])


@hookimpl
def register_model_architectures(register):
    register("GPT2LMHeadModel", GPT2LMHeadModel)
