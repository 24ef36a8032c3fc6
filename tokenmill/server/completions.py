"""POST /v1/completions: legacy completions, streamed or not, with echo and logprobs."""

from __future__ import annotations

from typing import Any, AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenmill.interfaces.outputs import PositionLogprobs, RequestOutput
from tokenmill.server.errors import APIError, sse_error
from tokenmill.server.beam_search import beam_search_stream, check_beam_fields, gather_beam_searches
from tokenmill.server.generation import (
    MAX_SEQUENCES_PER_REQUEST,
    SSE_DONE,
    ServingContext,
    merge_streams,
    prompt_extras,
    safe_logprob,
    sse,
    token_name,
    unless_disconnected,
    usage,
)
from tokenmill.server.protocol import CompletionRequest, now, request_ids
from tokenmill.server.request_fields import check_extra_fields


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

    def __init__(self, as_ids: bool = False) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[Optional[float]] = []
        self.top_logprobs: list[Optional[dict[str, float]]] = []
        self.text_offset: list[int] = []
        self.offset = 0
        #: return_tokens_as_token_ids: tokens named 'token_id:{id}'
        self.as_ids = as_ids

    def add(self, token_ids: list[int], entries: list[Optional[PositionLogprobs]], tokenizer: Any,
            k: int) -> None:
        for token, entry in zip(token_ids, entries):
            text = entry[token].decoded_token if entry else tokenizer.decode([token])
            self.tokens.append(token_name(token, text, self.as_ids))
            self.text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(safe_logprob(entry[token].logprob))
            top = sorted(entry.items(), key=lambda item: item[1].rank or 0)[: max(k, 1) if k else 1] if k \
                else [(token, entry[token])]
            self.top_logprobs.append({token_name(t, lp.decoded_token, self.as_ids): safe_logprob(lp.logprob)
                                      for t, lp in top})

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}


async def create_completion(body: CompletionRequest, request: Request, ctx: ServingContext):
    if ctx.return_tokens_as_token_ids:  # the server's default (--return-tokens-as-token-ids)
        body = body.model_copy(update={"return_tokens_as_token_ids": True})
    model, adapter = ctx.resolve_model(body.model)
    internal_id, request_id = request_ids("cmpl", request, body.request_id)
    check_extra_fields("completions", body.model_extra or {}, internal_id)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported", "best_of")
    if body.echo and body.stream and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported when streaming", "echo")
    check_beam_fields(body)
    prompts = [ctx.prepare_prompt(p, body, body.max_tokens, body.add_special_tokens) for p in _prompts(body.prompt)]
    if len(prompts) * body.n > MAX_SEQUENCES_PER_REQUEST:
        raise APIError(400, f"at most {MAX_SEQUENCES_PER_REQUEST} sequences per request "
                            f"(prompts x n = {len(prompts) * body.n})", "n")
    params = []
    for prompt in prompts:
        max_tokens = ctx.max_tokens_for(len(prompt["prompt_token_ids"]), body.max_tokens)
        echoed = body.logprobs if body.echo and body.logprobs is not None else None
        params.append(body.sampling_params(max_tokens, body.logprobs, body.prompt_logprobs_wanted(echoed),
                                           ctx.sampling_defaults, ctx.stream_interval))
        ctx.check_logprobs(params[-1], "logprobs")
    created = now()
    if body.use_beam_search:
        finals = await unless_disconnected(request, gather_beam_searches(
            ctx, internal_id, prompts, params, body, adapter))
        response = _response(body, ctx, request_id, model, created, prompts, finals)
        return beam_search_stream(response, "text_completion", body) if body.stream else response
    await ctx.llm.compile_constraint(params[0])  # every prompt's constraint is the same one
    streams = ctx.start(internal_id, list(zip(prompts, params)), priority=body.priority, user=body.user,
                        adapter=adapter, final_only=not body.stream)
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
                builder = _LogprobsBuilder(body.return_tokens_as_token_ids)
                if body.echo:
                    builder.add(output.prompt_token_ids, output.prompt_logprobs or [], ctx.tokenizer, body.logprobs)
                builder.add(completion.token_ids, completion.logprobs or [], ctx.tokenizer, body.logprobs)
                logprobs = builder.as_dict()
            if body.echo:
                text = _prompt_text(prompt, ctx) + text
            choices.append({"index": p_index * body.n + completion.index, "text": text, "logprobs": logprobs,
                            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                            **prompt_extras(body, output), **_token_ids(body, completion.token_ids)})
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens, ctx.cached_tokens(finals))}


def _token_ids(body: Any, token_ids: list[int]) -> dict[str, Any]:
    return {"token_ids": list(token_ids)} if body.return_token_ids else {}


async def _stream(body, ctx, request_id, model, created, prompts, streams) -> AsyncIterator[str]:
    opened: set[tuple[int, int]] = set()  # (prompt, sequence) pairs that sent a chunk
    firsts: dict[int, RequestOutput] = {}  # each prompt's first output: the one with its prompt logprobs
    latest: dict[int, RequestOutput] = {}  # each prompt's last output, for its cached tokens
    prompt_tokens = completion_tokens = 0
    options = body.stream_options
    continuous = bool(options and options.include_usage and options.continuous_usage_stats)
    try:
        async for p_index, output in merge_streams(streams):  # each output holds what is new (DELTA)
            if p_index not in firsts:
                firsts[p_index] = output
                prompt_tokens += len(output.prompt_token_ids)
            latest[p_index] = output
            for completion in output.outputs:
                key = (p_index, completion.index)
                delta, new_tokens = completion.text, completion.token_ids
                opening = key not in opened
                if body.echo and opening:
                    delta = _prompt_text(prompts[p_index], ctx) + delta
                if not delta and not new_tokens and completion.finish_reason is None:
                    continue
                opened.add(key)
                completion_tokens += len(new_tokens)
                logprobs = None
                if body.logprobs is not None:
                    builder = _LogprobsBuilder(body.return_tokens_as_token_ids)
                    builder.add(new_tokens, completion.logprobs or [], ctx.tokenizer, body.logprobs)
                    logprobs = builder.as_dict()
                choice = {"index": p_index * body.n + completion.index, "text": delta, "logprobs": logprobs,
                          "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                          **(prompt_extras(body, firsts[p_index]) if opening else {}),
                          **_token_ids(body, new_tokens)}
                yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                           "choices": [choice],
                           **({"usage": usage(prompt_tokens, completion_tokens, ctx.cached_tokens(list(latest.values())))}
                              if continuous else {})})
        if options and options.include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, completion_tokens,
                                                     ctx.cached_tokens(list(latest.values())))})
    except Exception as exc:
        yield sse_error(exc)
    yield SSE_DONE
