"""Incremental detokenization and stop strings, one per generated sequence.

Uses tokenizers' ``DecodeStream``, which buffers tokens until they form valid
UTF-8, so multi-byte characters split across tokens never show as U+FFFD.
While a sequence runs, the last ``max(len(stop)) - 1`` characters are held
back from the visible text, so streamed text never shows the start of a stop
string that the final text will cut off: streamed == non-streamed.
"""

from __future__ import annotations

from typing import Any, Optional

from tokenizers.decoders import DecodeStream

from tokenmill.interfaces.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizers.Tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max(map(len, self._stop), default=0)
        self._holdback = 0 if self._include_stop or not self._stop else self._longest_stop - 1
        self.text = ""

    def update(self, token_ids: list[int]) -> Optional[str]:
        """Add tokens; return the stop string they completed, if any (text is cut there)."""
        previous = len(self.text)
        for token_id in token_ids:
            chunk = self._stream.step(self._backend, token_id)
            if chunk:
                self.text += chunk
        if not self._stop or len(self.text) == previous:
            return None
        search_from = max(0, previous - self._longest_stop + 1)
        best: Optional[tuple[int, str]] = None
        for stop in self._stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop) if self._include_stop else index]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now (all of it once the sequence finished)."""
        if finished or not self._holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self._holdback)]
