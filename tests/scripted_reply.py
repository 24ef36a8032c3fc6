"""A logits processor that makes a reply begin with a given text, for tests of what follows a
model's words (``logits_processors: ["scripted_reply:ScriptedReply"]``; a request asks with
``extra_args={"scripted_reply": TEXT}``, ``vllm_xargs`` on the wire): while the row has
written fewer tokens than the text's, every token but the text's next one is masked."""

from __future__ import annotations

from typing import Optional

import torch

from tokenmill.interfaces.logits_processor import BatchUpdate, LogitsProcessor


class ScriptedReply(LogitsProcessor):
    def __init__(self, context) -> None:
        super().__init__(context)
        self.rows: dict[int, tuple[list[int], object]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, update: Optional[BatchUpdate]) -> None:
        if update is not None:
            update.apply_to(self.rows, self._start)

    def _start(self, row):
        text = (row.params.extra_args or {}).get("scripted_reply")
        if text is None:
            return None
        return self.context.tokenizer.encode(text, add_special_tokens=False), row.output_token_ids

    def is_active(self) -> bool:
        return bool(self.rows)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (script, output) in self.rows.items():
            if len(output) < len(script):
                forced = logits[index, script[len(output)]].clone()
                logits[index] = float("-inf")
                logits[index, script[len(output)]] = forced
        return logits
