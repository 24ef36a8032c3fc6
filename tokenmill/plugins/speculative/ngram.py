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

from tokenmill.interfaces.speculative import DraftRequest, ProposerContext, SpeculativeProposer


class NgramProposer(SpeculativeProposer):
    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.min_n = int(context.options["prompt_lookup_min"])
        self.max_n = int(context.options["prompt_lookup_max"])

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._lookup(np.asarray(r.token_ids, dtype=np.int64), r.max_draft_tokens) for r in requests]

    def _lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """Candidates are the earlier positions holding the last token (one vectorised
        comparison); each is extended backwards while it matches, up to prompt_lookup_max."""
        end = len(tokens) - 1
        best_n, best = 0, -1
        for i in np.flatnonzero(tokens[:end] == tokens[end]).tolist():
            n = 1
            while n < self.max_n and i - n >= 0 and tokens[i - n] == tokens[end - n]:
                n += 1
            if n > best_n:  # strictly longer: among the longest, the earliest stays
                best_n, best = n, i
                if n == self.max_n:
                    break
        if best_n < self.min_n:
            return []
        return tokens[best + 1:best + 1 + k].tolist()

    def describe(self) -> dict[str, int]:
        return {"prompt_lookup_min": self.min_n, "prompt_lookup_max": self.max_n}
