"""POST /v1/completions: legacy completions, streamed or not, with echo and logprobs."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.interfaces.types import PositionLogprobs, RequestOutput
from tokenmill.server.errors import APIError, sse_error
from tokenmill.server.generation import (
    MAX_SEQUENCES_PER_REQUEST,
    SSE_DONE,
    ServingContext,
    merge_streams,
    safe_logprob,
    sse,
    unless_disconnected,
)
from tokenmill.server.protocol import CompletionRequest, now, request_ids


def _prompts(prompt: Any) -> list[Any]:
    """OpenAI's four prompt shapes -> a list of engine prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]


class _LogprobsBuilder:
    """The legacy ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[Optional[float]] = []
        self.top_logprobs: list[Optional[dict[str, float]]] = []
        self.text_offset: list[int] = []
        self.offset = 0

    def add(self, token_ids: list[int], entries: list[Optional[PositionLogprobs]], tokenizer: Any,
            k: int) -> None:
        for token, entry in zip(token_ids, entries):
            text = entry[token].decoded_token if entry else tokenizer.decode([token])
            self.tokens.append(text)
            self.text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(safe_logprob(entry[token].logprob))
            top = sorted(entry.values(), key=lambda lp: lp.rank or 0)[: max(k, 1) if k else 1]
            self.top_logprobs.append({lp.decoded_token: safe_logprob(lp.logprob) for lp in top} if k else
                                     {entry[token].decoded_token: safe_logprob(entry[token].logprob)})

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


async def create_completion(body: CompletionRequest, request: Request, ctx: ServingContext):
    model, adapter = ctx.resolve_model(body.model)
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported", "best_of")
    if body.echo and body.stream and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported when streaming", "echo")
    prompts = [ctx.llm.prepare_prompt(p) for p in _prompts(body.prompt)]
    if len(prompts) * body.n > MAX_SEQUENCES_PER_REQUEST:
        raise APIError(400, f"at most {MAX_SEQUENCES_PER_REQUEST} sequences per request "
                            f"(prompts x n = {len(prompts) * body.n})", "n")
    params = []
    for prompt in prompts:
        max_tokens = ctx.max_tokens_for(len(prompt["prompt_token_ids"]), body.max_tokens)
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        params.append(body.sampling_params(max_tokens, body.logprobs, prompt_logprobs))
    internal_id, request_id = request_ids("cmpl", request, body.request_id)
    streams = ctx.start(internal_id, list(zip(prompts, params)), priority=body.priority, user=body.user,
                        adapter=adapter)
    created = now()
    if body.stream:
        return StreamingResponse(_stream(body, ctx, request_id, model, created, prompts, streams),
                                 media_type="text/event-stream")
    finals = await unless_disconnected(request, _collect(streams))
    return _response(body, ctx, request_id, model, created, prompts, finals)


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: list[Optional[RequestOutput]] = [None] * len(streams)
    async for index, output in merge_streams(streams):
        if output.finished:
            finals[index] = output
    return finals  # type: ignore[return-value]


def _prompt_text(prompt: dict, ctx: ServingContext) -> str:
    return prompt["prompt"] if prompt["prompt"] is not None else ctx.tokenizer.decode(prompt["prompt_token_ids"])


def _response(body, ctx, request_id, model, created, prompts, finals) -> dict:
    choices = []
    prompt_tokens = completion_tokens = 0
    for p_index, (prompt, output) in enumerate(zip(prompts, finals)):
        prompt_tokens += len(output.prompt_token_ids)
        for completion in output.outputs:
            completion_tokens += len(completion.token_ids)
            text = completion.text
            logprobs = None
            if body.logprobs is not None:
                builder = _LogprobsBuilder()
                if body.echo:
                    builder.add(output.prompt_token_ids, output.prompt_logprobs or [], ctx.tokenizer, body.logprobs)
                builder.add(completion.token_ids, completion.logprobs or [], ctx.tokenizer, body.logprobs)
                logprobs = builder.as_dict()
            if body.echo:
                text = _prompt_text(prompt, ctx) + text
            choices.append({"index": p_index * body.n + completion.index, "text": text, "logprobs": logprobs,
                            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens}}


async def _stream(body, ctx, request_id, model, created, prompts, streams) -> AsyncIterator[str]:
    sent_text: dict[tuple[int, int], int] = {}
    sent_tokens: dict[tuple[int, int], int] = {}
    counted_prompts: set[int] = set()
    prompt_tokens = completion_tokens = 0
    try:
        async for p_index, output in merge_streams(streams):
            if p_index not in counted_prompts:
                counted_prompts.add(p_index)
                prompt_tokens += len(output.prompt_token_ids)
            for completion in output.outputs:
                key = (p_index, completion.index)
                text_from, token_from = sent_text.get(key, 0), sent_tokens.get(key, 0)
                delta = completion.text[text_from:]
                new_tokens = completion.token_ids[token_from:]
                if body.echo and key not in sent_text:
                    delta = _prompt_text(prompts[p_index], ctx) + delta
                if not delta and not new_tokens and completion.finish_reason is None:
                    continue
                sent_text[key], sent_tokens[key] = len(completion.text), len(completion.token_ids)
                completion_tokens += len(new_tokens)
                logprobs = None
                if body.logprobs is not None:
                    builder = _LogprobsBuilder()
                    builder.add(new_tokens, (completion.logprobs or [])[token_from:], ctx.tokenizer, body.logprobs)
                    logprobs = builder.as_dict()
                yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": p_index * body.n + completion.index, "text": delta,
                                        "logprobs": logprobs, "finish_reason": completion.finish_reason,
                                        "stop_reason": completion.stop_reason}]})
        if body.stream_options and body.stream_options.include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                "completion_tokens": completion_tokens,
                                                "total_tokens": prompt_tokens + completion_tokens}})
    except Exception as exc:
        yield sse_error(exc)
    yield SSE_DONE
