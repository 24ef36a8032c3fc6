"""Structured outputs as a logits processor: each constrained row keeps its own matcher,
which advances with the row's new tokens; the batch's bitmask is applied in one operation.
A constraint that ``starts_after`` some tokens (the end of a reasoning model's thinking)
leaves its row free until the row has written them; its matcher takes the tokens after."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tokenmill.core.structured_output.bitmask import allocate_bitmask, allow_only, apply_bitmask
from tokenmill.core.structured_output.manager import StructuredOutputManager
from tokenmill.interfaces.logits_processor import (AddedRow, BatchUpdate, LogitsProcessor, LogitsProcessorContext,
                                                  on_device)
from tokenmill.interfaces.sampling_params import SamplingParams
from tokenmill.interfaces.structured_output import ConstraintMatcher


@dataclass
class _Row:
    matcher: ConstraintMatcher
    #: the request's live output tokens, and how many of them the matcher has taken
    output: Sequence[int]
    consumed: int = 0
    #: the tokens the constraint waits for, while the row has not written them yet
    waits_for: Optional[tuple[int, ...]] = None

    def opened(self) -> bool:
        """Whether the constraint holds now: past its ``starts_after`` tokens, whose end
        becomes where the matcher starts. Looks only at what was written since the last look
        (less the marker's length, for a marker split over steps)."""
        if self.waits_for is None:
            return True
        marker, output = self.waits_for, self.output
        for start in range(max(0, self.consumed - len(marker) + 1), len(output) - len(marker) + 1):
            if tuple(output[start:start + len(marker)]) == marker:
                self.waits_for, self.consumed = None, start + len(marker)
                return True
        self.consumed = len(output)
        return False


class StructuredOutput(LogitsProcessor):
    """Masks every token that would break a row's constraint; once the constraint is
    complete only end-of-sequence tokens remain, so the request ends with ``stop``."""

    def __init__(self, context: LogitsProcessorContext, manager: StructuredOutputManager) -> None:
        super().__init__(context)
        self.manager = manager
        self._rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def applies_to(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None

    def update_state(self, update: Optional[BatchUpdate]) -> None:
        if update is not None:
            update.apply_to(self._rows, self._start)

    def _start(self, row: AddedRow) -> Optional[_Row]:
        constraint = row.params.structured_outputs
        if constraint is None:
            return None
        # a request resumed after preemption has a history: the matcher replays it
        return _Row(self.manager.compiled(constraint).new_matcher(), row.output_token_ids,
                    waits_for=constraint.starts_after)

    def is_active(self) -> bool:
        return bool(self._rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        indices = sorted(self._rows)
        bitmask = allocate_bitmask(len(indices), logits.shape[1])
        for position, index in enumerate(indices):
            row = self._rows[index]
            if not row.opened():  # its row of the bitmask allows every token
                continue
            for token in row.output[row.consumed:]:
                if not row.matcher.accept_token(token):
                    raise RuntimeError(f"token {token} breaks the structured output constraint (another "
                                       "parameter, such as allowed_token_ids or bad_words, left the "
                                       "constraint no token to continue with)")
                row.consumed += 1
            if row.matcher.is_terminated():
                allow_only(bitmask, position, self.context.eos_token_ids)
            else:
                row.matcher.fill_bitmask(bitmask, position)
        return apply_bitmask(logits, bitmask, on_device(logits.device, indices, torch.long))
