"""OpenAI's logit_bias: a per-request bias added to chosen tokens' logits."""

from __future__ import annotations

from typing import Optional

import torch

from tokenmill.interfaces.logits_processor import BatchUpdate, LogitsProcessor, on_device
from tokenmill.interfaces.sampling_params import SamplingParams


class LogitBias(LogitsProcessor):
    def __init__(self, context) -> None:
        super().__init__(context)
        self._rows: dict[int, dict[int, float]] = {}
        #: (rows, tokens, biases) of the whole batch, rebuilt only when the batch changes
        self._flat: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    def is_argmax_invariant(self) -> bool:
        return False

    def applies_to(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def update_state(self, update: Optional[BatchUpdate]) -> None:
        if update is not None:
            update.apply_to(self._rows, lambda row: row.params.logit_bias or None)
            self._flat = None

    def is_active(self) -> bool:
        return bool(self._rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        if self._flat is None:
            items = [(i, token, bias) for i, biases in self._rows.items() for token, bias in biases.items()]
            rows, tokens, biases = zip(*items)
            self._flat = (on_device(logits.device, rows, torch.long), on_device(logits.device, tokens, torch.long),
                          on_device(logits.device, biases, logits.dtype))
        rows, tokens, biases = self._flat
        return logits.index_put_((rows, tokens), biases, accumulate=True)
