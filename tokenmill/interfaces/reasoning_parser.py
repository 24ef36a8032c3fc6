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

A constrained reply (structured outputs, a required or named tool call) is constrained in its
answer only, as in vLLM: ``constraint_starts_after(prompt)`` names the text that ends the
thinking, which the constraint waits for (the engine matches it as the tokenizer encodes it:
reasoning models write their markers as single added tokens), or None when the prompt has
already closed the thinking and the reply is all answer. A parser that does not define it
serves no constrained replies: the server refuses them with a 400.
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

    def constraint_starts_after(self, prompt: str) -> Optional[str]:
        """The text after which a constrained reply's constraint holds (see the module)."""
        raise NotImplementedError(f"the {type(self).__name__} reasoning parser cannot say where a reply's "
                                  "answer starts, so it serves no constrained replies")
