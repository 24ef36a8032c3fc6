"""Gated MLP activations over a fused gate/up projection."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from tokenmill.interfaces.errors import ConfigError

_GATES = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def gated_activation(name: str):
    """``act(gate) * up`` for a ``[..., 2 * d]`` tensor holding gate then up."""
    try:
        act = _GATES[name]
    except KeyError:
        raise ConfigError("hidden_act", f"unsupported activation {name!r}; "
                          f"supported: {', '.join(sorted(_GATES))}") from None

    def apply(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return act(gate) * up

    return apply
