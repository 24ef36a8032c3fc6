"""Gated MLP activations over a fused gate/up projection."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tokenmill.core.layers.custom_op import CustomOp
from tokenmill.interfaces.errors import ConfigError

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    """The elementwise activation HF calls ``name``."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ConfigError("hidden_act", f"unsupported activation {name!r}; "
                          f"supported: {', '.join(sorted(_ACTIVATIONS))}") from None


class GatedActivation(CustomOp):
    """``act(gate) * up`` for a ``[..., 2 * d]`` tensor holding gate then up. A platform may
    fuse it: the op is ``f"{name}_and_mul"`` (``silu_and_mul`` for SwiGLU)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.op_name = f"{name}_and_mul"
        self.act = activation(name)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
