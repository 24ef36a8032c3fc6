"""Prompt lookup (vLLM's ``ngram`` method): if the last n tokens occurred before, guess that
what followed them then follows them again.

Free to run and good wherever a reply repeats its context: code edits, quoting, extraction,
summaries that copy phrases. The longest n in [prompt_lookup_min, prompt_lookup_max] with a
match wins, and among its matches the earliest (vLLM's choice: it has the most text after it,
so a repeating pattern yields full-length drafts).

Its host work is per step and per request, so it must not grow with the context in Python:
each request's tokens live in an array the proposer extends by the step's new tokens (not one
made from the token list every step), and the lookup is a few array operations over the
positions holding the last token, not a Python loop over them (about 20 us a request at 8k
tokens of context).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from tokenmill.interfaces.speculative import DraftRequest, ProposerContext, SpeculativeProposer


class _TokenArray:
    """One request's tokens as a growing int64 array (capacity doubles, so appending is
    amortised O(new tokens))."""

    def __init__(self) -> None:
        self._data = np.empty(256, dtype=np.int64)
        self.size = 0

    def synced(self, tokens: Sequence[int]) -> np.ndarray:
        """The array after appending the tokens it has not seen (a request's tokens only grow)."""
        new = len(tokens) - self.size
        if new:
            if len(tokens) > len(self._data):
                grown = np.empty(max(2 * len(self._data), len(tokens)), dtype=np.int64)
                grown[:self.size] = self._data[:self.size]
                self._data = grown
            self._data[self.size:len(tokens)] = tokens[self.size:]
            self.size = len(tokens)
        return self._data[:self.size]


class NgramProposer(SpeculativeProposer):
    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.min_n = int(context.options["prompt_lookup_min"])
        self.max_n = int(context.options["prompt_lookup_max"])
        self._tokens: dict[str, _TokenArray] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._lookup(self._array(r), r.max_draft_tokens) for r in requests]

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._tokens.pop(request_id, None)

    def _array(self, request: DraftRequest) -> np.ndarray:
        array = self._tokens.get(request.request_id)
        if array is None:
            array = self._tokens[request.request_id] = _TokenArray()
        return array.synced(request.token_ids)

    def _lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """Candidates are the earlier positions holding the last token; each round keeps those
        whose match also reaches one token further back, until none does or ``max_n`` matched.
        The candidates stay in order, so the first one left is the earliest of the longest."""
        end = len(tokens) - 1
        candidates = np.flatnonzero(tokens[:end] == tokens[end])
        n = 1  # every candidate matches the last n tokens
        while candidates.size and n < self.max_n:
            reach = candidates[np.searchsorted(candidates, n):]  # those with a token n places back
            longer = reach[tokens[reach - n] == tokens[end - n]]
            if not longer.size:
                break
            candidates, n = longer, n + 1
        if not candidates.size or n < self.min_n:
            return []
        start = int(candidates[0]) + 1
        return tokens[start:start + k].tolist()

    def describe(self) -> dict[str, int]:
        return {"prompt_lookup_min": self.min_n, "prompt_lookup_max": self.max_n}
