"""Greedy tokens of an fp32 model without computing all its fp32 logits.

Greedy decoding needs only each row's argmax, and the output projection is the
largest GEMM of a small model's decode step (the 52M benchmark model: 16.4M of
its 36M multiply-adds per token). The projection runs in bf16 instead, twice as
fast here, as a screen: the C++ kernel bounds each screened logit's distance
from the fp32 one (bf16 rounding of both operands, fp32 summation, the bf16
output) and recomputes in fp32 only the tokens that could still be the argmax,
about five per row at the benchmark shapes. The tokens are those of
``compute_logits(hidden).argmax(-1)``; see ``csrc/screened_argmax.cpp`` for the
bound. Memory: the projection once more in bf16, twice (plain for the GEMV,
packed for oneDNN), together the size of the fp32 weight.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from tokenmill.interfaces.models import OutputProjection


class GreedyHead:
    """``tokens(hidden)`` for rows whose token is the argmax of the raw logits."""

    #: rows from which the screen uses oneDNN's bf16 GEMM; fewer use the streaming GEMV
    GEMM_MIN_ROWS = 3

    def __init__(self, weight: torch.Tensor, kernels: ModuleType) -> None:
        """``weight``: the fp32 [vocab, hidden] projection whose products are the logits."""
        self.weight = weight.detach().contiguous()
        self.kernels = kernels
        screen_weight = self.weight.to(torch.bfloat16)
        self.plain = screen_weight
        self.packed = torch.ops.mkldnn._reorder_linear_weight(screen_weight)
        self.norms = self.weight.double().norm(dim=1).float()

    @classmethod
    def for_model(cls, model: torch.nn.Module, kernels: Optional[ModuleType]) -> Optional["GreedyHead"]:
        """A head for ``model`` where it exposes an fp32 output projection and the kernels and
        oneDNN's bf16 GEMM are here; else None (greedy rows then take all logits)."""
        weight = model.output_projection() if isinstance(model, OutputProjection) else None
        if (weight is None or weight.dtype != torch.float32 or kernels is None
                or not hasattr(kernels, "screened_argmax") or not torch.backends.mkldnn.is_available()
                or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
            return None
        return cls(weight, kernels)

    def tokens(self, hidden: torch.Tensor) -> Optional[list[int]]:
        """Each row's greedy token, or None where a row has no candidate (NaN in its
        hidden state): the caller then takes the logits path, which reports it as it is."""
        x = hidden.float().contiguous()
        low = x.to(torch.bfloat16)
        if len(x) < self.GEMM_MIN_ROWS:
            screen = self.kernels.gemv(low, self.plain, None)
        else:
            screen = torch.ops.mkldnn._linear_pointwise(low, self.packed, None, "none", [], "")
        tokens, _ = self.kernels.screened_argmax(x, self.weight, screen, self.norms)
        result = tokens.tolist()
        return None if min(result, default=0) < 0 else result
