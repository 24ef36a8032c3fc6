"""Streaming a parser's reply: the deltas one step yields (``DeltaBuilder``), text held back
while it may still become a tag (``partial_tag``), and the base class of parsers that scan
their stream as text (``StreamingToolParser``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Optional

from tokenmill.interfaces.tool_parser import DeltaMessage, DeltaToolCall, ToolParser, make_tool_call_id


class DeltaBuilder:
    """Collects what one streamed delta yields, as one DeltaMessage (one DeltaToolCall per call)."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self._calls: dict[int, list[Any]] = {}

    def start_call(self, index: int, name: str) -> None:
        self._calls[index] = [make_tool_call_id(), name, []]

    def arguments(self, index: int, text: str) -> None:
        if text:
            self._calls.setdefault(index, [None, None, []])[2].append(text)

    def drop_calls(self, first: int) -> None:
        """Forget calls ``first`` and after: they turned out not to be calls before being sent."""
        for index in [index for index in self._calls if index >= first]:
            del self._calls[index]

    def build(self) -> Optional[DeltaMessage]:
        content = "".join(self.content) or None
        calls = [DeltaToolCall(index, call_id, name, "".join(args) or None)
                 for index, (call_id, name, args) in self._calls.items()]
        if content is None and not calls:
            return None
        return DeltaMessage(content=content, tool_calls=calls)


def partial_tag(text: str, start: int, tag: str) -> int:
    """The length of the longest end of ``text[start:]`` that ``tag`` begins with (0 if none):
    text that must wait for the next delta to tell whether it is the tag."""
    for length in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class StreamingToolParser(ToolParser):
    """A parser that reads its stream as text: each delta is appended, then ``_advance`` scans
    what has arrived and writes the deltas to send. Subclasses keep ``_text``, ``_calls``
    (calls started) and ``_sent`` (calls whose first delta was returned: never taken back)."""

    _text: str
    _calls: int
    _sent: int

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> Optional[DeltaMessage]:
        self._text += delta_text
        return self._step(final=False)

    def finish_streaming(self) -> Optional[DeltaMessage]:
        return self._step(final=True)

    def _step(self, final: bool) -> Optional[DeltaMessage]:
        out = DeltaBuilder()
        self._advance(out, final)
        if final:
            self._finished(out)
        self._sent = self._calls
        return out.build()

    @abstractmethod
    def _advance(self, out: DeltaBuilder, final: bool) -> None:
        """Scan ``_text`` from where the last call stopped; ``final``: nothing more will come."""

    def _finished(self, out: DeltaBuilder) -> None:
        """After the final scan: release what the parser still holds."""

