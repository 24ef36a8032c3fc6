"""Greedy tokens of an fp32 model without computing all its fp32 logits.

Greedy decoding needs only each row's argmax, and the output projection is the
largest GEMM of a small model's decode step (the 52M benchmark model: 16.4M of
its 36M multiply-adds per token). The projection runs in int8 instead (AVX512-VNNI:
~1.9x oneDNN's bf16 GEMM, which the screen used before, and ~3.5x fp32; AVX2's
byte products where VNNI is missing) as a screen: the C++ kernel bounds each screened logit's distance from the fp32
one (from the quantization residuals, which it knows exactly) and recomputes in
fp32 only the tokens that could still be the argmax, about 15 per row at the
benchmark shapes. The tokens are those of ``compute_logits(hidden).argmax(-1)``;
see ``csrc/screened_argmax.cpp`` for the bound. Memory: the projection once more
in int8, a quarter of the fp32 weight.
"""

from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

from tokenmill.interfaces.models import OutputProjection


#: output rows quantized at a time: the fp64 residuals of a whole 32000-row projection are
#: three 131 MB temporaries, which would stand on top of an engine's KV cache at startup
ROWS_AT_ONCE = 2048


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (values, scales, residual norms |w - scale * values|)."""
    scales = weight.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.empty(weight.shape, dtype=torch.int8)
    residuals = torch.empty(weight.shape[0])
    for rows in torch.arange(weight.shape[0]).split(ROWS_AT_ONCE):
        part, scale = weight[rows], scales[rows, None]
        rounded = torch.round(part / scale).clamp(-127, 127)
        values[rows] = rounded.to(torch.int8)
        residuals[rows] = (part.double() - scale.double() * rounded.double()).norm(dim=1).float()
    return values, scales, residuals


def row_norms(weight: torch.Tensor) -> torch.Tensor:
    """Each row's fp64 norm, as fp32 (ROWS_AT_ONCE rows at a time)."""
    return torch.cat([part.double().norm(dim=1).float() for part in weight.split(ROWS_AT_ONCE)])


class GreedyHead:
    """``tokens(hidden)`` for rows whose token is the argmax of the raw logits."""

    def __init__(self, weight: torch.Tensor, kernels: ModuleType) -> None:
        """``weight``: the fp32 [vocab, hidden] projection whose products are the logits."""
        self.weight = weight.detach().contiguous()
        self.kernels = kernels
        values, self.scales, self.residuals = quantize_rows(self.weight)
        self.norms = row_norms(self.weight)
        # the byte products take x unsigned: the kernel offsets x's values and takes back offset * sum(w)
        self.sums = values.int().sum(dim=1).int()
        # [ceil(N/16), ceil(K/4), 16 columns x 4 values]: per 16 outputs and 4 inputs, one AVX-512
        # register (two AVX2 ones)
        n, k = values.shape
        padded = torch.zeros(-(-n // 16) * 16, -(-k // 4) * 4, dtype=torch.int8)
        padded[:n, :k] = values
        self.packed = padded.view(-1, 16, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).reshape(
            padded.shape[0] // 16, padded.shape[1] // 4, 64).contiguous()

    @classmethod
    def for_model(cls, model: torch.nn.Module, kernels: Optional[ModuleType]) -> Optional["GreedyHead"]:
        """A head for ``model`` where it exposes an fp32 output projection and the kernels were
        built with AVX512-VNNI or AVX2; else None (greedy rows then take all logits)."""
        weight = model.output_projection() if isinstance(model, OutputProjection) else None
        if (weight is None or weight.dtype != torch.float32 or kernels is None
                or not hasattr(kernels, "screened_argmax_available") or not kernels.screened_argmax_available()):
            return None
        return cls(weight, kernels)

    def screen(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, candidates rechecked in fp32) per row; token -1 where a row is not finite."""
        return self.kernels.screened_argmax(hidden.float().contiguous(), self.weight, self.packed, self.scales,
                                            self.norms, self.residuals, self.sums)

    def tokens(self, hidden: torch.Tensor) -> Optional[list[int]]:
        """Each row's greedy token, or None where a row is not finite (NaN or inf in its
        hidden state): the caller then takes the logits path, which reports it as it is."""
        result = self.screen(hidden)[0].tolist()
        return None if min(result, default=0) < 0 else result
