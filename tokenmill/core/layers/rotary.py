"""Rotary position embeddings (NeoX "rotate half" layout), with HF's scaling types.

Frequencies follow transformers' ``modeling_rope_utils`` formula for formula,
so fp32 logits match the reference to the last bits that matter.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Mapping, Optional

import torch
from torch import nn

from tokenmill.core.kernels import FUSED_DTYPES
from tokenmill.interfaces.errors import ConfigError


SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


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
    """Every layer of a model has one; those with the same parameters share the cos/sin
    of the current step (computed by the first layer, reused by the rest)."""

    def __init__(self, head_dim: int, rope: Mapping[str, Any], max_position_embeddings: int) -> None:
        super().__init__()
        inv_freq, self.scaling, long = inverse_frequencies(rope, head_dim, max_position_embeddings)
        self.rotary_dim = 2 * inv_freq.numel()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # longrope: positions from `long_from` on use the long-context factors
        self.long_from = long[1] if long else None
        self.register_buffer("long_inv_freq", long[0] if long else None, persistent=False)
        key = (tuple(inv_freq.tolist()), self.scaling, self.long_from,
               tuple(long[0].tolist()) if long else None)
        #: dtype -> (the step's positions tensor, cos, sin), shared by equal layers
        self._step = _STEP_CACHES.setdefault(key, {})
        #: the C++ kernels module when fused ops are on (layers.fused)
        self.kernels: Optional[ModuleType] = None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, query.dtype)
        if self.kernels is not None and query.dtype in FUSED_DTYPES:
            self.kernels.rotary_embedding(query, key, cos, sin)  # in place
            return query, key
        cos, sin = cos[:, None, :], sin[:, None, :]
        return _rotate(query, cos, sin, self.rotary_dim), _rotate(key, cos, sin, self.rotary_dim)

    def shares_cos_sin(self, other: "RotaryEmbedding") -> bool:
        """Whether the two compute the same cos/sin (and so share each step's)."""
        return self._step is other._step

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, rotary_dim] each, in ``dtype`` (the eager code's rounding)."""
        entry = self._step.get(dtype)  # one tuple, replaced whole: safe across engine threads
        if entry is None or entry[0] is not positions:
            freqs = positions[:, None].float() * self.inv_freq  # [num_tokens, rotary_dim // 2]
            if self.long_from is not None:
                long = positions[:, None].float() * self.long_inv_freq
                freqs = torch.where(positions[:, None] >= self.long_from, long, freqs)
            emb = torch.cat((freqs, freqs), dim=-1)
            entry = (positions, (emb.cos() * self.scaling).to(dtype).contiguous(),
                     (emb.sin() * self.scaling).to(dtype).contiguous())
            self._step[dtype] = entry
        return entry[1], entry[2]


#: per distinct rotary configuration, the current step's cos/sin (see RotaryEmbedding)
_STEP_CACHES: dict[tuple, dict] = {}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest.numel() == 0 else torch.cat((out, rest), dim=-1)
