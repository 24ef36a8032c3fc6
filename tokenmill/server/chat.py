"""POST /v1/chat/completions: the model's chat template, streamed or not, with logprobs."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.interfaces.types import CompletionOutput, PositionLogprobs, RequestOutput, SamplingParams
from tokenmill.server.errors import APIError, sse_error
from tokenmill.server.generation import (
    MAX_SEQUENCES_PER_REQUEST,
    SSE_DONE,
    ServingContext,
    safe_logprob,
    sse,
    unless_disconnected,
)
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, now, request_ids


def chat_prompt_ids(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    chat_template: Optional[str] = None) -> list[int]:
    tokenizer = ctx.tokenizer
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # template errors (e.g. raise_exception on bad roles) are the caller's
        raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _logprobs_content(token_ids: list[int], entries: list[PositionLogprobs], top: int) -> list[dict]:
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        ranked = sorted((lp for t, lp in entry.items() if lp.rank is not None and lp.rank <= top),
                        key=lambda lp: lp.rank)
        content.append({
            "token": chosen.decoded_token, "logprob": safe_logprob(chosen.logprob),
            "bytes": list(chosen.decoded_token.encode()),
            "top_logprobs": [{"token": lp.decoded_token, "logprob": safe_logprob(lp.logprob),
                              "bytes": list(lp.decoded_token.encode())} for lp in ranked[:top]],
        })
    return content


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServingContext):
    model, adapter = ctx.resolve_model(body.model)
    if body.tools:
        raise APIError(400, "tools are not supported", "tools")
    if body.n > MAX_SEQUENCES_PER_REQUEST:
        raise APIError(400, f"n must be at most {MAX_SEQUENCES_PER_REQUEST}", "n")
    if body.chat_template is not None and not ctx.trust_request_chat_template:
        raise APIError(400, "this server does not accept a request's own chat_template (start it with "
                            "--trust-request-chat-template to allow it)", "chat_template")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    token_ids = chat_prompt_ids(ctx, body.messages, body.add_generation_prompt, body.chat_template)
    max_tokens = ctx.max_tokens_for(len(token_ids), body.max_completion_tokens or body.max_tokens)
    top = body.top_logprobs or 0
    params = body.sampling_params(max_tokens, top if body.logprobs else None)
    internal_id, request_id = request_ids("chatcmpl", request, body.request_id)
    prompt = {"prompt": None, "prompt_token_ids": token_ids}
    [stream] = ctx.start(internal_id, [(prompt, params)], priority=body.priority, user=body.user,
                         adapter=adapter)
    created = now()
    if body.stream:
        return StreamingResponse(_stream(body, request_id, model, created, stream, params),
                                 media_type="text/event-stream")
    final = await unless_disconnected(request, _last(stream))
    choices = [_choice(c, body.logprobs, top) for c in final.outputs]
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
        "usage": {"prompt_tokens": len(token_ids), "completion_tokens": completion_tokens,
                  "total_tokens": len(token_ids) + completion_tokens},
    }


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    return final


def _choice(completion: CompletionOutput, logprobs: bool, top: int) -> dict[str, Any]:
    return {
        "index": completion.index,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": {"content": _logprobs_content(completion.token_ids, completion.logprobs or [], top)}
        if logprobs else None,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


async def _stream(body: ChatCompletionRequest, request_id: str, model: str, created: int,
                  stream: AsyncIterator[RequestOutput], params: SamplingParams) -> AsyncIterator[str]:
    def chunk(choices: list[dict], **extra: Any) -> str:
        return sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices, **extra})

    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    prompt_tokens = completion_tokens = 0
    top = body.top_logprobs or 0
    try:
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(params.n)])
        async for output in stream:
            prompt_tokens = len(output.prompt_token_ids)
            for completion in output.outputs:
                i = completion.index
                text_from, token_from = sent_text.get(i, 0), sent_tokens.get(i, 0)
                delta, new_tokens = completion.text[text_from:], completion.token_ids[token_from:]
                if not delta and not new_tokens and completion.finish_reason is None:
                    continue
                sent_text[i], sent_tokens[i] = len(completion.text), len(completion.token_ids)
                completion_tokens += len(new_tokens)
                logprobs = None
                if body.logprobs:
                    logprobs = {"content": _logprobs_content(new_tokens, (completion.logprobs or [])[token_from:], top)}
                yield chunk([{"index": i, "delta": {"content": delta} if delta else {}, "logprobs": logprobs,
                              "finish_reason": completion.finish_reason,
                              "stop_reason": completion.stop_reason}])
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                   "total_tokens": prompt_tokens + completion_tokens})
    except Exception as exc:
        yield sse_error(exc)
    yield SSE_DONE
