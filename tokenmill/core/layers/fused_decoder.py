"""A model's decoder layers as one platform call: the seam for decode fast paths.

At decode batch sizes the weights' read is most of a step, and what the layer-by-layer
path adds to it is Python-level dispatch between ops. A platform may replace a whole
stack of standard pre-norm decoder layers with one call of its own
(``Platform.optimize_model`` sets ``fused_decoder``); the model describes its layers with
``DecoderLayerParts`` and asks the platform's object whether it takes each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch
from torch import nn

from tokenmill.core.layers.activation import GatedActivation
from tokenmill.core.layers.attention import Attention
from tokenmill.core.layers.linear import Linear
from tokenmill.core.layers.rotary import ApplyRotary
from tokenmill.interfaces.attention import AttentionMetadata


@dataclass(frozen=True)
class DecoderLayerParts:
    """One pre-norm decoder layer: ``x += o(attn(rotary(qkv(input_norm(x)))))``, then
    ``x += down(act(gate_up(post_norm(x))))``; q, k, v fused along qkv's outputs."""

    input_norm: nn.Module
    qkv: Linear
    rotary: ApplyRotary
    attn: Attention
    o: Linear
    post_norm: nn.Module
    gate_up: Linear
    act: GatedActivation
    down: Linear


class FusedDecoder(Protocol):
    """A platform's replacement for a stack of ``DecoderLayerParts``."""

    def accepts(self, x: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Whether it runs this step (else the model runs its layers one by one)."""

    def __call__(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                 metadata: AttentionMetadata) -> torch.Tensor:
        """The residual stream after the last layer, given the step's rotary cos/sin."""


class FusableDecoder:
    """Mixin for a model's layer stack that a platform may run as one ``FusedDecoder``."""

    #: set by the platform's optimisation pass; None runs the layers
    fused_decoder: Optional[FusedDecoder] = None

    def decoder_layer_parts(self) -> Optional[list[DecoderLayerParts]]:
        """The layers as parts, or None where any layer is not a standard pre-norm block."""
        return None
