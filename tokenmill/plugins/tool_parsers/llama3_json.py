"""Llama 3.x JSON tool calls (vLLM's ``llama3_json`` parser): the whole reply is a call
``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), or several separated by ``;``,
optionally after ``<|python_tag|>``.

As vLLM's: a reply that does not start with ``{`` (after whitespace and the tag) is content, and so
is every reply in which any object is not a valid call (invalid JSON, no ``"name"``, neither
``"parameters"`` nor ``"arguments"``): then the whole reply is content, unchanged. With calls,
``content`` is None. Unlike vLLM's:

* the separator may have any whitespace around it (``{...};{...}``, ``{...} ;\\n{...}``), and
  a trailing ``;`` is allowed;
* an object with both ``"parameters"`` and ``"arguments"`` is not a call (vLLM's non-streaming
  path takes ``"arguments"``, its streaming path fails);
* arguments keep non-ASCII characters as they are (``ensure_ascii=False``), streamed or not, and
  streaming gives exactly the non-streaming arguments (see ``tokenmill.interfaces.tool_parser``).
"""

from __future__ import annotations

from typing import Any, Optional

from tokenmill.interfaces.tool_parser import ExtractedToolCalls, ToolCall
from tokenmill.plugins.tool_parsers.json_calls import CallScanner, call_from_json
from tokenmill.plugins.tool_parsers.streaming import DeltaBuilder, StreamingToolParser

PYTHON_TAG = "<|python_tag|>"
_ARGS_KEYS = ("parameters", "arguments")

# streaming modes
_START, _OBJECT, _BETWEEN, _CONTENT, _SKIP = range(5)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _calls_start(text: str) -> Optional[int]:
    """Where the first ``{`` of the calls is, or None when the reply cannot be calls."""
    i = _skip_space(text, 0)
    if text.startswith(PYTHON_TAG, i):
        i = _skip_space(text, i + len(PYTHON_TAG))
    return i if text.startswith("{", i) else None


class Llama3JsonToolParser(StreamingToolParser):
    """``--tool-call-parser llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON tool calling."""

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._text = ""
        self._pos = 0
        self._mode = _START
        self._calls = 0
        self._sent = 0  # calls whose first delta was returned: those cannot be taken back
        self._scanner: Optional[CallScanner] = None
        self._index: Optional[int] = None  # the current object's call, once its first delta went out
        self._after_separator = False

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        as_content = ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
        i = _calls_start(model_output)
        if i is None:
            return as_content
        calls: list[ToolCall] = []
        while True:
            call, i = call_from_json(model_output, i, _ARGS_KEYS)
            if call is None:
                return as_content
            calls.append(call)
            i = _skip_space(model_output, i)
            if i == len(model_output):
                break
            if model_output[i] != ";":
                return as_content
            i = _skip_space(model_output, i + 1)
            if i == len(model_output):
                break
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=None)

    # -- streaming -----------------------------------------------------------------------------

    def _advance(self, out: DeltaBuilder, final: bool) -> None:
        text = self._text
        while True:
            mode = self._mode
            if mode == _START:
                start = _calls_start(text)
                if start is not None:
                    self._begin_object(start)
                    continue
                rest = text.lstrip()
                undecided = not rest or PYTHON_TAG.startswith(rest) or (
                    rest.startswith(PYTHON_TAG) and not rest[len(PYTHON_TAG):].strip())
                if undecided and not final:
                    return
                self._to_content()
            elif mode == _CONTENT:
                out.content.append(text[self._pos:])
                self._pos = len(text)
                return
            elif mode == _SKIP:
                self._pos = len(text)
                return
            elif mode == _OBJECT:
                scanner = self._scanner
                self._pos += scanner.feed(text[self._pos:])
                if self._index is None and scanner.error is None and scanner.name is not None \
                        and scanner.args_key is not None:
                    self._index = self._calls
                    self._calls += 1
                    out.start_call(self._index, scanner.name)
                if self._index is not None:
                    out.arguments(self._index, scanner.take_args())
                if scanner.error is not None or (final and not scanner.done) \
                        or (scanner.done and self._index is None):
                    self._fail(out)
                    continue
                if not scanner.done:
                    return
                self._mode = _BETWEEN
                self._after_separator = False
            else:  # _BETWEEN: whitespace, then ';' and the next object, or the end
                i = _skip_space(text, self._pos)
                self._pos = i
                if i == len(text):
                    return
                if text[i] == ";" and not self._after_separator:
                    self._after_separator = True
                    self._pos = i + 1
                elif self._after_separator:
                    self._begin_object(i)
                else:
                    self._fail(out)

    def _begin_object(self, start: int) -> None:
        self._pos = start
        self._scanner = CallScanner(_ARGS_KEYS)
        self._index = None
        self._mode = _OBJECT

    def _fail(self, out: DeltaBuilder) -> None:
        """The reply is not calls: all of it is content, unless a call was sent already (calls
        found in this same delta are not sent yet: they are dropped)."""
        if self._sent:
            self._mode = _SKIP
        else:
            out.drop_calls(0)
            self._calls = 0
            self._to_content()

    def _to_content(self) -> None:
        self._pos = 0  # nothing was sent: _CONTENT sends the whole text
        self._mode = _CONTENT
