"""Reading a ``{"name": ..., "arguments": ...}`` tool call: whole (``call_from_json``) or a
character at a time as it streams in (``CallScanner``).

Both paths give a call's ``arguments`` as ``json.dumps(value, ensure_ascii=False)``: the
scanner re-serialises the arguments token by token in that same form, so the fragments it
streams concatenate to exactly the text ``extract_tool_calls`` gives (one exception: an object
with a repeated key, which ``json.loads`` collapses; the streamed text still parses to the same
value).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from tokenmill.interfaces.tool_parser import ToolCall, make_tool_call_id

#: whitespace as JSON (and Python's json module) defines it
JSON_WS = " \t\n\r"

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
#: the constants Python's json module reads (it accepts NaN and the infinities)
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_HEX = frozenset("0123456789abcdefABCDEF")
_UNESCAPE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_ESCAPE = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    """One decoded character as ``json.dumps(..., ensure_ascii=False)`` writes it in a string."""
    if ch in _ESCAPE:
        return _ESCAPE[ch]
    if ch < " ":
        return f"\\u{ord(ch):04x}"
    return ch


def call_from_json(text: str, start: int, args_keys: tuple[str, ...]) -> tuple[Optional[ToolCall], int]:
    """(the call the JSON value at ``text[start]`` is, or None; the index after that value).

    A call is an object with exactly one ``"name"`` (a non-empty string) and exactly one of
    ``args_keys``; the index is -1 when the text there is not JSON at all.
    """
    tops: list[list[tuple[str, Any]]] = []

    def keep_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        tops.append(pairs)  # the outermost object is the last one completed
        return dict(pairs)

    try:
        value, end = json.JSONDecoder(object_pairs_hook=keep_pairs).raw_decode(text, start)
    except (ValueError, RecursionError):
        return None, -1
    if not isinstance(value, dict):
        return None, end
    keys = [key for key, _ in tops[-1]]
    found = [key for key in keys if key in args_keys]
    name = value.get("name")
    if keys.count("name") != 1 or len(found) != 1 or not isinstance(name, str) or not name:
        return None, end
    try:
        arguments = json.dumps(value[found[0]], ensure_ascii=False)
    except (ValueError, RecursionError):
        return None, end
    return ToolCall(make_tool_call_id(), name, arguments), end


# what the scanner expects next
_VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER_VALUE, _DONE = range(7)


class CallScanner:
    """Reads one JSON object ``{"name": ..., <args key>: ...}`` incrementally and strictly (what
    ``json.loads`` accepts, no more), a character at a time, without recursion.

    ``name`` is set once the name string is complete; ``args_key`` once the key of the
    arguments is read; ``take_args()`` returns the arguments' canonical text produced since the
    last call. ``error`` is set (and reading stops) at the first character that makes the object
    invalid JSON or not a call: a top level that is not an object, a name that is not a non-empty
    string, a repeated ``"name"`` or arguments key. ``done`` is set when the object closed;
    whether the object had both a name and arguments is for the caller to check.
    """

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.error: Optional[str] = None
        self.done = False
        self.name: Optional[str] = None
        self.args_key: Optional[str] = None
        self._args: list[str] = []
        self._stack: list[str] = []  # "o" / "a" per open container
        self._expect = _VALUE
        self._token: Optional[str] = None  # "str", "num", "lit" while one is being read
        self._chars: list[str] = []  # the number or literal so far
        self._escape: Optional[str] = None  # "" after a backslash, "u..." inside \\uXXXX
        self._high: Optional[int] = None  # a high surrogate waiting for its low half
        self._is_key = False
        self._decoded: Optional[list[str]] = None  # the decoded top-level key or name
        self._key: Optional[str] = None  # the current top-level key
        self._route: Optional[str] = None  # whose value is being read: "name", "args", "other"
        self._seen_name = False

    # -- public --------------------------------------------------------------------------------

    def feed(self, text: str) -> int:
        """Read ``text``; returns how many characters were used (fewer than all once ``done``)."""
        for i, ch in enumerate(text):
            if self.error is not None or self.done:
                return i
            while not self._step(ch):  # a number ends at the character after it: read that again
                if self.error is not None:
                    return i
        return len(text)

    def take_args(self) -> str:
        out = "".join(self._args)
        self._args.clear()
        return out

    # -- internals -----------------------------------------------------------------------------

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why

    def _emit(self, text: str) -> None:
        if self._route == "args":
            self._args.append(text)

    def _step(self, ch: str) -> bool:
        token = self._token
        if token == "str":
            self._string_char(ch)
            return True
        if token == "num":
            if ch in _NUMBER_CHARS:
                self._chars.append(ch)
                return True
            if ch == "I" and self._chars == ["-"]:  # -Infinity
                self._token = "lit"
                self._chars.append(ch)
                return True
            self._end_number()
            return False
        if token == "lit":
            self._chars.append(ch)
            word = "".join(self._chars)
            if word in _LITERALS:
                self._token = None
                self._emit(word)
                self._value_done()
            elif not any(lit.startswith(word) for lit in _LITERALS):
                self._fail(f"invalid literal {word!r}")
            return True
        if ch in JSON_WS:
            return True
        expect = self._expect
        if expect == _VALUE:
            self._begin_value(ch)
        elif expect == _VALUE_OR_CLOSE:
            if ch == "]":
                self._close(ch)
            else:
                self._begin_value(ch)
        elif expect in (_KEY_OR_CLOSE, _KEY):
            if ch == "}" and expect == _KEY_OR_CLOSE:
                self._close(ch)
            elif ch == '"':
                self._begin_string(key=True)
            else:
                self._fail("expected a key")
        elif expect == _COLON:
            if ch != ":":
                self._fail("expected ':'")
            else:
                self._emit(": ")
                self._expect = _VALUE
        elif expect == _AFTER_VALUE:
            container = self._stack[-1]
            if ch == ",":
                self._emit(", ")
                self._expect = _KEY if container == "o" else _VALUE
            elif ch == ("}" if container == "o" else "]"):
                self._close(ch)
            else:
                self._fail("expected ',' or the end of a container")
        else:  # _DONE: the caller reads what follows the object
            self._fail("text after the object")
        return True

    def _begin_value(self, ch: str) -> None:
        depth = len(self._stack)
        if depth == 0:
            if ch != "{":
                self._fail("not a JSON object")
                return
            self._stack.append("o")
            self._expect = _KEY_OR_CLOSE
            return
        if depth == 1:  # the value of a top-level key
            key = self._key
            if key == "name":
                if ch != '"':
                    self._fail("the name is not a string")
                    return
                self._route = "name"
            else:
                self._route = "args" if key in self.args_keys else "other"
        if ch == "{":
            self._emit("{")
            self._stack.append("o")
            self._expect = _KEY_OR_CLOSE
        elif ch == "[":
            self._emit("[")
            self._stack.append("a")
            self._expect = _VALUE_OR_CLOSE
        elif ch == '"':
            self._begin_string(key=False)
        elif ch == "-" or "0" <= ch <= "9":
            self._token = "num"
            self._chars = [ch]
        elif ch in "tfnNI":
            self._token = "lit"
            self._chars = [ch]
        else:
            self._fail(f"unexpected {ch!r}")

    def _close(self, ch: str) -> None:
        self._emit(ch)
        self._stack.pop()
        if self._stack:
            self._value_done()
        else:
            self.done = True
            self._expect = _DONE

    def _value_done(self) -> None:
        if len(self._stack) == 1:  # a top-level key's value is complete
            self._route = None
        self._expect = _AFTER_VALUE

    def _end_number(self) -> None:
        text = "".join(self._chars)
        self._token = None
        if not _NUMBER.fullmatch(text):
            self._fail(f"invalid number {text!r}")
            return
        try:  # the form json.dumps gives the value json.loads reads (1.50 -> 1.5, 1E2 -> 100.0)
            canonical = json.dumps(json.loads(text))
        except (ValueError, OverflowError):  # too many digits for an int
            self._fail(f"invalid number {text!r}")
            return
        self._emit(canonical)
        self._value_done()

    def _begin_string(self, key: bool) -> None:
        self._token = "str"
        self._is_key = key
        top = len(self._stack) == 1
        self._decoded = [] if top and (key or self._route == "name") else None
        self._emit('"')

    def _out(self, ch: str) -> None:
        if self._decoded is not None:
            self._decoded.append(ch)
        self._emit(_escape(ch))

    def _flush_high(self) -> None:
        if self._high is not None:
            high, self._high = self._high, None
            self._out(chr(high))

    def _string_char(self, ch: str) -> None:
        escape = self._escape
        if escape is None:
            if ch == '"':
                self._flush_high()
                self._end_string()
            elif ch == "\\":
                self._escape = ""
            elif ch < " ":
                self._fail("control character in a string")
            else:
                self._flush_high()
                self._out(ch)
        elif escape == "":
            if ch == "u":
                self._escape = "u"
                return
            if ch not in _UNESCAPE:
                self._fail(f"invalid escape \\{ch}")
                return
            self._escape = None
            self._flush_high()
            self._out(_UNESCAPE[ch])
        else:
            if ch not in _HEX:
                self._fail("invalid \\uXXXX escape")
                return
            escape += ch
            if len(escape) < 5:
                self._escape = escape
                return
            self._escape = None
            code = int(escape[1:], 16)
            # as json.loads: a high surrogate escape right before a low one is one character
            if self._high is not None and 0xDC00 <= code <= 0xDFFF:
                high, self._high = self._high, None
                self._out(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
                return
            self._flush_high()
            if 0xD800 <= code <= 0xDBFF:
                self._high = code
            else:
                self._out(chr(code))

    def _end_string(self) -> None:
        self._token = None
        self._emit('"')
        decoded = "".join(self._decoded) if self._decoded is not None else None
        self._decoded = None
        if self._is_key:
            if decoded is not None:  # a top-level key
                self._key = decoded
                if decoded == "name":
                    if self._seen_name:
                        self._fail('repeated "name"')
                    self._seen_name = True
                elif decoded in self.args_keys:
                    if self.args_key is not None:
                        self._fail(f"repeated arguments ({self.args_key!r} and {decoded!r})")
                    self.args_key = decoded
            self._expect = _COLON
            return
        if decoded is not None:  # the name
            if not decoded:
                self._fail("empty name")
                return
            self.name = decoded
        self._value_done()
