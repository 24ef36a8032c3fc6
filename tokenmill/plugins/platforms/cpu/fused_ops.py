"""The cpu platform's implementations of the core's CustomOps, on the C++ kernels.

RMSNorm, SiLU-and-mul and rotary embeddings each replace five to fifteen eager ops
(a full pass over the activations each, and ~2-5 us of dispatch: at decode batch
sizes the dispatch is most of it) with one kernel call. Each takes what its kernel was
built for (FUSED_DTYPES) and hands anything else to the layer's ``forward_native``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from tokenmill.core.layers.activation import GatedActivation
from tokenmill.core.layers.norm import RMSNorm
from tokenmill.core.layers.rotary import ApplyRotary
from tokenmill.plugins.platforms.cpu.kernels import FUSED_DTYPES, cpu_kernels


def rms_norm(layer: RMSNorm, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
    """The norm on the kernel; with ``residual``, the sum first (its own pass: on the CPU the
    fused decode stack is where the residual stream stays in cache)."""
    if residual is not None:
        x = x + residual
        return rms_norm(layer, x), x
    if x.dtype not in FUSED_DTYPES or x.dtype != layer.weight.dtype:
        return layer.forward_native(x)
    out = torch.empty_like(x)
    cpu_kernels().rms_norm(out, x.contiguous(), layer.weight, layer.eps)
    return out


def silu_and_mul(layer: GatedActivation, x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in FUSED_DTYPES:
        return layer.forward_native(x)
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    cpu_kernels().silu_and_mul(out, x.contiguous())
    return out


def rotary_embedding(layer: ApplyRotary, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if query.dtype not in FUSED_DTYPES:
        return layer.forward_native(query, key, cos, sin)
    cpu_kernels().rotary_embedding(query, key, cos, sin)  # in place
    return query, key


#: op name -> implementation (CustomOp.op_name)
FUSED_OPS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "silu_and_mul": silu_and_mul,
    "rotary_embedding": rotary_embedding,
}
