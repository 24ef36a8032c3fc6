"""Rotary position embeddings (NeoX "rotate half" layout), with HF's scaling types.

Frequencies follow transformers' ``modeling_rope_utils`` formula for formula,
so fp32 logits match the reference to the last bits that matter.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

from tokenmill.interfaces.errors import ConfigError


def inverse_frequencies(rope: Mapping[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim // 2], attention_scaling)`` for a ``rope_parameters`` dict."""
    rope_type = rope.get("rope_type", "default")
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    base = rope["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / rope["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    raise ConfigError(
        "rope_parameters.rope_type",
        f"rope type {rope_type!r} is not supported yet; supported: default, linear, llama3",
    )


def _llama3(inv_freq: torch.Tensor, rope: Mapping[str, Any]) -> torch.Tensor:
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: Mapping[str, Any]) -> None:
        super().__init__()
        inv_freq, self.scaling = inverse_frequencies(rope, head_dim)
        self.rotary_dim = 2 * inv_freq.numel()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq  # [num_tokens, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos = (emb.cos() * self.scaling).to(query.dtype)
        sin = (emb.sin() * self.scaling).to(query.dtype)
        return _rotate(query, cos, sin, self.rotary_dim), _rotate(key, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest.numel() == 0 else torch.cat((out, rest), dim=-1)
