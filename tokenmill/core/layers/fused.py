"""Switches a loaded model's hot elementwise layers to the fused C++ kernels.

RMSNorm, SiLU-and-mul and rotary embeddings each replace five to fifteen
eager ops (a full pass over the activations each, and ~2-5 us of dispatch:
at decode batch sizes the dispatch is most of it) with one. Applied by the engine unless
``enforce_eager`` is set, which keeps the eager modules as the reference the
fused ones are tested against.
"""

from __future__ import annotations

from torch import nn

from tokenmill.core.kernels import cpu_kernels
from tokenmill.core.layers.activation import GatedActivation
from tokenmill.core.layers.norm import RMSNorm
from tokenmill.core.layers.rotary import RotaryEmbedding


def enable_fused_ops(model: nn.Module) -> int:
    """Returns how many layers now use a fused kernel (0 where the kernels could not be built)."""
    kernels = cpu_kernels()
    if kernels is None:
        return 0
    count = 0
    for module in model.modules():
        if (type(module) in (RMSNorm, RotaryEmbedding)
                or (isinstance(module, GatedActivation) and module.name == "silu")):
            module.kernels = kernels
            count += 1
    return count
