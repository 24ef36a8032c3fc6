"""What completions and chat share: admission checks, stream merging, disconnect handling."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Optional, Sequence

import msgspec
from fastapi import Request

from tokenmill.core.engine.async_llm import AsyncLLM
from tokenmill.interfaces.outputs import PositionLogprobs, RequestOutput
from tokenmill.interfaces.sampling_params import RequestOutputKind, SamplingParams, truncate_prompt
from tokenmill.server.errors import APIError
from tokenmill.server.responses import LOGPROB_FLOOR

#: the most sequences one request may ask for (n x prompts)
MAX_SEQUENCES_PER_REQUEST = 128


@dataclass
class ServingContext:
    """Per-app state the route handlers need."""

    llm: Optional[AsyncLLM]  # None when serving an embedding model
    served_model_names: list[str]
    max_model_len: int
    tokenizer: Any
    #: whether chat requests may bring their own chat_template (vLLM's --trust-request-chat-template)
    trust_request_chat_template: bool = False
    #: a new ToolParser per choice, for tool_choice "auto" (None: the server reads no tool calls)
    tool_parser: Optional[Callable[[], Any]] = None
    #: the server's chat template (--chat-template), instead of the tokenizer's
    chat_template: Optional[str] = None
    #: tells a reasoning model's thinking from its answer (--reasoning-parser); None: all content
    reasoning_parser: Optional[Any] = None
    #: every request's logprobs name tokens 'token_id:{id}' (--return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool = False
    #: the most logprobs a request may ask for per token (--max-logprobs)
    max_logprobs: int = SamplingParams.MAX_LOGPROBS
    #: a stream's tokens per chunk after its first, for requests that set none (--stream-interval)
    stream_interval: int = 1
    #: the model's sampling defaults for fields a request leaves unset (--generation-config)
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)
    #: the role of chat replies to a generation prompt (--response-role)
    response_role: str = "assistant"
    #: messages reach the chat template with OpenAI's list of content parts, not one text
    #: (--chat-template-content-format openai)
    content_parts: bool = False
    #: usage carries prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details)
    prompt_tokens_details: bool = False
    #: a constraint holds in a reasoning reply's thinking too (structured outputs' enable_in_reasoning)
    constrain_reasoning: bool = False

    def cached_tokens(self, outputs: Sequence[RequestOutput]) -> Optional[int]:
        """The prompt tokens the prefix cache served, where replies report them."""
        return sum(output.num_cached_tokens for output in outputs) if self.prompt_tokens_details else None

    def start(self, internal_id: str, requests: list[tuple[dict, SamplingParams]], priority: int,
              user: Optional[str], adapter: Optional[str] = None,
              final_only: bool = False) -> list[AsyncIterator[RequestOutput]]:
        """Admit several engine requests at once: all of them, or (on an error) none.

        Their engine ids are ``{internal_id}-{i}``: made by the server, so no id a client
        chooses can collide with another request's. ``final_only``: a response that is not
        streamed needs only each request's last output, and no other is built or delivered. A
        stream gets what is new at each step (DELTA, as vLLM's server asks): a cumulative output
        copies every token so far, each step, which grows with the length of the reply.
        """
        streams: list[AsyncIterator[RequestOutput]] = []
        ids = [f"{internal_id}-{i}" for i in range(len(requests))]
        kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
        requests = [(prompt, replace(params, output_kind=kind)) for prompt, params in requests]
        try:
            for request_id, (prompt, params) in zip(ids, requests):
                streams.append(self.llm.generate(request_id, prompt, params, priority=priority, user=user,
                                                 adapter_name=adapter))
        except Exception:
            for request_id in ids[: len(streams)]:
                self.llm.abort(request_id)
            raise
        return streams

    def prepare_prompt(self, prompt: Any, body: Any, max_tokens: Optional[int],
                       add_special_tokens: bool = True) -> dict:
        """An engine prompt from a request: tokenized, cut to ``truncate_prompt_tokens`` (before
        the context check, so that a long prompt can be made to fit), with its cache_salt."""
        prepared = self.llm.prepare_prompt(prompt, add_special_tokens) if not isinstance(prompt, list) \
            else {"prompt": None, "prompt_token_ids": prompt}
        kept = truncate_prompt(prepared["prompt_token_ids"], body.truncate_prompt_tokens, body.truncation_side,
                               self.max_model_len, max_tokens)
        if len(kept) < len(prepared["prompt_token_ids"]):
            prepared = {"prompt": None, "prompt_token_ids": kept}
        if body.cache_salt is not None:
            prepared["cache_salt"] = body.cache_salt
        return prepared

    def adapters(self) -> dict[str, str]:
        """Served LoRA adapters: name -> path (empty without enable_lora)."""
        engine_adapters = self.llm.engine.adapters if self.llm is not None else None
        return dict(engine_adapters.loaded()) if engine_adapters is not None else {}

    def check_model(self, name: Optional[str]) -> str:
        return self.resolve_model(name)[0]

    def resolve_model(self, name: Optional[str]) -> tuple[str, Optional[str]]:
        """(the model name to report, the adapter the 'model' field selects or None)."""
        if name is None or name in self.served_model_names:
            return self.served_model_names[0], None
        if name in self.adapters():
            return name, name
        served = self.served_model_names + sorted(self.adapters())
        raise APIError(404, f"the model `{name}` does not exist; served: {', '.join(served)}", "model")

    def check_logprobs(self, params: SamplingParams, param: str) -> None:
        """A 400 where ``params`` ask for more logprobs per token than --max-logprobs allows."""
        for asked, name in ((params.logprobs, param), (params.prompt_logprobs, "prompt_logprobs")):
            if asked is not None and asked > self.max_logprobs:
                raise APIError(400, f"Requested {name} of {asked}, which is greater than max allowed: "
                                    f"{self.max_logprobs}", name)

    def max_tokens_for(self, prompt_len: int, requested: Optional[int]) -> int:
        """Check the context window; a missing max_tokens means the rest of it. The model's
        max_new_tokens (``sampling_defaults``) caps both (vLLM's rule: the least of the three)."""
        room = self.max_model_len - prompt_len
        if room < 1 or (requested is not None and requested > room):
            asked = prompt_len + (requested or 0)
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {asked} tokens ({prompt_len} in the prompt, {requested or 0} for the "
                "completion). Please reduce the prompt or max_tokens.",
                "max_tokens" if room >= 1 else "prompt",
            )
        tokens = requested if requested is not None else room
        cap = self.sampling_defaults.get("max_tokens")
        return tokens if cap is None else min(tokens, cap)


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with their index.

    Closing the merged iterator cancels every producer, which aborts any request
    still running (their generators' ``finally`` does that).
    """
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except BaseException as exc:  # forwarded to the consumer, which re-raises
            await queue.put(exc)
            return
        await queue.put(done)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client goes away first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client disconnected")
    return task.result()


def token_name(token_id: int, decoded: Optional[str], as_ids: bool) -> str:
    """How logprobs name a token: its text, or vLLM's ``token_id:{id}`` with
    return_tokens_as_token_ids (which survives tokens that are not whole characters)."""
    return f"token_id:{token_id}" if as_ids else (decoded or "")


def prompt_logprobs_json(entries: Optional[list[Optional[PositionLogprobs]]], prompt_ids: list[int],
                         k: int) -> list[Optional[dict[str, dict]]]:
    """vLLM's prompt_logprobs: per prompt position (the first has none), the prompt token and
    the ``k`` most likely tokens, by token id."""
    out: list[Optional[dict[str, dict]]] = []
    for token, entry in zip(prompt_ids, entries or [None] * len(prompt_ids)):
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": safe_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for t, lp in entry.items() if t == token or (lp.rank is not None and lp.rank <= k)})
    return out


def prompt_extras(body: Any, output: RequestOutput) -> dict[str, Any]:
    """prompt_logprobs and prompt_token_ids, where the request asked for them."""
    extras: dict[str, Any] = {}
    if body.prompt_logprobs is not None:
        extras["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs, output.prompt_token_ids,
                                                         body.prompt_logprobs)
    if body.return_token_ids:
        extras["prompt_token_ids"] = output.prompt_token_ids
    return extras


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None) -> dict[str, Any]:
    figures: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                               "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        figures["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return figures


def safe_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a token the model rules out) becomes the floor."""
    return max(value, LOGPROB_FLOOR)


#: one encoder for every streamed event: msgspec writes a chunk in about a seventh of
#: ``json.dumps``'s time, and a stream sends one per token
_SSE_ENCODER = msgspec.json.Encoder()
#: the characters besides CR and LF that ``str.splitlines`` breaks lines at and msgspec leaves
#: unescaped (it escapes those under U+0020): a client that reads the stream's lines with it
#: (httpx's ``aiter_lines`` does, which ``tokenmill bench serve`` reads) would cut an event in two
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def sse(data: Any) -> str:
    """One server-sent event, on one line: text goes out as UTF-8, except a few line breaks."""
    try:
        body = _SSE_ENCODER.encode(data).decode()
    except UnicodeEncodeError:  # a lone surrogate (a client's "\\ud800" in a stop string): escaped
        body = json.dumps(data, separators=(",", ":"))
    # looked for before translating: ``str.translate`` walks every character in Python's
    # generic path, 5-6 us of a token's chunk where the three ``in`` checks take 0.1
    if "\x85" in body or "\u2028" in body or "\u2029" in body:
        body = body.translate(_LINE_BREAKS)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"
