"""min_tokens: a request's stop tokens (EOS unless ignored, and stop_token_ids) cannot be
sampled before it has generated ``min_tokens`` tokens."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from tokenmill.interfaces.logits_processor import AddedRow, BatchUpdate, LogitsProcessor, on_device
from tokenmill.interfaces.sampling_params import SamplingParams


class MinTokens(LogitsProcessor):
    def __init__(self, context) -> None:
        super().__init__(context)
        #: row -> (min_tokens, the live output tokens, the stop token ids to mask)
        self._rows: dict[int, tuple[int, Sequence[int], tuple[int, ...]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def applies_to(self, params: SamplingParams) -> bool:
        return params.min_tokens > 0

    def update_state(self, update: Optional[BatchUpdate]) -> None:
        if update is not None:
            update.apply_to(self._rows, self._state)

    def _state(self, row: AddedRow) -> Optional[tuple[int, Sequence[int], tuple[int, ...]]]:
        params = row.params
        stops = tuple(dict.fromkeys((() if params.ignore_eos else self.context.eos_token_ids)
                                    + params.stop_token_ids))
        if params.min_tokens == 0 or not stops:
            return None
        return params.min_tokens, row.output_token_ids, stops

    def _masked(self) -> list[tuple[int, tuple[int, ...]]]:
        return [(i, stops) for i, (minimum, output, stops) in self._rows.items() if len(output) < minimum]

    def is_active(self) -> bool:
        return any(len(output) < minimum for minimum, output, _ in self._rows.values())

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        masked = self._masked()
        if masked:
            rows = on_device(logits.device, [i for i, stops in masked for _ in stops], torch.long)
            tokens = on_device(logits.device, [t for _, stops in masked for t in stops], torch.long)
            logits[rows, tokens] = float("-inf")
        return logits
