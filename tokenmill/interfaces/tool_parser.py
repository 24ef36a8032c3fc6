"""The ToolParser contract: OpenAI ``tool_calls`` read out of a model's plain text.

Shaped after vLLM's ``ToolParser`` (``vllm/entrypoints/openai/tool_parsers``). With
``tool_choice: "auto"`` the model is not constrained: it answers in text, and a model family's
parser (``--tool-call-parser hermes``, ``llama3_json``, a plugin's) recognises the markup in which
that family writes its calls. Parsers register through the ``register_tool_parsers`` hook and are
built as ``cls(tokenizer)``; the server builds one per choice, because a parser keeps the state of
one streamed reply.

What a parser must guarantee:

* **Never raise** on any model text. Markup it cannot read (invalid JSON, a call without a name)
  is not a tool call: that text is content.
* ``extract_tool_calls(text)`` (the whole reply) has no side effects, so it may be called on the
  parser that is streaming. ``tools_called`` is true exactly when ``tool_calls`` is not empty;
  without calls, ``content`` is the text unchanged; with calls, ``content`` is the text outside
  the markup (``None`` when there is none). ``arguments`` is a JSON text (as in OpenAI's API),
  ids are ``make_tool_call_id()``'s ``"call_"`` + 24 hex digits.
* ``extract_tool_calls_streaming(previous_text, current_text, delta_text)`` is called once per
  streamed delta, in order (``current_text == previous_text + delta_text``), and returns what to
  send now, or None for nothing yet. Over a whole stream, when the text is well-formed:

  - the content deltas, concatenated, are the non-streaming ``content`` (``""`` for ``None``):
    plain text before a call streams as it comes, and no text of the tool-call markup is ever
    sent as content; text that might still become markup (``"<tool_ca"``) is held back until
    the next delta decides;
  - call ``i`` (0, 1, 2... in order) first appears in a ``DeltaToolCall`` with ``index=i``, its
    ``id`` and its complete function ``name`` (and perhaps the first ``arguments`` fragment);
    later ones for ``i`` carry only ``arguments`` fragments, whose concatenation is that call's
    non-streaming ``arguments``. At most one ``DeltaToolCall`` per index in one ``DeltaMessage``.

  A stream cannot take back what it sent: when the markup turns out to be malformed only after a
  call's first delta went out (a syntax error late in the arguments, a reply cut by
  ``max_tokens``), that call stays as sent. This is the one place where streaming and
  ``extract_tool_calls`` may disagree.
* ``finish_streaming()`` is called once, after the last delta: it returns what was held back
  (text that could have begun markup, a call whose markup never closed), or None.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional


def make_tool_call_id() -> str:
    """An OpenAI-style tool call id: ``"call_"`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One complete call: ``arguments`` is a JSON text, as in OpenAI's ``function.arguments``."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ExtractedToolCalls:
    """What a whole reply holds: its calls, and the text that is not a call."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: Optional[str]


@dataclass(frozen=True)
class DeltaToolCall:
    """A piece of call ``index``: its first carries ``id`` and ``name``, later ones ``arguments``."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None


@dataclass(frozen=True)
class DeltaMessage:
    """What one streamed delta adds to the reply: content, tool-call pieces, or both."""

    content: Optional[str] = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """Reads one model family's tool-call markup; one instance per streamed reply (choice)."""

    def __init__(self, tokenizer: Any) -> None:
        #: the model's tokenizer (vLLM's attribute name); parsers that read text alone ignore it
        self.model_tokenizer = tokenizer

    @abstractmethod
    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        """The calls and content of a whole reply."""

    @abstractmethod
    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str) -> Optional[DeltaMessage]:
        """What to send for one more delta of the reply, or None when nothing is to be sent yet."""

    def finish_streaming(self) -> Optional[DeltaMessage]:
        """After the last delta: what was held back, or None. The default holds nothing back."""
        return None
