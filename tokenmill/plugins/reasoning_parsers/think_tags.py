"""Thinking between ``<think>`` and ``</think>``, as DeepSeek-R1 and Qwen3 write it (vLLM's rules).

- ``deepseek_r1``: R1's chat template opens ``<think>`` in the prompt, so a reply starts in
  the thinking: everything up to ``</think>`` is reasoning (a ``<think>`` the model writes
  again is dropped), the rest is content; a reply with no ``</think>`` is all reasoning.
- ``qwen3``: a reply that starts with ``<think>`` thinks until ``</think>``; any other reply is
  all content (thinking turned off: Qwen3's template then closes an empty block in the prompt).

Both constrain a reply after its ``</think>``, or from its start when the prompt's last marker
is a ``</think>`` (the template closed the thinking: Qwen3's ``enable_thinking=False``).
"""

from __future__ import annotations

from typing import Optional

from tokenmill.interfaces.reasoning_parser import ReasoningParser

START, END = "<think>", "</think>"


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _or_none(text: str) -> Optional[str]:
    return text or None


def _after_start(text: str, final: bool) -> tuple[Optional[str], Optional[str]]:
    """Split thinking that starts at ``text``'s beginning."""
    end = text.find(END)
    if end >= 0:
        return _or_none(text[:end]), _or_none(text[end + len(END):])
    keep = len(text) if final else len(text) - _held(text, END)
    return _or_none(text[:keep]), None


class ThinkTagsParser(ReasoningParser):
    """What both parsers share: the constraint waits for ``</think>``."""

    def constraint_starts_after(self, prompt: str) -> Optional[str]:
        return None if prompt.rfind(END) > prompt.rfind(START) else END


class DeepSeekR1ReasoningParser(ThinkTagsParser):
    def split(self, text: str, final: bool) -> tuple[Optional[str], Optional[str]]:
        if text.startswith(START):
            text = text[len(START):]
        elif not final and START.startswith(text):
            return None, None  # could still be the start marker
        return _after_start(text, final)


class Qwen3ReasoningParser(ThinkTagsParser):
    def split(self, text: str, final: bool) -> tuple[Optional[str], Optional[str]]:
        if text.startswith(START):
            return _after_start(text[len(START):], final)
        if not final and START.startswith(text):
            return None, None  # could still be the start marker
        return None, _or_none(text)
