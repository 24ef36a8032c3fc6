"""What a request body must be before FastAPI parses it: UTF-8, JSON, an object, shallow,
and free of lone UTF-16 surrogates.

Python's ``json`` accepts ``"\\ud800"`` escapes that no UTF-8 encoder (the
tokenizer, a log line, the response) can write back out, and recurses once per
nesting level; both are refused here with a 400 that names the field, so no
route ever sees them.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

#: the deepest nesting a body may have; real requests (chat content parts, tool schemas) stay far below
MAX_JSON_DEPTH = 64

#: a JSON escape of a UTF-16 surrogate; strict UTF-8 bytes can carry a surrogate no other way
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyProblem(Exception):
    """Why a body is refused; ``param`` is the dotted field it is about, if any."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def check_json_body(raw: bytes) -> None:
    """Raise BodyProblem unless ``raw`` is a JSON object FastAPI and every route can handle."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyProblem("the request body is not valid UTF-8") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise BodyProblem(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise BodyProblem(f"the request body is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except ValueError:  # an integer of more digits than Python converts (sys.int_info.default_max_str_digits)
        raise BodyProblem("the request body has a number too long to read") from None
    if not isinstance(data, dict):
        raise BodyProblem("the request body must be a JSON object")
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if deep or surrogates:
        _walk(data, surrogates)


def _walk(data: Any, surrogates: bool) -> None:
    """Depth and lone surrogates, iteratively (a recursive walk could itself overflow)."""
    stack: list[tuple[Any, tuple, int]] = [(data, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if surrogates and not _encodable(value):
                raise BodyProblem("strings must be valid Unicode (a lone UTF-16 surrogate is not)",
                                  ".".join(map(str, path)) or None)
            continue
        if depth > MAX_JSON_DEPTH:
            raise BodyProblem(f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                              ".".join(map(str, path[:3])) or None)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and surrogates and not _encodable(key):
                raise BodyProblem("keys must be valid Unicode (a lone UTF-16 surrogate is not)",
                                  ".".join(map(str, path)) or None)
            if isinstance(item, (str, dict, list)):
                stack.append((item, (*path, key), depth + 1))


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
