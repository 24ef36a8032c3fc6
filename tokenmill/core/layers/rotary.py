"""Rotary position embeddings (NeoX "rotate half" layout), with HF's scaling types.

Frequencies follow transformers' ``modeling_rope_utils`` formula for formula,
so fp32 logits match the reference to the last bits that matter.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import torch
from torch import nn

from tokenmill.core.layers.custom_op import CustomOp
from tokenmill.interfaces.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rotary_dim(head_dim: int, rope: Mapping[str, Any]) -> int:
    """How many features of each head rotate (``partial_rotary_factor`` of them, rounded up to even)."""
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    return 2 * len(range(0, dim, 2))


def inverse_frequencies(
    rope: Mapping[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float, Optional[tuple[torch.Tensor, int]]]:
    """``(inv_freq [rotary_dim // 2], attention_scaling, long)`` for a ``rope_parameters`` dict.

    ``long`` is ``(inv_freq, from_position)`` for longrope's long-context factors.
    ``dynamic`` NTK scaling only changes frequencies beyond max_position_embeddings,
    which max_model_len never exceeds, so it equals the default here (as in HF).
    """
    rope_type = rope.get("rope_type", "default")
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    base = rope["rope_theta"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0, None
    if rope_type == "linear":
        return inv_freq / rope["factor"], 1.0, None
    if rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0, None
    if rope_type == "yarn":
        return (*_yarn(rope, dim, base, max_position_embeddings), None)
    if rope_type == "longrope":
        original = rope["original_max_position_embeddings"]
        factor = rope.get("factor") or max_position_embeddings / original
        scaling = rope.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        short = 1.0 / (torch.tensor(rope["short_factor"], dtype=torch.float32) * base**exponents)
        long = 1.0 / (torch.tensor(rope["long_factor"], dtype=torch.float32) * base**exponents)
        return short, scaling, (long, original)
    raise ConfigError(
        "rope_parameters.rope_type",
        f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
    )


def _yarn(rope: Mapping[str, Any], dim: int, base: float, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    scaling = rope.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        scaling = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                   if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(scaling)


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
    """A model's rotary frequencies: ``forward(positions, dtype)`` gives the step's cos/sin,
    computed once per forward by the model and handed to every layer's ``ApplyRotary``
    (Hugging Face's ``rotary_emb`` / ``position_embeddings`` split)."""

    def __init__(self, head_dim: int, rope: Mapping[str, Any], max_position_embeddings: int) -> None:
        super().__init__()
        inv_freq, self.scaling, long = inverse_frequencies(rope, head_dim, max_position_embeddings)
        self.rotary_dim = 2 * inv_freq.numel()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # longrope: positions from `long_from` on use the long-context factors
        self.long_from = long[1] if long else None
        self.register_buffer("long_inv_freq", long[0] if long else None, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), [num_tokens, rotary_dim] each, in ``dtype`` (the eager code's rounding).

        Run once a step, so its ops are host work per step: a scale of 1 is skipped (the
        product would be the same bits) and the positions are widened without indexing."""
        column = positions.to(torch.float32).unsqueeze(1)
        freqs = column * self.inv_freq  # [num_tokens, rotary_dim // 2]
        if self.long_from is not None:
            freqs = torch.where(positions.unsqueeze(1) >= self.long_from, column * self.long_inv_freq, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


class ApplyRotary(CustomOp):
    """Rotates q and k by a step's cos/sin (NeoX "rotate half" over the first ``rotary_dim``
    features of each head). A platform may fuse it (op ``rotary_embedding``, which may work in
    place on the strided q/k views of a fused qkv output)."""

    op_name = "rotary_embedding"

    def __init__(self, rotary_dim: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim

    def forward_native(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos: torch.Tensor,  # [num_tokens, rotary_dim]
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _rotate(query, cos, sin, self.rotary_dim), _rotate(key, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest.numel() == 0 else torch.cat((out, rest), dim=-1)
