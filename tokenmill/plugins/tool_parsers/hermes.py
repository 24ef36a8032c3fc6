"""Hermes / Qwen tool calls (vLLM's ``hermes`` parser): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks, any number of them, the text outside them being content.

As vLLM's: a block's body is read by ``json.loads``; a block that never closes runs to the end of
the reply; ``arguments`` is ``json.dumps(..., ensure_ascii=False)`` of the model's arguments.
Unlike vLLM's:

* a block that is not a valid call (invalid JSON, no ``"name"`` or no ``"arguments"``) stays in
  the content as written, and only that block: the other blocks are still calls (vLLM makes the
  whole reply content when any block fails);
* content is all the text outside the calls, not only the text before the first one; a stretch
  between (or around) calls that is only whitespace, such as the newline between two blocks, is
  dropped, and ``content`` is None when nothing else is left;
* streaming gives exactly the non-streaming content and arguments of a well-formed reply (see
  ``tokenmill.interfaces.tool_parser``), never sends markup of a call as content, and sends a
  call's name only once its ``"arguments"`` key was read, so that a block without arguments is
  still content when streamed.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from tokenmill.interfaces.tool_parser import ExtractedToolCalls, ToolCall
from tokenmill.plugins.tool_parsers.json_calls import JSON_WS, CallScanner, call_from_json
from tokenmill.plugins.tool_parsers.streaming import DeltaBuilder, StreamingToolParser, partial_tag

START = "<tool_call>"
END = "</tool_call>"
_ARGS_KEYS = ("arguments",)
# vLLM's: a block runs to the first end tag, or to the end of the text when none follows
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

# streaming modes
_CONTENT, _BLOCK_BODY, _BAD_BLOCK, _SKIP = range(4)


def parse_body(body: str) -> Optional[ToolCall]:
    """The call a block's body is (``json.loads`` of it, so whitespace around it), or None."""
    text = body.strip(JSON_WS)
    call, end = call_from_json(text, 0, _ARGS_KEYS)
    return call if call is not None and end == len(text) else None


class _Segments:
    """Content, by the rule both modes share: once a call was made, a stretch of text between
    calls (or before the first, after the last) that is only whitespace is not content."""

    def __init__(self) -> None:
        self.held = ""  # the current stretch while it is only whitespace
        self.started = False  # the current stretch has shown other text: it streams as it comes

    def add(self, text: str, out: list[str]) -> None:
        if not text:
            return
        if self.started:
            out.append(text)
            return
        self.held += text
        if self.held.strip():
            out.append(self.held)
            self.held = ""
            self.started = True

    def call_made(self) -> None:
        """A call ends the current stretch: whitespace held for it is dropped."""
        self.held = ""
        self.started = False

    def finish(self, any_call: bool, out: list[str]) -> None:
        if self.held and not any_call:  # no call: the reply is content as it is
            out.append(self.held)
        self.held = ""


class HermesToolParser(StreamingToolParser):
    """``--tool-call-parser hermes``: Hermes 2 Pro, Qwen 2.5 / 3 and other ``<tool_call>`` models."""

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._text = ""
        self._pos = 0  # text before this is dealt with
        self._mode = _CONTENT
        self._segments = _Segments()
        self._calls = 0  # calls started so far
        self._sent = 0  # calls whose first delta was returned: those cannot be taken back
        # the current block
        self._block_start = 0
        self._scanner: Optional[CallScanner] = None
        self._trailing = False  # text other than whitespace after the block's object
        self._index: Optional[int] = None  # its call's index, once its first delta went out
        self._search = 0  # where its end tag may begin, in _BAD_BLOCK and _SKIP
        self._saved_segment = ("", False)  # the content state before its call started

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        outside: list[str] = []
        last = 0
        for match in _BLOCK.finditer(model_output):
            body = match.group(1) if match.group(1) is not None else match.group(2)
            call = parse_body(body)
            if call is None:  # not a call: the block stays in the text around it
                continue
            calls.append(call)
            outside.append(model_output[last:match.start()])
            last = match.end()
        if not calls:
            return ExtractedToolCalls(tools_called=False, tool_calls=[], content=model_output)
        outside.append(model_output[last:])
        content = "".join(part for part in outside if part.strip())
        return ExtractedToolCalls(tools_called=True, tool_calls=calls, content=content or None)

    def _finished(self, out: DeltaBuilder) -> None:
        self._segments.finish(self._calls > 0, out.content)

    # -- streaming -----------------------------------------------------------------------------

    def _advance(self, out: DeltaBuilder, final: bool) -> None:
        text = self._text
        while True:
            if self._mode == _CONTENT:
                start = text.find(START, self._pos)
                if start < 0:
                    end = len(text) if final else len(text) - partial_tag(text, self._pos, START)
                    self._segments.add(text[self._pos:end], out.content)
                    self._pos = end
                    return
                self._segments.add(text[self._pos:start], out.content)
                self._block_start = start
                self._pos = start + len(START)
                self._scanner = CallScanner(_ARGS_KEYS)
                self._trailing = False
                self._index = None
                self._mode = _BLOCK_BODY
            elif self._mode == _BLOCK_BODY:
                if not self._read_body(out, final):
                    return
            else:  # the rest of a block that is not (or no longer) a call, up to its end tag
                end_tag = text.find(END, self._search)
                end = end_tag + len(END) if end_tag >= 0 else len(text)
                if self._mode == _BAD_BLOCK:
                    self._segments.add(text[self._pos:end], out.content)
                self._pos = end
                if end_tag < 0:
                    self._search = max(self._search, len(text) - len(END) + 1)
                    return
                self._mode = _CONTENT

    def _read_body(self, out: DeltaBuilder, final: bool) -> bool:
        """Read the block's body as far as the text allows; True when the block was left."""
        text = self._text
        end_tag = text.find(END, self._pos)
        closed = end_tag >= 0
        if closed:
            stop = end_tag
        else:
            stop = len(text) if final else len(text) - partial_tag(text, self._pos, END)
        self._feed(text[self._pos:stop])
        self._pos = stop
        scanner = self._scanner
        failed = scanner.error is not None or self._trailing
        if self._index is None and not failed and scanner.name is not None and scanner.args_key is not None:
            self._index = self._calls  # a call: its first delta goes out
            self._calls += 1
            self._saved_segment = (self._segments.held, self._segments.started)
            self._segments.call_made()
            out.start_call(self._index, scanner.name)
        if self._index is not None:
            out.arguments(self._index, scanner.take_args())
        if (failed or ((closed or final) and not scanner.done)) and self._index is not None \
                and self._index >= self._sent:
            self._unstart(out)
        if closed or final:
            block_end = end_tag + len(END) if closed else len(text)
            valid = not failed and scanner.done and self._index is not None
            if not valid and self._index is None:  # never a call: its text is content
                self._segments.add(text[self._block_start:block_end], out.content)
            self._pos = block_end
            self._mode = _CONTENT
            return True
        if failed:
            if self._index is None:
                self._segments.add(text[self._block_start:self._pos], out.content)
                self._mode = _BAD_BLOCK
            else:  # a call already sent cannot be taken back: the rest of its block is dropped
                self._mode = _SKIP
            self._search = self._pos
            return True
        return False

    def _unstart(self, out: DeltaBuilder) -> None:
        """The block's call, not sent yet, is not a call after all."""
        out.drop_calls(self._index)
        self._calls = self._index
        self._segments.held, self._segments.started = self._saved_segment
        self._index = None

    def _feed(self, chunk: str) -> None:
        scanner = self._scanner
        if scanner.error is None and not scanner.done:
            chunk = chunk[scanner.feed(chunk):]
        if scanner.done and chunk.strip(JSON_WS):
            self._trailing = True
