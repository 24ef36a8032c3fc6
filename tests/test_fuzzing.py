"""Hostile values, fuzzed with hypothesis: out-of-vocabulary ids, integers past 64 bits, NaN and
infinities, denormals, lone surrogates, wrong types, deep nesting. Each one is refused with a
clear error or served correctly; none reaches the engine's state, which serves on unchanged."""

from __future__ import annotations

import json
import string

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import make_llm
from server_harness import running_server
from tokenmill import SamplingParams
from tokenmill.interfaces.errors import InvalidRequest

MODEL = "tiny"
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
GREEDY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}

#: integers around every boundary a consumer has: 0, the vocabulary, 32 and 64 bits, and past them
HOSTILE_INTS = st.one_of(
    st.integers(-3, 3),
    st.integers(-(2**70), 2**70),
    st.sampled_from([255, 256, 511, 512, 513, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                     -(2**63), -(2**63) - 1, 10**30]),
)
HOSTILE_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-40, 1e-6, 1e-5, 0.5, 1.0, 2.0, 100.0, 1e308]),
)
HOSTILE_TEXT = st.one_of(
    st.text(max_size=20),
    st.text(st.characters(codec=None, categories=["Cs"]), min_size=1, max_size=3),  # lone surrogates
    st.sampled_from(["", "\x00", "\ud800", "a\udfffb", "</s>", "<|begin_of_text|>", "\u202e"]),
)
SCALARS = st.one_of(st.none(), st.booleans(), HOSTILE_INTS, HOSTILE_FLOATS, HOSTILE_TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(HOSTILE_TEXT, inner, max_size=3)),
                      max_leaves=8)


def _mostly(sane: st.SearchStrategy, hostile: st.SearchStrategy) -> st.SearchStrategy:
    """Seven sane draws to one hostile, so that requests with several fields also get past
    admission and run."""
    return st.integers(0, 7).flatmap(lambda pick: hostile if pick == 0 else sane)


_FLOATS = st.one_of(HOSTILE_FLOATS, HOSTILE_INTS)
_TOKEN_IDS = st.lists(_mostly(st.integers(0, 511), HOSTILE_INTS), max_size=3)
#: per SamplingParams field: sane values and hostile ones
SAMPLING_FIELDS = {
    # n past a few only multiplies the work (the server caps it; see test_server_errors)
    "n": _mostly(st.integers(1, 3), st.one_of(st.integers(-3, 0), st.just(-(2**70)))),
    "temperature": _mostly(st.sampled_from([0.0, 0.7, 1.0, 1.5]), _FLOATS),
    "top_p": _mostly(st.floats(0.05, 1.0), _FLOATS),
    "top_k": _mostly(st.sampled_from([-1, 1, 5, 50]), HOSTILE_INTS),
    "min_p": _mostly(st.floats(0.0, 0.5), _FLOATS),
    "presence_penalty": _mostly(st.floats(-2.0, 2.0), _FLOATS),
    "frequency_penalty": _mostly(st.floats(-2.0, 2.0), _FLOATS),
    "repetition_penalty": _mostly(st.floats(0.5, 2.0), _FLOATS),
    "seed": _mostly(st.one_of(st.none(), st.integers(0, 2**32)), HOSTILE_INTS),
    "max_tokens": _mostly(st.one_of(st.none(), st.integers(1, 8)), HOSTILE_INTS),
    "min_tokens": _mostly(st.integers(0, 4), HOSTILE_INTS),
    "stop": st.lists(HOSTILE_TEXT, max_size=2),
    "stop_token_ids": _TOKEN_IDS,
    "logprobs": _mostly(st.one_of(st.none(), st.integers(0, 5)), HOSTILE_INTS),
    "prompt_logprobs": _mostly(st.one_of(st.none(), st.integers(0, 5)), HOSTILE_INTS),
    "logit_bias": st.one_of(st.none(), st.dictionaries(_mostly(st.integers(0, 511), HOSTILE_INTS),
                                                       _mostly(st.floats(-100, 100), _FLOATS), max_size=3)),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": _mostly(st.just(True), st.just(False)),
    "allowed_token_ids": st.one_of(st.none(), st.lists(_mostly(st.integers(0, 511), HOSTILE_INTS), max_size=4)),
    "bad_words": st.lists(_mostly(st.sampled_from(["the", "fox", " a", "lazy dog"]), HOSTILE_TEXT), max_size=3),
    "truncate_prompt_tokens": _mostly(st.one_of(st.none(), st.just(-1), st.integers(1, 8)), HOSTILE_INTS),
    "truncation_side": _mostly(st.sampled_from(["left", "right"]), HOSTILE_TEXT),
    "extra_args": st.one_of(st.none(), st.dictionaries(HOSTILE_TEXT, VALUES, max_size=2)),
}


def _sampling_kwargs() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional=SAMPLING_FIELDS)


@pytest.fixture(scope="module")
def engine(model_dir):
    # a short context bounds any request the fuzzer makes up (n x max_tokens)
    return make_llm(model_dir("llama"), max_model_len=48).llm_engine


@FUZZ
@given(kwargs=_sampling_kwargs(), prompt=_mostly(st.lists(st.integers(0, 511), min_size=1, max_size=6),
                                                  st.one_of(st.lists(HOSTILE_INTS, max_size=6), HOSTILE_TEXT)))
def test_sampling_params_are_refused_or_served(engine, kwargs, prompt):
    """SamplingParams with hostile values: an InvalidRequest naming a parameter, or a finished request."""
    try:
        params = SamplingParams(**kwargs)
        engine.add_request("fuzz", prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}, params)
    except InvalidRequest as exc:
        event(f"refused: {exc.param}")
        assert exc.param is None or exc.param in {*kwargs, "prompt", "prompt_token_ids", "logit_bias", "vllm_xargs"}
        assert not engine.has_unfinished_requests()
        return
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    [final] = finals
    event("served")
    assert final.error is None, final.error
    assert all(o.finish_reason in ("stop", "length") for o in final.outputs)
    assert engine.scheduler.kv_cache.pool.usage() == 0.0


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine, served_model_name=[MODEL]) as (url, _):
        before = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
        yield url, before


#: request fields with sane-or-hostile values (the sampling ones as above, logit_bias keyed by strings
#: as JSON has them), and with anything at all (VALUES)
BODY_FIELDS = {
    **{name: _mostly(strategy, VALUES) for name, strategy in SAMPLING_FIELDS.items()
       if name not in ("logit_bias", "prompt_logprobs", "extra_args")},
    "vllm_xargs": _mostly(st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9), max_size=2), VALUES),
    "prompt_logprobs": _mostly(st.one_of(st.none(), st.integers(0, 5)), VALUES),
    "logit_bias": st.dictionaries(_mostly(st.integers(0, 511), HOSTILE_INTS).map(str),
                                  _mostly(st.floats(-100, 100), _FLOATS), max_size=3),
    **{name: VALUES for name in ("model", "prompt", "messages", "top_logprobs", "echo", "stream", "stream_options",
                                 "priority", "request_id", "user", "max_completion_tokens", "chat_template",
                                 "tools", "input", "tokens", "use_beam_search", "length_penalty", "cache_salt",
                                 "return_tokens_as_token_ids", "return_token_ids", "add_special_tokens",
                                 "continue_final_message", "chat_template_kwargs", "add_generation_prompt",
                                 "response_format", "structured_outputs")},
}


#: a valid body per route, which the fuzzer then spoils
BASE_BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [40, 41]},
}


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    """A route and a raw body: a near-valid request with hostile values in some fields, or junk."""
    path = draw(st.sampled_from(list(BASE_BODIES)))
    kind = draw(st.sampled_from(["fields", "fields", "fields", "junk", "deep"]))
    if kind == "junk":
        return path, draw(st.one_of(st.binary(max_size=64),
                                    st.text(string.printable, max_size=64).map(str.encode)))
    if kind == "deep":
        depth = draw(st.integers(60, 3000))
        return path, b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
    body = dict(BASE_BODIES[path])
    names = draw(st.lists(st.sampled_from(sorted(BODY_FIELDS)), min_size=1, max_size=3, unique=True))
    body.update({name: draw(BODY_FIELDS[name]) for name in names})
    # ensure_ascii writes lone surrogates as \ud800 escapes; allow_nan writes NaN and Infinity
    return path, json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


@FUZZ
@given(request=bodies())
def test_hostile_bodies_never_get_a_5xx_and_the_server_stays_healthy(server, request):
    url, _ = server
    path, content = request
    response = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=120)
    assert response.status_code < 500, (response.status_code, response.text[:500])
    event(f"{path} {response.status_code}")
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"]
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_after_the_fuzzing_greedy_output_is_unchanged(server, engine):
    url, before = server
    after = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    assert after == before
    assert engine.scheduler.kv_cache.pool.usage() == 0.0
