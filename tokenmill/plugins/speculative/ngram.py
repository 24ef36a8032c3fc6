"""Prompt lookup (vLLM's ``ngram`` method): if the last n tokens occurred before, guess that
what followed them then follows them again.

Free to run and good wherever a reply repeats its context: code edits, quoting, extraction,
summaries that copy phrases. The longest n in [prompt_lookup_min, prompt_lookup_max] with a
match wins, and among its matches the earliest (vLLM's choice: it has the most text after it,
so a repeating pattern yields full-length drafts).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.interfaces.speculative import DraftRequest, ProposerContext, SpeculativeProposer


class NgramProposer(SpeculativeProposer):
    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.min_n = int(context.options["prompt_lookup_min"])
        self.max_n = int(context.options["prompt_lookup_max"])

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._lookup(np.asarray(r.token_ids, dtype=np.int64), r.max_draft_tokens) for r in requests]

    def _lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # windows that start before the suffix itself, so something follows each one
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[0]) + n
                return tokens[start:start + k].tolist()
        return []

    def describe(self) -> dict[str, int]:
        return {"prompt_lookup_min": self.min_n, "prompt_lookup_max": self.max_n}
