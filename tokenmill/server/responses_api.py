"""OpenAI's Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``), as vLLM serves it, over the chat completions path.

A request becomes a chat completion: ``instructions`` a system message, ``input`` (a string,
or messages and earlier ``function_call`` / ``function_call_output`` items) the
conversation, ``tools`` (Responses' flat function tools) the chat tools, ``text.format`` the
response format, ``reasoning.effort`` the template's ``reasoning_effort``. The chat reply
becomes the response's ``output`` items: a ``reasoning`` item (with ``--reasoning-parser``),
the ``message`` with its ``output_text``, and one ``function_call`` item per tool call.
Streamed, the chat stream's deltas become Responses' semantic events (``response.created``
... ``response.output_text.delta`` ... ``response.completed``, whose response's ``status``
says ``incomplete`` where ``max_output_tokens`` cut it), each with its ``sequence_number``. Responses are kept (``store``, the default) in a bounded in-memory
store for ``GET``; they all run to completion, so ``cancel`` answers that a synchronous
response cannot be cancelled, as OpenAI does. ``previous_response_id`` and ``background``
are refused by name.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Literal, Optional, Union

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.server.chat import create_chat_completion
from tokenmill.server.errors import APIError
from tokenmill.server.generation import SSE_DONE, ServingContext, sse
from tokenmill.server.protocol import ChatCompletionRequest, OpenAIModel

#: responses kept for GET /v1/responses/{id}, the oldest dropped first
MAX_STORED = 1024


class ResponseInputText(OpenAIModel):
    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class ResponseInputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[ResponseInputText]]
    id: Optional[str] = None
    status: Optional[str] = None


class ResponseFunctionCall(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: Optional[str] = None
    status: Optional[str] = None


class ResponseFunctionCallOutput(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: Optional[str] = None
    status: Optional[str] = None


class ResponseFunctionTool(OpenAIModel):
    type: Literal["function"] = "function"
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponseNamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    name: str


class ResponseTextFormat(OpenAIModel):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class ResponseText(OpenAIModel):
    format: ResponseTextFormat = ResponseTextFormat()


class ResponseReasoning(OpenAIModel):
    effort: Optional[Literal["low", "medium", "high"]] = None
    summary: Optional[str] = None


InputItem = Union[ResponseInputMessage, ResponseFunctionCall, ResponseFunctionCallOutput]


class ResponsesRequest(OpenAIModel):
    """OpenAI's ``responses.create`` body (what this server implements of it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: Optional[str] = None
    input: Union[str, list[InputItem]] = Field(description="A user message, or the conversation's items.")
    instructions: Optional[str] = Field(None, description="A system message before the input.")
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    tools: Optional[list[ResponseFunctionTool]] = Field(None, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], ResponseNamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    text: Optional[ResponseText] = None
    reasoning: Optional[ResponseReasoning] = None
    stream: bool = False
    store: bool = True
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["disabled", "auto"]] = None
    include: Optional[list[str]] = None
    previous_response_id: Optional[str] = Field(None, description="Refused: conversation state is the client's.")
    background: Optional[bool] = Field(None, description="Refused: responses run while the request waits.")


class ResponseObject(BaseModel):
    """OpenAI's ``Response`` (its other fields as the request gave them)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    output: list[dict[str, Any]] = Field(description="reasoning, message and function_call items, in order.")
    usage: Optional[dict[str, Any]] = None
    incomplete_details: Optional[dict[str, Any]] = None


class ResponseStreamEvent(BaseModel):
    """One streamed event: ``response.created``, ``response.output_text.delta``, ...,
    ``response.completed`` (OpenAI's names and fields)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


class ResponseStore:
    """The stored responses, oldest dropped beyond ``MAX_STORED``."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def put(self, response: dict[str, Any]) -> None:
        self._items[response["id"]] = response
        while len(self._items) > MAX_STORED:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> dict[str, Any]:
        if response_id not in self._items:
            raise APIError(404, f"no response {response_id!r} (responses are kept in memory, the last "
                                f"{MAX_STORED})", "response_id")
        return self._items[response_id]


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion that answers ``body``."""
    if body.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: send the conversation's items as input",
                       "previous_response_id")
    if body.background:
        raise APIError(400, "background responses are not supported: a response runs while the request waits",
                       "background")
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [ResponseInputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, ResponseInputMessage):
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": item.role, "content": content})
        elif isinstance(item, ResponseFunctionCall):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name,
                                                                          "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                            "parallel_tool_calls": body.parallel_tool_calls, "user": body.user}
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in body.tools]
    if body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice if isinstance(body.tool_choice, str) else {
            "type": "function", "function": {"name": body.tool_choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_ or {}, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    return ChatCompletionRequest.model_validate(chat)


def _shell(body: ResponsesRequest, response_id: str, model: str, created: int) -> dict[str, Any]:
    """A response's fields other than its output, status and usage."""
    return {"id": response_id, "object": "response", "created_at": created, "model": model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": [tool.model_dump(by_alias=True) for tool in body.tools or []],
            "text": {"format": (body.text.format if body.text else ResponseTextFormat()).model_dump(
                by_alias=True, exclude_none=True)},
            "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "previous_response_id": None, "store": body.store, "truncation": body.truncation or "disabled",
            "user": body.user, "error": None, "incomplete_details": None, "background": False}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def _finish(response: dict[str, Any], finish_reason: Optional[str]) -> None:
    if finish_reason == "length":
        response["status"], response["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(text: str, item_id: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str, item_id: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: dict[str, Any], item_id: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


async def create_response(body: ResponsesRequest, request: Request, ctx: ServingContext,
                          store: ResponseStore) -> Any:
    chat = to_chat(body)
    response_id = f"resp_{uuid.uuid4().hex}"
    created = int(time.time())
    result = await create_chat_completion(chat, request, ctx)
    model = ctx.resolve_model(body.model)[0]
    shell = _shell(body, response_id, model, created)
    if body.stream:
        return StreamingResponse(_events(result.body_iterator, shell, store if body.store else None),
                                 media_type="text/event-stream")
    choice = result["choices"][0]
    message, output = choice["message"], []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"], _item_id("rs")))
    if message.get("content"):
        output.append(_message_item(message["content"], _item_id("msg")))
    output += [_call_item(call, _item_id("fc")) for call in message.get("tool_calls") or []]
    response = {**shell, "output": output, "usage": _usage(result["usage"]["prompt_tokens"],
                                                           result["usage"]["completion_tokens"])}
    _finish(response, choice["finish_reason"])
    if body.store:
        store.put(response)
    return response


async def _events(chunks: AsyncIterator[str], shell: dict[str, Any],
                  store: Optional[ResponseStore]) -> AsyncIterator[str]:
    """The chat stream's chunks (``data: {...}`` lines) as Responses' streamed events."""
    sequence = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        sequence += 1
        # the type travels in the data, as clients read it (no SSE event names: an unnamed event
        # is what every streamed route here sends)
        return sse({"type": kind, "sequence_number": sequence - 1, **fields})

    response = {**shell, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=response)
    yield event("response.in_progress", response=response)
    text, reasoning, calls, finish_reason, usage = "", "", {}, None, None
    message_id, reasoning_id, message_index = _item_id("msg"), _item_id("rs"), None
    async for line in chunks:
        if not line.startswith("data: {"):
            if line.startswith("event: error"):
                error = json.loads(line.split("data: ", 1)[1])["error"]
                response = {**response, "status": "failed", "error": {"code": error.get("type"),
                                                                      "message": error["message"]}}
                yield event("response.failed", response=response)
                yield SSE_DONE
                return
            continue
        chunk = json.loads(line[len("data: "):])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            finish_reason = choice.get("finish_reason") or finish_reason
            if delta.get("reasoning_content"):
                if not reasoning:
                    yield event("response.output_item.added", output_index=len(response["output"]),
                                item={**_reasoning_item("", reasoning_id), "status": "in_progress"})
                    response["output"].append(None)
                reasoning += delta["reasoning_content"]
                yield event("response.reasoning_text.delta", item_id=reasoning_id, output_index=0,
                            content_index=0, delta=delta["reasoning_content"])
            if delta.get("content"):
                if message_index is None:
                    message_index = len(response["output"])
                    response["output"].append(None)
                    item = {**_message_item("", message_id), "status": "in_progress", "content": []}
                    yield event("response.output_item.added", output_index=message_index, item=item)
                    yield event("response.content_part.added", item_id=message_id, output_index=message_index,
                                content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                text += delta["content"]
                yield event("response.output_text.delta", item_id=message_id, output_index=message_index,
                            content_index=0, delta=delta["content"], logprobs=[])
            for call in delta.get("tool_calls") or []:
                index = call["index"]
                if index not in calls:
                    calls[index] = {"id": call.get("id"), "function": {"name": call["function"].get("name"),
                                                                        "arguments": ""},
                                    "item_id": _item_id("fc"), "output_index": len(response["output"])}
                    response["output"].append(None)
                    yield event("response.output_item.added", output_index=calls[index]["output_index"],
                                item={**_call_item(calls[index], calls[index]["item_id"]), "status": "in_progress"})
                fragment = call["function"].get("arguments") or ""
                calls[index]["function"]["arguments"] += fragment
                if fragment:
                    yield event("response.function_call_arguments.delta", item_id=calls[index]["item_id"],
                                output_index=calls[index]["output_index"], delta=fragment)
    if reasoning:
        item = _reasoning_item(reasoning, reasoning_id)
        response["output"][0] = item
        yield event("response.reasoning_text.done", item_id=reasoning_id, output_index=0, content_index=0,
                    text=reasoning)
        yield event("response.output_item.done", output_index=0, item=item)
    if message_index is not None:
        item = _message_item(text, message_id)
        response["output"][message_index] = item
        yield event("response.output_text.done", item_id=message_id, output_index=message_index, content_index=0,
                    text=text, logprobs=[])
        yield event("response.content_part.done", item_id=message_id, output_index=message_index, content_index=0,
                    part=item["content"][0])
        yield event("response.output_item.done", output_index=message_index, item=item)
    for call in calls.values():
        item = _call_item(call, call["item_id"])
        response["output"][call["output_index"]] = item
        yield event("response.function_call_arguments.done", item_id=call["item_id"],
                    output_index=call["output_index"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=call["output_index"], item=item)
    response["usage"] = _usage(usage["prompt_tokens"], usage["completion_tokens"]) if usage else None
    _finish(response, finish_reason)
    if store is not None:
        store.put(response)
    # vLLM's rule (and what the openai client's stream helper waits for): the last event is
    # response.completed, whose response says "incomplete" where max_output_tokens cut it
    yield event("response.completed", response=response)
    yield SSE_DONE
