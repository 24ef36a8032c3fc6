"""The ReasoningParser contract: a reasoning model's thinking told apart from its answer.

Shaped after vLLM's ``ReasoningParser`` (``--reasoning-parser``). Models such as DeepSeek-R1
and Qwen3 write their thinking between markers (``<think>...</think>``) before the answer;
the server returns it as ``reasoning_content`` beside ``content`` (and in stream deltas), and
tool calls are read from the answer only. Parsers register through the
``register_reasoning_parsers`` hook and are built as ``cls(tokenizer)``.

A parser is one pure function, ``split(text, final)``: the (reasoning, content) of the reply
so far. With ``final=False`` it must hold back any text it cannot place yet (the start of a
marker, ``"</thi"``), so that as the text grows each part only grows: the server streams
the differences. With ``final=True`` (the whole reply) nothing is held back. A part that is
absent is ``None``. It never raises on any text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional


class ReasoningParser(ABC):
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def split(self, text: str, final: bool) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of ``text``; see the module's rules for ``final``."""
