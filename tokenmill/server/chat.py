"""POST /v1/chat/completions: the model's chat template, streamed or not, with logprobs."""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.core.engine.chat_template import render_chat
from tokenmill.interfaces.reasoning_parser import ReasoningParser
from tokenmill.interfaces.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tokenmill.interfaces.sampling_params import SamplingParams
from tokenmill.server.beam_search import beam_search_stream, check_beam_fields, gather_beam_searches
from tokenmill.server.errors import APIError, sse_error
from tokenmill.server.generation import (
    MAX_SEQUENCES_PER_REQUEST,
    SSE_DONE,
    ServingContext,
    prompt_extras,
    safe_logprob,
    sse,
    token_name,
    unless_disconnected,
    usage,
)
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, now, request_ids
from tokenmill.server.request_fields import check_extra_fields
from tokenmill.server.reasoning import ReasoningStream, constraint_after_thinking
from tokenmill.server.tools import ToolReply, plan_tools


def chat_prompt_ids(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    chat_template: Optional[str] = None, *, continue_final_message: bool = False,
                    template_kwargs: Optional[dict[str, Any]] = None, add_special_tokens: bool = False,
                    tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
    conversation = [m.for_template(ctx.content_parts) for m in messages]
    template = chat_template if chat_template is not None else ctx.chat_template
    return render_chat(ctx.tokenizer, conversation, template, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, chat_template_kwargs=template_kwargs,
                       add_special_tokens=add_special_tokens, tools=tools)


def _logprobs_content(token_ids: list[int], entries: list[PositionLogprobs], top: int, as_ids: bool) -> list[dict]:
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top),
                        key=lambda item: item[1].rank)
        name = token_name(token, chosen.decoded_token, as_ids)
        content.append({
            "token": name, "logprob": safe_logprob(chosen.logprob), "bytes": list(name.encode()),
            "top_logprobs": [{"token": token_name(t, lp.decoded_token, as_ids), "logprob": safe_logprob(lp.logprob),
                              "bytes": list(token_name(t, lp.decoded_token, as_ids).encode())}
                             for t, lp in ranked[:top]],
        })
    return content


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServingContext):
    if ctx.return_tokens_as_token_ids:  # the server's default (--return-tokens-as-token-ids)
        body = body.model_copy(update={"return_tokens_as_token_ids": True})
    model, adapter = ctx.resolve_model(body.model)
    internal_id, request_id = request_ids("chatcmpl", request, body.request_id)
    check_extra_fields("chat", body.model_extra or {}, internal_id)
    if body.n > MAX_SEQUENCES_PER_REQUEST:
        raise APIError(400, f"n must be at most {MAX_SEQUENCES_PER_REQUEST}", "n")
    if body.chat_template is not None and not ctx.trust_request_chat_template:
        raise APIError(400, "this server does not accept a request's own chat_template (start it with "
                            "--trust-request-chat-template to allow it)", "chat_template")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    check_beam_fields(body)
    tool_constraint, template_tools, make_reply = plan_tools(body, ctx.tool_parser)
    template_kwargs = body.chat_template_kwargs
    if body.reasoning_effort is not None:
        template_kwargs = {"reasoning_effort": body.reasoning_effort, **(template_kwargs or {})}
    token_ids = chat_prompt_ids(ctx, body.messages, body.add_generation_prompt, body.chat_template,
                                continue_final_message=body.continue_final_message,
                                template_kwargs=template_kwargs,
                                add_special_tokens=body.add_special_tokens, tools=template_tools)
    requested = body.max_completion_tokens or body.max_tokens
    prompt = ctx.prepare_prompt(token_ids, body, requested)
    max_tokens = ctx.max_tokens_for(len(prompt["prompt_token_ids"]), requested)
    top = body.top_logprobs or 0
    params = body.sampling_params(max_tokens, top if body.logprobs else None, body.prompt_logprobs,
                                  ctx.sampling_defaults, ctx.stream_interval)
    ctx.check_logprobs(params, "top_logprobs")
    constraint = tool_constraint or params.structured_outputs
    if constraint is not None and ctx.reasoning_parser is not None and not ctx.constrain_reasoning:
        constraint = constraint_after_thinking(ctx.reasoning_parser, ctx.tokenizer, constraint,
                                               prompt["prompt_token_ids"])
    if constraint is not params.structured_outputs:
        params = dataclasses.replace(params, structured_outputs=constraint)
    echo = _echoed(body)
    created = now()
    # vLLM's rule: a reply to the generation prompt takes the server's role, one that continues
    # the last message takes that message's
    role = ctx.response_role if body.add_generation_prompt else body.messages[-1].role
    if body.use_beam_search:
        [final] = await unless_disconnected(request, gather_beam_searches(
            ctx, internal_id, [prompt], [params], body, adapter))
        response = _response(body, request_id, model, created, final, echo, make_reply, ctx, role)
        return beam_search_stream(response, "chat.completion.chunk", body) if body.stream \
            else response
    await ctx.llm.compile_constraint(params)
    [stream] = ctx.start(internal_id, [(prompt, params)], priority=body.priority, user=body.user,
                         adapter=adapter, final_only=not body.stream)
    if body.stream:
        return StreamingResponse(_stream(body, request_id, model, created, stream, params, echo, make_reply,
                                         ctx, role), media_type="text/event-stream")
    final = await unless_disconnected(request, _last(stream))
    return _response(body, request_id, model, created, final, echo, make_reply, ctx, role)


def _echoed(body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the reply starts with the last message's content when that message is
    the assistant's (the turn the model continues)."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


def _response(body: ChatCompletionRequest, request_id: str, model: str, created: int, final: RequestOutput,
              echo: str, make_reply: Callable[[], ToolReply], ctx: ServingContext, role: str) -> dict[str, Any]:
    top = body.top_logprobs or 0
    choices = [_choice(c, body, top, echo, make_reply(), ctx.reasoning_parser, role) for c in final.outputs]
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(len(final.prompt_token_ids), completion_tokens, ctx.cached_tokens([final])),
            **prompt_extras(body, final)}


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    return final


def _choice(completion: CompletionOutput, body: ChatCompletionRequest, top: int, echo: str,
            reply: ToolReply, reasoning: Optional[ReasoningParser], role: str) -> dict[str, Any]:
    thinking, text = (None, completion.text) if reasoning is None else reasoning.split(completion.text, True)
    message, finish_reason = reply.message(text or "", completion.finish_reason)
    message["role"] = role
    if reasoning is not None:  # the answer alone, with the thinking beside it
        if text is None and "tool_calls" not in message:
            message["content"] = None
        if body.include_reasoning:
            message.update(_thinking(thinking))
    if message["content"] is not None:
        message["content"] = echo + message["content"]
    choice = {
        "index": completion.index,
        "message": message,
        "logprobs": {"content": _logprobs_content(completion.token_ids, completion.logprobs or [], top,
                                                  body.return_tokens_as_token_ids)}
        if body.logprobs else None,
        "finish_reason": finish_reason,
        "stop_reason": completion.stop_reason,
    }
    if body.return_token_ids:
        choice["token_ids"] = list(completion.token_ids)
    return choice


def _thinking(text: Optional[str]) -> dict[str, Optional[str]]:
    """The thinking under vLLM's two names: ``reasoning``, and ``reasoning_content`` (older)."""
    return {"reasoning": text, "reasoning_content": text}


async def _stream(body: ChatCompletionRequest, request_id: str, model: str, created: int,
                  stream: AsyncIterator[RequestOutput], params: SamplingParams, echo: str,
                  make_reply: Callable[[], ToolReply], ctx: ServingContext, role: str) -> AsyncIterator[str]:
    reasoning = ctx.reasoning_parser
    def chunk(choices: list[dict], **extra: Any) -> str:
        return sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices, **extra})

    texts: dict[int, str] = {}  # each choice's text so far, which the tool and reasoning readers read
    first: Optional[RequestOutput] = None  # the one output with the prompt's logprobs
    prompt_tokens = completion_tokens = 0
    cached_tokens = None
    top = body.top_logprobs or 0
    options = body.stream_options
    continuous = bool(options and options.include_usage and options.continuous_usage_stats)
    replies = [make_reply() for _ in range(params.n)]
    splits = [ReasoningStream(reasoning) for _ in range(params.n)] if reasoning is not None else None
    sent_prompt = False
    try:
        # the first chunk opens each choice, with the echoed text; its usage counts no tokens yet
        yield chunk([{"index": i, "delta": {"role": role, "content": echo}, "logprobs": None,
                      "finish_reason": None} for i in range(params.n)])
        async for output in stream:  # each output holds what is new (DELTA)
            first = first or output
            prompt_tokens, cached_tokens = len(output.prompt_token_ids), ctx.cached_tokens([output])
            for completion in output.outputs:
                i = completion.index
                delta, new_tokens = completion.text, completion.token_ids
                if not delta and not new_tokens and completion.finish_reason is None:
                    continue
                before = texts.get(i, "")
                text_from, text = len(before), before + delta
                texts[i] = text
                completion_tokens += len(new_tokens)
                if splits is None:
                    message, finish_reason = replies[i].delta(text, text_from, delta, completion.finish_reason)
                else:  # tool calls are read from the answer alone; the thinking streams beside it
                    thinking, answer = splits[i].feed(text, completion.finish_reason is not None)
                    content = splits[i].content
                    message, finish_reason = replies[i].delta(content, len(content) - len(answer), answer,
                                                              completion.finish_reason)
                    if thinking and body.include_reasoning:
                        message = {**_thinking(thinking), **(message or {})}
                if message is None:
                    continue
                logprobs = None
                if body.logprobs:
                    logprobs = {"content": _logprobs_content(new_tokens, completion.logprobs or [], top,
                                                             body.return_tokens_as_token_ids)}
                choice = {"index": i, "delta": message, "logprobs": logprobs,
                          "finish_reason": finish_reason, "stop_reason": completion.stop_reason}
                if body.return_token_ids:
                    choice["token_ids"] = list(new_tokens)
                extra = {"usage": usage(prompt_tokens, completion_tokens, cached_tokens)} if continuous else {}
                if not sent_prompt:  # the prompt's figures come once, with the first tokens
                    sent_prompt = True
                    extra.update(prompt_extras(body, first))
                yield chunk([choice], **extra)
        if options and options.include_usage:
            yield chunk([], usage=usage(prompt_tokens, completion_tokens, cached_tokens))
    except Exception as exc:
        yield sse_error(exc)
    yield SSE_DONE
