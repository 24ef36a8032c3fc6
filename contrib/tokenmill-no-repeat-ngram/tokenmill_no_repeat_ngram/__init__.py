"""``no_repeat_ngram``: Hugging Face's ``no_repeat_ngram_size`` as a tokenmill logits processor.

A request with ``extra_args={"no_repeat_ngram_size": N}`` never generates an N-gram that
already occurs in its prompt plus output: before each step, every token that would
complete an N-gram seen before (its first N - 1 tokens equal to the sequence's last
N - 1) is banned (-inf). That is transformers' ``NoRepeatNGramLogitsProcessor``, which
counts the prompt of a decoder-only model too; with N = 1 every token seen is banned.

An example of a third-party processor: it uses only ``tokenmill.interfaces`` and is
tested with tokenmill's conformance kit. Per row it keeps an index ``{first N - 1 tokens:
{last tokens}}`` of the N-grams of the sequence, extended at each step by the tokens the
runner appended to the row's live output list since the last one, so a long request
costs O(new tokens) per step, not O(length).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.logits_processor import AddedRow, BatchUpdate, LogitsProcessor, on_device
from tokenmill.interfaces.sampling_params import SamplingParams

#: the request argument (``SamplingParams.extra_args``; ``vllm_xargs`` on the wire)
ARG = "no_repeat_ngram_size"


#: the index keeps n - 1 tokens per position of the sequence: a bound keeps one request's
#: memory, and the engine thread's time, in proportion to its length
MAX_NGRAM_SIZE = 64


def ngram_size(params: SamplingParams) -> Optional[int]:
    """The request's size, None when it did not ask; ValueError when it is not one."""
    size = (params.extra_args or {}).get(ARG)
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_NGRAM_SIZE:
        raise ValueError(f"{ARG} must be an integer in [1, {MAX_NGRAM_SIZE}], got {size!r}")
    return size


class _Row:
    """One request's n-gram index over prompt + output."""

    __slots__ = ("size", "prompt", "output", "ngrams", "indexed")

    def __init__(self, size: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.size = size
        self.prompt = tuple(prompt)
        #: the runner's live list: it grows by one token after every step
        self.output = output
        self.ngrams: dict[tuple[int, ...], set[int]] = {}
        #: how many n-grams (by start position) are in ``ngrams``
        self.indexed = 0

    def banned(self) -> set[int]:
        """The tokens that would complete an n-gram already in the sequence."""
        n = self.size
        length = len(self.prompt) + len(self.output)
        if length < n:
            return set()
        count = length - n + 1  # the n-grams of the sequence, by start position
        if count < self.indexed:  # the output shrank (never in tokenmill today): start over
            self.ngrams, self.indexed = {}, 0
        if count > self.indexed:
            first = self.indexed
            tail = self._tokens_from(first)
            for start in range(count - first):
                ngram = tail[start:start + n]
                self.ngrams.setdefault(tuple(ngram[:-1]), set()).add(ngram[-1])
            self.indexed = count
        # the sequence's last n - 1 tokens (none when n == 1: every token seen is banned)
        return self.ngrams.get(tuple(self._tokens_from(length - n + 1)), set())

    def _tokens_from(self, start: int) -> list[int]:
        """prompt + output from position ``start`` on."""
        return list(self.prompt[start:]) + list(self.output[max(0, start - len(self.prompt)):])


class NoRepeatNGram(LogitsProcessor):
    """Bans the tokens that would repeat an n-gram of the request's prompt + output."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._rows: dict[int, _Row] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        ngram_size(params)

    def is_argmax_invariant(self) -> bool:
        return False  # a banned token may be the argmax

    def applies_to(self, params: SamplingParams) -> bool:
        return ARG in (params.extra_args or {})  # so that plain batches cost this processor nothing

    def update_state(self, update: Optional[BatchUpdate]) -> None:
        if update is not None:
            update.apply_to(self._rows, self._row)

    @staticmethod
    def _row(row: AddedRow) -> Optional[_Row]:
        size = ngram_size(row.params)
        return None if size is None else _Row(size, row.prompt_token_ids, row.output_token_ids)

    def is_active(self) -> bool:
        return bool(self._rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[1]
        rows: list[int] = []
        tokens: list[int] = []
        for index, row in self._rows.items():
            for token in row.banned():
                if 0 <= token < vocab:  # an id the model cannot produce needs no ban (as in HF)
                    rows.append(index)
                    tokens.append(token)
        if rows:
            device = logits.device
            logits[on_device(device, rows, torch.long), on_device(device, tokens, torch.long)] = float("-inf")
        return logits


@hookimpl
def register_logits_processors(register):
    register("no_repeat_ngram", NoRepeatNGram)
