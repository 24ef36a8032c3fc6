"""``use_beam_search`` on both endpoints: the engine's BeamSearch, driven over async requests.

Each round, every live beam of every prompt is an ordinary one-token engine request (the
same ones ``LLM.beam_search`` makes), so beams batch with other clients' requests and share
prefix-cache blocks. The result is shaped as RequestOutputs, so the endpoints format it
like any other; a streamed beam search sends its result as one chunk, when it is known.
"""

from __future__ import annotations

import itertools
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from tokenmill.core.engine.beam_search import BeamSearch, BeamSearchParams, advance_searches
from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.outputs import CompletionOutput, RequestOutput
from tokenmill.interfaces.sampling_params import SamplingParams
from tokenmill.server.errors import APIError
from tokenmill.server.generation import SSE_DONE, ServingContext, merge_streams, sse

#: request fields that steer sampling, which beam search does not do: (field, its inert value)
_SAMPLING_ONLY = (("temperature", (None, 0.0, 0)), ("top_p", (None, 1.0, 1)), ("top_k", (None, -1)),
                  ("min_p", (None, 0.0, 0)), ("seed", (None,)), ("presence_penalty", (0.0, 0)),
                  ("frequency_penalty", (0.0, 0)), ("repetition_penalty", (None, 1.0, 1)),
                  ("logit_bias", (None,)), ("allowed_token_ids", (None,)), ("bad_words", (None, [])),
                  ("min_tokens", (0,)), ("stop", (None, [])), ("stop_token_ids", (None, [])),
                  ("vllm_xargs", (None,)), ("prompt_logprobs", (None,)), ("echo", (False,)),
                  ("best_of", (None,)), ("response_format", (None,)), ("structured_outputs", (None,)),
                  ("guided_json", (None,)), ("guided_regex", (None,)), ("guided_choice", (None,)),
                  ("guided_grammar", (None,)), ("tools", (None,)), ("include_stop_str_in_output", (False,)))


#: the longest beam search: each round hands every beam's whole sequence to the engine
MAX_BEAM_TOKENS = 1024


def check_beam_fields(body: Any) -> None:
    """Refuse what beam search cannot honour, by name: beams are ranked by the model's raw
    logprobs (HF's ``do_sample=False``), so sampling fields would be silently ignored."""
    if not body.use_beam_search:
        if body.length_penalty != 1.0:
            raise APIError(400, "length_penalty applies only with use_beam_search", "length_penalty")
        return
    for name, inert in _SAMPLING_ONLY:
        value = getattr(body, name, None)
        if value in inert or value in ({}, []) or getattr(value, "type", None) == "text":
            continue
        raise APIError(400, f"{name} does not apply to beam search, which ranks beams by the model's "
                            "logprobs", name)
    if body.logprobs not in (None, False):
        raise APIError(400, "logprobs are not reported for beam search", "logprobs")


async def gather_beam_searches(ctx: ServingContext, internal_id: str, prompts: list[dict],
                               params: list[SamplingParams], body: Any, adapter: Any) -> list[RequestOutput]:
    """Run one search per prompt, all rounds batched together; RequestOutputs with ``n``
    sequences each, best first."""
    engine = ctx.llm.engine
    if not engine.config.cache.prefix_caching:
        raise APIError(400, "beam search needs the server's prefix caching (each round would prefill every "
                            "beam again)", "use_beam_search")
    longest = max(p.max_tokens for p in params)
    if longest > MAX_BEAM_TOKENS:
        raise APIError(400, f"beam search generates at most {MAX_BEAM_TOKENS} tokens (each round scores every "
                            f"beam's whole sequence); got {longest}: set max_tokens", "max_tokens")
    eos = engine.model_config.eos_token_ids
    try:
        searches = [BeamSearch(prompt["prompt_token_ids"], BeamSearchParams(
            beam_width=body.n, max_tokens=p.max_tokens, ignore_eos=body.ignore_eos,
            length_penalty=body.length_penalty), eos) for prompt, p in zip(prompts, params)]
    except InvalidRequest as exc:  # the beam width is the request's n
        raise APIError(400, str(exc), "n" if exc.param == "beam_width" else exc.param) from None
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=searches[0].num_candidates, ignore_eos=True)
    salt = {"cache_salt": prompts[0]["cache_salt"]} if "cache_salt" in prompts[0] else {}
    for round_index in itertools.count():
        live = [search for search in searches if not search.done]
        if not live:
            break
        pending = [search.pending() for search in live]
        requests = [({"prompt": None, "prompt_token_ids": tokens, **salt}, step) for beams in pending for tokens in beams]
        streams = ctx.start(f"{internal_id}-beam{round_index}", requests, priority=body.priority, user=body.user,
                            adapter=adapter, final_only=True)
        finals: list[Any] = [None] * len(requests)
        async for index, output in merge_streams(streams):
            if output.finished:
                finals[index] = output
        advance_searches(live, pending, finals)
    return [_as_request_output(f"{internal_id}-{i}", prompt, search, ctx.tokenizer, body.skip_special_tokens)
            for i, (prompt, search) in enumerate(zip(prompts, searches))]


def _as_request_output(request_id: str, prompt: dict, search: BeamSearch, tokenizer: Any,
                       skip_special_tokens: bool) -> RequestOutput:
    prompt_len = len(search.prompt_token_ids)
    outputs = []
    for index, sequence in enumerate(search.result()):
        generated = sequence.tokens[prompt_len:]
        outputs.append(CompletionOutput(index, tokenizer.decode(generated, skip_special_tokens=skip_special_tokens),
                                        generated, sequence.cum_logprob, None, sequence.finish_reason,
                                        sequence.stop_reason))
    return RequestOutput(request_id, prompt.get("prompt"), list(search.prompt_token_ids), None, outputs, True)


def beam_search_stream(response: dict[str, Any], chunk_object: str, body: Any) -> StreamingResponse:
    """A finished beam search as a stream: one chunk with every choice, the usage chunk if
    asked for, then ``[DONE]``."""
    async def events() -> AsyncIterator[str]:
        choices = [{("delta" if key == "message" else key): value for key, value in choice.items()}
                   for choice in response["choices"]]
        head = {k: v for k, v in response.items() if k not in ("usage", "choices")}
        yield sse({**head, "object": chunk_object, "choices": choices})
        if body.stream_options and body.stream_options.include_usage:
            yield sse({**head, "object": chunk_object, "choices": [], "usage": response["usage"]})
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream")
