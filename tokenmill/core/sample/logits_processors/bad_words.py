"""vLLM's bad_words: a word's last token is masked wherever the output already ends with the
word's other tokens (a one-token word is masked always).

Each word is tokenized as written and with a leading space, so that it is banned both at
the start of the text and after a space (vLLM's ``update_from_tokenizer``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from tokenmill.interfaces.logits_processor import AddedRow, BatchUpdate, LogitsProcessor, on_device
from tokenmill.interfaces.sampling_params import SamplingParams


def bad_word_token_ids(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """The token sequences to ban for ``words``, as vLLM derives them."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if plain:
            sequences.append(list(plain))
        # the spaced form is a ban of its own only where the space starts a different first
        # token and keeps the length (otherwise it is the same word, or one split differently)
        if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(list(spaced))
    return sequences


class BadWords(LogitsProcessor):
    def __init__(self, context) -> None:
        super().__init__(context)
        #: row -> (the token sequences to ban, the live output tokens)
        self._rows: dict[int, tuple[list[list[int]], Sequence[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def applies_to(self, params: SamplingParams) -> bool:
        return bool(params.bad_words)

    def update_state(self, update: Optional[BatchUpdate]) -> None:
        if update is not None:
            update.apply_to(self._rows, self._state)

    def _state(self, row: AddedRow) -> Optional[tuple[list[list[int]], Sequence[int]]]:
        if not row.params.bad_words:
            return None
        # a tokenizer may hold ids past the model's vocabulary (added tokens): the model never
        # writes them, so a word with one can never be completed (and indexing the logits with
        # it is a device-side assert on a GPU, which stops the engine)
        vocab = self.context.vocab_size
        sequences = [ids for ids in bad_word_token_ids(row.params.bad_words, self.context.tokenizer)
                     if all(0 <= token < vocab for token in ids)]
        return (sequences, row.output_token_ids) if sequences else None

    def is_active(self) -> bool:
        return bool(self._rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, tokens = [], []
        for i, (sequences, output) in self._rows.items():
            for ids in sequences:
                prefix = ids[:-1]
                if len(output) >= len(prefix) and list(output[len(output) - len(prefix):]) == prefix:
                    rows.append(i)
                    tokens.append(ids[-1])
        if rows:
            device = logits.device
            logits[on_device(device, rows, torch.long), on_device(device, tokens, torch.long)] = float("-inf")
        return logits
