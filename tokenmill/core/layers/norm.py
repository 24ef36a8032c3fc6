"""RMSNorm, computed in float32 like the Hugging Face reference.

Both norms also take the decoder's residual stream: ``norm(x, residual)`` adds the two (in
their dtype, as the model's ``residual + x`` does) and returns ``(norm(sum), sum)``, so that a
platform can do the add and the norm in one pass over the row (vLLM's fused add-RMSNorm)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.core.layers.custom_op import CustomOp


class _ResidualNorm(CustomOp):
    """A norm that may first add the residual stream (``forward_native(x, residual)``)."""

    def forward_native(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return self.normalize(x)
        x = x + residual
        return self.normalize(x), x

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class RMSNorm(_ResidualNorm):
    """``weight * x / rms(x)``; a platform may fuse it, with the residual add (op ``rms_norm``)."""

    op_name = "rms_norm"

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(_ResidualNorm):
    """Gemma's RMSNorm: the weight is an offset from 1, applied in float32 before the cast. A
    platform may fuse it (op ``gemma_rms_norm``)."""

    op_name = "gemma_rms_norm"

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)
