"""Prompt lookup (vLLM's ``ngram`` method): if the last n tokens occurred before, guess that
what followed them then follows them again.

Free to run and good wherever a reply repeats its context: code edits, quoting, extraction,
summaries that copy phrases. The longest n in [prompt_lookup_min, prompt_lookup_max] with a
match wins, and among its matches the earliest (vLLM's choice: it has the most text after it,
so a repeating pattern yields full-length drafts).

Its host work is per step and per request, and most steps find nothing, so a lookup must
cost little whatever the context's length and however cold the caches are after a forward
pass. A search of the context does not: over numpy arrays, six calls that took 2 us in a
loop took 27 us between forward passes, and grew with the context. So each request keeps an
index, one dict per n, from each n-token pattern to the position where it first ended,
extended by each step's new tokens: a step is at most ``max_n`` dict insertions (7 us between
forward passes). The price is memory, about 100 bytes per token and n (a KV cache holds tens
of kB per token), and a prompt indexed once, when its request starts decoding: 0.2 us per
token and n (80 ms for a 128k-token prompt at n = 2..4, where one search of it took 54 us).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from tokenmill.interfaces.speculative import DraftRequest, ProposerContext, SpeculativeProposer

#: new tokens from which a request's patterns are indexed as arrays rather than one by one
_BULK = 64


class _NgramIndex:
    """A request's patterns: ``first[n - min_n]`` maps each n-token pattern, packed into one
    int, to the position of its first occurrence's last token."""

    __slots__ = ("first", "size")

    def __init__(self, sizes: int) -> None:
        self.first: list[dict[int, int]] = [{} for _ in range(sizes)]
        #: tokens indexed so far (a request's tokens only grow)
        self.size = 0


class NgramProposer(SpeculativeProposer):
    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)
        self.min_n = int(context.options["prompt_lookup_min"])
        self.max_n = int(context.options["prompt_lookup_max"])
        #: bits per token in a packed pattern: no two patterns of one length share a key (the
        #: engine keeps prompts' ids below vocab_size)
        self._bits = max(1, (context.vocab_size - 1).bit_length())
        #: the longest pattern's key fits an int64, so a prompt's keys can be computed as arrays
        self._packs_in_int64 = self._bits * self.max_n <= 63
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._draft(r.request_id, r.token_ids, r.max_draft_tokens) for r in requests]

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._indexes.pop(request_id, None)

    def _draft(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Index the patterns ending at the request's new tokens; the last position's lookup
        is its own insertion (a pattern seen before keeps the position it had). A longer match
        holds every shorter one, so the longest n found before is the last one found."""
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _NgramIndex(self.max_n - self.min_n + 1)
        if not tokens:
            return []
        last = len(tokens) - 1
        if last - index.size >= _BULK and self._packs_in_int64:
            self._index_at_once(index, tokens, last)
        bits, min_n, max_n, first = self._bits, self.min_n, self.max_n, index.first
        for end in range(min(index.size, last), last + 1):
            found, key = -1, 0
            for n in range(1, min(max_n, end + 1) + 1):
                key |= tokens[end - n + 1] << bits * (n - 1)  # the pattern's last token in the lowest bits
                if n >= min_n:
                    earliest = first[n - min_n].setdefault(key, end)
                    if earliest < end:
                        found = earliest
        index.size = len(tokens)
        return [] if found < 0 else list(tokens[found + 1:found + 1 + k])

    def _index_at_once(self, index: _NgramIndex, tokens: Sequence[int], stop: int) -> None:
        """The patterns ending at ``index.size`` .. ``stop - 1`` (a prompt), the same keys as
        the loop's computed as arrays: 0.2 us per token and n against the loop's 0.5."""
        array = np.asarray(tokens[:stop], dtype=np.int64)
        ends = np.arange(index.size, stop)
        keys = array[index.size:stop].copy()
        for n in range(1, self.max_n + 1):
            if n > 1:
                keep = ends >= n - 1
                ends = ends[keep]
                keys = keys[keep] | array[ends - n + 1] << self._bits * (n - 1)
            if n >= self.min_n:
                # the earliest end of each pattern wins: the dict keeps the last value it is given
                patterns = dict(zip(keys[::-1].tolist(), ends[::-1].tolist()))
                patterns.update(index.first[n - self.min_n])  # patterns met before end earlier still
                index.first[n - self.min_n] = patterns
        index.size = stop

    def describe(self) -> dict[str, int]:
        return {"prompt_lookup_min": self.min_n, "prompt_lookup_max": self.max_n}
