"""Which request fields the server refuses by name, and the warning for fields it ignores.

A client moving from vLLM keeps sending vLLM's fields. Each one is either implemented
(a field of the request models in ``protocol.py``), refused here with a 400 whose
``param`` names it, or, when neither OpenAI nor vLLM defines it, ignored with one warning
line per request that names it (vLLM's behaviour). No field of OpenAI's or vLLM's is
accepted and silently ignored. ``tests/test_request_fields.py`` holds vLLM 0.32's field
names per endpoint and checks every one against this split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import structlog

from tokenmill.server.errors import APIError

log = structlog.get_logger("tokenmill.server")


@dataclass(frozen=True)
class Refused:
    """A field this server does not implement: values in ``inert`` (the field's default,
    which asks for nothing) pass; any other value is a 400 giving ``reason``."""

    reason: str
    inert: tuple[Any, ...] = (None,)


_MULTIMODAL = "multimodal inputs are not supported (the served models are text-only)"
_DISAGGREGATED = "disaggregated serving (KV and encoder-cache transfer) is not supported"
_REASONING = "a thinking-token budget is not supported"
_FUNCTIONS = "functions and function_call are OpenAI's deprecated spelling: use tools and tool_choice"

#: refused on both endpoints
_COMMON: dict[str, Refused] = {
    "kv_transfer_params": Refused(_DISAGGREGATED),
    "ec_transfer_params": Refused(_DISAGGREGATED),
    "mm_payload": Refused(_MULTIMODAL),
    "return_mm_kwargs": Refused(_MULTIMODAL, (None, False)),
    "logprob_token_ids": Refused("logprobs of chosen token ids are not supported; use logprobs/top_logprobs"),
    "return_token_offsets": Refused("token offsets are not supported", (None, False)),
    "repetition_detection": Refused("repetition detection is not supported"),
    "routed_experts_prompt_start": Refused("reporting MoE routing is not supported"),
    "session_id": Refused("sessions (streaming input) are not supported"),
    "thinking_token_budget": Refused(_REASONING),
    "watermarking": Refused("watermarking is not supported"),
}

REFUSED_FIELDS: dict[str, dict[str, Refused]] = {
    "completions": {
        **_COMMON,
        "suffix": Refused("suffix (fill-in-the-middle) is not supported"),
        "prompt_embeds": Refused("prompt embeddings are not supported; send text or token ids"),
    },
    "chat": {
        **_COMMON,
        "functions": Refused(_FUNCTIONS, (None, [])),
        "function_call": Refused(_FUNCTIONS, (None, "none")),
        "documents": Refused("documents for retrieval-augmented chat templates are not supported"),
        "media_io_kwargs": Refused(_MULTIMODAL),
        "mm_processor_kwargs": Refused(_MULTIMODAL),
        "modalities": Refused("only text output is supported", (None, ["text"])),
        "audio": Refused("only text output is supported"),
        "prediction": Refused("predicted outputs are not supported"),
        "web_search_options": Refused("web search is not supported"),
        "return_prompt_text": Refused("returning the rendered prompt is not supported; use /tokenize",
                                      (None, False)),
    },
}


def check_extra_fields(endpoint: str, extra: Mapping[str, Any], request_id: str) -> None:
    """Refuse the request's undeclared fields that ask for something unsupported; name the
    rest, which nothing defines, in one warning line."""
    refused = REFUSED_FIELDS[endpoint]
    ignored = []
    for name, value in extra.items():
        field = refused.get(name)
        if field is None:
            ignored.append(name)
        elif not any(value == inert and type(value) is type(inert) for inert in field.inert):
            raise APIError(400, f"{name} is not supported: {field.reason}", name)
    if ignored:
        log.warning("request fields ignored: neither OpenAI nor vLLM defines them", request_id=request_id,
                    fields=sorted(ignored))
