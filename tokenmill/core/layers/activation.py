"""Gated MLP activations over a fused gate/up projection."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.core.kernels import FUSED_DTYPES
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


class GatedActivation(nn.Module):
    """``act(gate) * up`` for a ``[..., 2 * d]`` tensor holding gate then up."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.act = activation(name)
        #: the C++ kernels module when fused ops are on (layers.fused); SiLU only
        self.kernels: Optional[ModuleType] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype in FUSED_DTYPES:
            out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
            self.kernels.silu_and_mul(out, x.contiguous())
            return out
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
