"""Tools on the chat endpoint: ``tool_choice`` becomes a constraint (or a parser), and the
reply becomes OpenAI's ``tool_calls``, streamed or not.

* a named function: the reply is constrained to that function's arguments schema, and is
  those arguments;
* ``"required"``: the reply is constrained to a JSON array of ``{"name", "parameters"}``
  calls of the given tools (at most one with ``parallel_tool_calls: false``), vLLM's form;
* ``"auto"``: unconstrained; the server's ``--tool-call-parser`` reads calls from the text
  (it needs ``--enable-auto-tool-choice``, as in vLLM);
* ``"none"``: the tools are not offered to the template.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from tokenmill.interfaces.structured_output import StructuredOutputsParams
from tokenmill.interfaces.tool_parser import ToolParser, make_tool_call_id
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatCompletionRequest


def _tool_call(name: str, arguments: str, call_id: Optional[str] = None) -> dict[str, Any]:
    return {"id": call_id or make_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolReply:
    """How one choice's text becomes the message (and stream deltas) of one tool mode."""

    def __init__(self, mode: str, function: Optional[str] = None, parser: Optional[ToolParser] = None,
                 single_call: bool = False) -> None:
        self.mode = mode
        #: parallel_tool_calls false: a parsed reply gives its first call only
        self.single_call = single_call
        self.function = function
        self.parser = parser
        self._call_id = make_tool_call_id()
        self._opened = False

    def message(self, text: str, finish_reason: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
        """(the assistant message, the finish reason) for a finished choice."""
        if self.mode == "named":
            return {"role": "assistant", "content": None,
                    "tool_calls": [_tool_call(self.function, text, self._call_id)]}, finish_reason
        if self.mode == "required":
            calls = _required_calls(text)
            if calls is None:  # cut short (max_tokens): the text as it is
                return {"role": "assistant", "content": text}, finish_reason
            return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
        if self.mode == "auto":
            extracted = self.parser.extract_tool_calls(text)
            if extracted.tools_called:
                calls = extracted.tool_calls[:1] if self.single_call else extracted.tool_calls
                return {"role": "assistant", "content": extracted.content or None, "tool_calls": [
                    _tool_call(c.name, c.arguments, c.id) for c in calls]}, "tool_calls"
        return {"role": "assistant", "content": text}, finish_reason

    def delta(self, current: str, sent: int, delta: str,
              finish_reason: Optional[str]) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        """(the delta to send, or None for nothing yet; the finish reason to report), given the
        text so far, how much of it was handed over before, and the new part."""
        if self.mode == "named":
            if not delta and self._opened:
                return ({} if finish_reason else None), finish_reason
            call: dict[str, Any] = {"index": 0, "function": {"arguments": delta}}
            if not self._opened:
                self._opened = True
                call.update({"id": self._call_id, "type": "function"})
                call["function"]["name"] = self.function
            return {"tool_calls": [call]}, finish_reason
        if self.mode == "required":
            if finish_reason is None:
                return None, None  # the array is read whole, when it is complete
            message, reason = self.message(current, finish_reason)
            if "tool_calls" not in message:
                return {"content": current}, reason
            return {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}, reason
        if self.mode == "auto":
            parts = [self.parser.extract_tool_calls_streaming(current[:sent], current, delta)]
            reason = finish_reason
            if finish_reason is not None:
                parts.append(self.parser.finish_streaming())  # what the parser held back
                if self.parser.extract_tool_calls(current).tools_called:
                    reason = "tool_calls"
            parts = [part for part in parts if part is not None]
            if not parts:
                return ({} if finish_reason else None), reason
            out: dict[str, Any] = {}
            content = "".join(part.content or "" for part in parts)
            if content:
                out["content"] = content
            calls = [_delta_call(c) for part in parts for c in part.tool_calls
                     if not (self.single_call and c.index > 0)]
            if calls:
                out["tool_calls"] = calls
            return out, reason
        return ({"content": delta} if delta else {}), finish_reason


def _delta_call(call: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"index": call.index, "function": {}}
    if call.id is not None:
        out["id"], out["type"] = call.id, "function"
    if call.name is not None:
        out["function"]["name"] = call.name
    if call.arguments is not None:
        out["function"]["arguments"] = call.arguments
    return out


def _required_calls(text: str) -> Optional[list[dict[str, Any]]]:
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    return [_tool_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]


def plan_tools(body: ChatCompletionRequest, make_parser: Optional[Callable[[], ToolParser]],
               ) -> tuple[Optional[StructuredOutputsParams], Optional[list[dict]], Callable[[], ToolReply]]:
    """(the constraint the tool choice implies, the tools to give the template, a ToolReply
    factory, one per choice)."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    template_tools = [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]
    if choice == "none":
        return None, None, lambda: ToolReply("none")
    constraining = [field for field in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                        "guided_choice", "guided_grammar")
                    if getattr(body, field) is not None and not (field == "response_format"
                                                                  and body.response_format.type == "text")]
    if choice != "auto" and constraining:
        raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'by name'} constrains the "
                            f"reply, and so does {constraining[0]}: give one", "tool_choice")
    if choice == "auto":
        if make_parser is None:
            raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                                "--tool-call-parser", "tool_choice")
        return None, template_tools, lambda: ToolReply("auto", parser=make_parser(),
                                                       single_call=not body.parallel_tool_calls)
    if choice == "required":
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [{
            "type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                             "parameters": t.function.parameters or {"type": "object"}},
            "required": ["name", "parameters"]} for t in tools]}}
        if not body.parallel_tool_calls:
            schema["maxItems"] = 1
        return (StructuredOutputsParams(json=schema, param="tool_choice"), template_tools,
                lambda: ToolReply("required"))
    name = choice.function.name
    function = next((t.function for t in tools if t.function.name == name), None)
    if function is None:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return (StructuredOutputsParams(json=function.parameters or {"type": "object"}, param="tool_choice"),
            template_tools, lambda: ToolReply("named", function=name))
