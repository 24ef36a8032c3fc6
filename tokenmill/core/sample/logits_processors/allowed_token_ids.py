"""vLLM's allowed_token_ids: every other token's logit becomes -inf."""

from __future__ import annotations

from typing import Optional

import torch

from tokenmill.interfaces.logits_processor import BatchUpdate, LogitsProcessor, on_device
from tokenmill.interfaces.sampling_params import SamplingParams


class AllowedTokenIds(LogitsProcessor):
    def __init__(self, context) -> None:
        super().__init__(context)
        self._rows: dict[int, tuple[int, ...]] = {}
        #: (rows, a [rows, vocab] mask of disallowed tokens), rebuilt only when the batch changes
        self._mask: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def is_argmax_invariant(self) -> bool:
        return False

    def applies_to(self, params: SamplingParams) -> bool:
        return bool(params.allowed_token_ids)

    def update_state(self, update: Optional[BatchUpdate]) -> None:
        if update is not None:
            update.apply_to(self._rows, lambda row: row.params.allowed_token_ids)
            self._mask = None

    def is_active(self) -> bool:
        return bool(self._rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        if self._mask is None:
            rows = sorted(self._rows)
            mask = torch.ones(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
            at = [i for i, row in enumerate(rows) for _ in self._rows[row]]
            allowed = [token for row in rows for token in self._rows[row]]
            mask[on_device(logits.device, at, torch.long), on_device(logits.device, allowed, torch.long)] = False
            self._mask = (on_device(logits.device, rows, torch.long), mask)
        rows, mask = self._mask
        logits[rows] = logits[rows].masked_fill(mask, float("-inf"))
        return logits
