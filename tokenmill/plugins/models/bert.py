"""BERT-style encoders for embeddings (all-MiniLM, bge, e5 ...): ``BertModel``.

Attention is bidirectional over a padded batch, so it does not use the paged
attention backends (which serve causal decoding); PyTorch's SDPA with a
padding mask is exact here.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.core.layers.activation import activation
from tokenmill.core.layers.linear import Linear
from tokenmill.core.model_loader.weights import load_weights
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.models import ModelContext


class BertLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        eps = cfg.get("layer_norm_eps", 1e-12)
        self.num_heads = cfg["num_attention_heads"]
        self.qkv = Linear(hidden, [hidden] * 3, bias=True, dtype=dtype, prefix=f"{prefix}.attention.self.qkv")
        self.attention_output = Linear(hidden, [hidden], bias=True, dtype=dtype)
        self.attention_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.intermediate = Linear(hidden, [inter], bias=True, dtype=dtype)
        self.output = Linear(inter, [hidden], bias=True, dtype=dtype)
        self.output_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.act = activation(cfg.get("hidden_act", "gelu"))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.attention_norm(x + self.attention_output(attended.transpose(1, 2).reshape(batch, seq, hidden)))
        return self.output_norm(x + self.output(self.act(self.intermediate(x))))


def num_labels(cfg: Mapping[str, Any]) -> int:
    """A classification head's outputs: HF's ``id2label`` (its default: two labels)."""
    return len(cfg.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"})


class BertModel(nn.Module):
    is_embedding_model = True
    #: checkpoint prefixes this model has no module for (the MLM head; the pooler, used only
    #: by a classification head)
    _skipped_prefixes: tuple[str, ...] = ("pooler.", "cls.")
    #: checkpoint names -> module names (HF's deep BERT naming, flattened)
    _renames = (
        (".attention.self.", "."), (".attention.output.dense.", ".attention_output."),
        (".attention.output.LayerNorm.", ".attention_norm."), (".intermediate.dense.", ".intermediate."),
        (".output.dense.", ".output."), (".output.LayerNorm.", ".output_norm."),
    )

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__()
        cfg = ctx.hf_config
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError("position_embedding_type", "only absolute position embeddings are supported")
        hidden = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], hidden, dtype=ctx.dtype)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], hidden, dtype=ctx.dtype)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), hidden, dtype=ctx.dtype)
        self.embeddings_norm = nn.LayerNorm(hidden, eps=cfg.get("layer_norm_eps", 1e-12), dtype=ctx.dtype)
        self.layers = nn.ModuleList(BertLayer(cfg, ctx.dtype, f"encoder.layer.{i}")
                                    for i in range(cfg["num_hidden_layers"]))
        for param in self.parameters():
            param.requires_grad_(False)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(torch.zeros_like(input_ids)))
        x = self.embeddings_norm(x)
        # additive mask [batch, 1, 1, seq]: padding keys get -inf
        mask = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device).masked_fill(attention_mask == 0,
                                                                                           float("-inf"))
        mask = mask[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed():
            for name, tensor in weights:
                name = name.removeprefix("bert.")
                if name.startswith(self._skipped_prefixes) or name.endswith("position_ids"):
                    continue
                name = name.replace("pooler.dense.", "pooler.")
                name = name.replace("embeddings.LayerNorm.", "embeddings_norm.").removeprefix("embeddings.")
                name = name.replace("encoder.layer.", "layers.")
                for old, new in self._renames:
                    name = name.replace(old, new)
                yield name, tensor

        stacked = (("qkv", "query", 0), ("qkv", "key", 1), ("qkv", "value", 2))
        return load_weights(self, renamed(), stacked)


class BertForSequenceClassification(BertModel):
    """BERT with HF's sequence-classification head: the [CLS] state through the pooler
    (dense, tanh), then the classifier: one logit per label (``classify``)."""

    is_classifier = True
    _skipped_prefixes = ("cls.",)

    def __init__(self, ctx: ModelContext) -> None:
        super().__init__(ctx)
        hidden = ctx.hf_config["hidden_size"]
        self.pooler = nn.Linear(hidden, hidden, dtype=ctx.dtype)
        self.classifier = nn.Linear(hidden, num_labels(ctx.hf_config), dtype=ctx.dtype)
        for param in (*self.pooler.parameters(), *self.classifier.parameters()):
            param.requires_grad_(False)

    def classify(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[batch, seq, hidden] encoder states -> [batch, labels] float32 logits."""
        return self.classifier(torch.tanh(self.pooler(hidden[:, 0]))).float()


@hookimpl
def register_model_architectures(register):
    register("BertModel", BertModel)
    register("BertForSequenceClassification", BertForSequenceClassification)
