"""RMSNorm, computed in float32 like the Hugging Face reference."""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
from torch import nn

from tokenmill.core.kernels import FUSED_DTYPES


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        #: the C++ kernels module when fused ops are on (layers.fused); None = eager ops
        self.kernels: Optional[ModuleType] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.dtype in FUSED_DTYPES and x.dtype == self.weight.dtype:
            out = torch.empty_like(x)
            self.kernels.rms_norm(out, x.contiguous(), self.weight, self.eps)
            return out
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is an offset from 1, applied in float32 before the cast."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)
