"""Structured outputs and tools on a real server, through the openai client.

The tiny model has random weights, so its free output is noise: every reply that parses and
validates here does so because the constraint made it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
import re
import time

import httpx
import jsonschema
import openai
import pytest
import yaml

from conftest import make_llm
from server_harness import running_server
from structured_schemas import SCHEMAS
from tokenmill import LLM, SamplingParams
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.structured_output import (
    CompiledConstraint,
    ConstraintMatcher,
    InvalidConstraint,
    StructuredOutputBackend,
)

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Reply in JSON"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def url(model_dir):
    engine = make_llm(model_dir("llama"), max_num_seqs=16).llm_engine
    with running_server(engine, served_model_name=[MODEL]) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def _valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_reply_follows_its_json_schema(client, name):
    """Greedy, sampled (n = 3) and streamed replies all parse and validate."""
    schema = SCHEMAS[name]
    fmt = _json_schema(schema)
    greedy = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0,
                                            response_format=fmt)
    sampled = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, temperature=1.0,
                                             n=3, seed=7, response_format=fmt)
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "stop", choice
        _valid(choice.message.content, schema)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0,
                                            response_format=fmt, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == greedy.choices[0].message.content


def test_unconstrained_replies_are_not_json(client):
    """The control: without a constraint the same requests give text that is not JSON."""
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0)
    with pytest.raises(ValueError):
        json.loads(reply.choices[0].message.content)


def test_completions_take_every_spelling_of_a_constraint(url):
    schema = SCHEMAS["nested_object"]
    for body in ({"structured_outputs": {"json": schema}}, {"guided_json": schema},
                 {"response_format": _json_schema(schema)}):
        response = httpx.post(url + "/v1/completions", json={
            "model": MODEL, "prompt": ["A user:", "Another"], "max_tokens": 200, "n": 2, "temperature": 1.0,
            "seed": 3, **body}, timeout=120)
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            _valid(choice["text"], schema)


def test_regex_and_choice_match_fully(client, url):
    for pattern in (r"[a-z]{3,8}@[a-z]{2,5}\.com", r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{1,12}\."):
        for field in ("structured_outputs", "guided_regex"):
            body = {"regex": pattern} if field == "structured_outputs" else pattern
            response = httpx.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": "Contact:", "max_tokens": 60, "temperature": 1.0, "n": 3, "seed": 1,
                field: body}, timeout=120).json()
            for choice in response["choices"]:
                assert re.fullmatch(pattern, choice["text"]), (pattern, choice["text"])
                assert choice["finish_reason"] == "stop"
    choices = ["sunny", "rainy", "partly cloudy", "snow"]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, n=3, temperature=1.0,
                                           extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in reply.choices)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, stream=True,
                                            extra_body={"guided_choice": choices})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in choices


#: xgrammar's EBNF: an arithmetic expression of bounded depth
GRAMMAR = r"""
root ::= expr
expr ::= term (" " op " " term){0,2}
term ::= num | "(" num " " op " " num ")"
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]?
"""


def _parse_expr(text: str) -> int:
    """A parser for GRAMMAR's language, independent of the grammar engine: evaluates it."""
    tokens = re.findall(r"\d+|[()+*-]|\S", text)
    assert "".join(tokens) == text.replace(" ", ""), text
    assert re.fullmatch(r"[0-9()+*\- ]+", text), text
    return eval(compile(text, "<expr>", "eval"), {"__builtins__": {}})  # digits, spaces, ()+-* only


def test_an_ebnf_grammar_parses(client, url):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, n=3, temperature=1.0,
                                           seed=5, extra_body={"structured_outputs": {"grammar": GRAMMAR}})
    older = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Sum:", "max_tokens": 60, "n": 3,
                                                      "temperature": 1.0, "guided_grammar": GRAMMAR}, timeout=60)
    texts = [c.message.content for c in reply.choices] + [c["text"] for c in older.json()["choices"]]
    assert all(c.finish_reason == "stop" for c in reply.choices)
    for text in texts:
        assert isinstance(_parse_expr(text), int)


def test_json_object_replies_are_objects(client):
    replies = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, n=3, temperature=1.0,
                                             seed=11, response_format={"type": "json_object"})
    finished = [c for c in replies.choices if c.finish_reason == "stop"]
    assert finished, "no reply closed its object within 300 tokens"
    assert all(isinstance(json.loads(c.message.content), dict) for c in finished)


def test_logprobs_and_stop_strings_compose_with_a_constraint(client):
    schema = SCHEMAS["array_of_objects"]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0,
                                           logprobs=True, top_logprobs=2, response_format=_json_schema(schema))
    choice = reply.choices[0]
    _valid(choice.message.content, schema)
    *tokens, eos = choice.logprobs.content  # the EOS the completed constraint allowed is reported too
    assert "".join(t.token for t in tokens) == choice.message.content and eos.token == "<|eos|>"
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, temperature=0,
                                         stop=['"y"'], response_format=_json_schema(schema))
    assert cut.choices[0].finish_reason == "stop" and choice.message.content.startswith(cut.choices[0].message.content)


@pytest.mark.parametrize("body,param", [
    ({"response_format": _json_schema({"type": "nonsense"})}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[", "structured_outputs": {"regex": "a"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_invalid_constraints_are_a_400_naming_the_field(url, body, param):
    response = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                              "max_tokens": 5, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_named_tool_choice_returns_valid_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = WEATHER["function"]["parameters"]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100, n=2, temperature=1.0,
                                           seed=2, tools=[WEATHER, TIME], tool_choice=named)
    for choice in reply.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_") and choice.message.content is None
        _valid(call.function.arguments, schema)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100, temperature=0,
                                            tools=[WEATHER, TIME], tool_choice=named, stream=True)
    calls: dict[int, dict] = {}
    for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            call["arguments"] += delta.function.arguments or ""
    [call] = calls.values()
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    _valid(call["arguments"], schema)


def test_required_tool_choice_returns_calls_of_the_given_tools(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, n=3, temperature=1.0,
                                           seed=4, tools=[WEATHER, TIME], tool_choice="required",
                                           parallel_tool_calls=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        _valid(call.function.arguments, schemas[call.function.name])
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                            tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                                            stream=True)
    deltas = [d for chunk in stream if chunk.choices for d in chunk.choices[0].delta.tool_calls or []]
    [delta] = deltas
    _valid(delta.function.arguments, schemas[delta.function.name])


def test_auto_tool_choice_reads_calls_with_the_servers_parser(model_dir):
    """tool_choice auto: the text is read by --tool-call-parser (here hermes); the control
    reply (no call in the text) stays content."""
    engine = make_llm(model_dir("llama")).llm_engine
    with running_server(engine, served_model_name=[MODEL], enable_auto_tool_choice=True,
                        tool_call_parser="hermes") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        call = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
        forced = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                                tools=[WEATHER, TIME], tool_choice="auto",
                                                extra_body={"structured_outputs": {"choice": [call]}})
        [made] = forced.choices[0].message.tool_calls
        assert made.function.name == "get_time" and json.loads(made.function.arguments) == {"zone": "utc"}
        assert forced.choices[0].finish_reason == "tool_calls"
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0,
                                                tools=[WEATHER, TIME], stream=True,
                                                extra_body={"structured_outputs": {"choice": [call]}})
        chunks = [c.choices[0] for c in stream if c.choices]
        deltas = [d for c in chunks for d in c.delta.tool_calls or []]
        assert deltas[0].function.name == "get_time" and deltas[0].id.startswith("call_")
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"zone": "utc"}
        assert not "".join(c.delta.content or "" for c in chunks).strip() and chunks[-1].finish_reason == "tool_calls"
        plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                               tools=[WEATHER, TIME])
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


class _Matcher(ConstraintMatcher):
    """Follows a token trie of the choices."""

    def __init__(self, sequences: list[list[int]], eos: tuple[int, ...]) -> None:
        self.sequences, self.eos, self.taken = sequences, eos, []

    def _live(self) -> list[list[int]]:
        return [s for s in self.sequences if s[:len(self.taken)] == self.taken]

    def fill_bitmask(self, bitmask, row) -> None:
        bitmask[row] = 0
        allowed = {s[len(self.taken)] for s in self._live() if len(s) > len(self.taken)}
        for token in allowed:
            word, bit = divmod(token, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def accept_token(self, token: int) -> bool:
        if token in self.eos and self.is_terminated():
            return True
        if not any(len(s) > len(self.taken) and s[len(self.taken)] == token for s in self._live()):
            return False
        self.taken.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.taken[len(self.taken) - num_tokens:]

    def is_terminated(self) -> bool:
        return any(s == self.taken for s in self.sequences)


class _Compiled(CompiledConstraint):
    def __init__(self, sequences, eos) -> None:
        self.sequences, self.eos = sequences, eos

    def new_matcher(self) -> ConstraintMatcher:
        return _Matcher(self.sequences, self.eos)


class ChoiceOnlyBackend(StructuredOutputBackend):
    """A backend written here: choices only, compiled slowly when a choice says "slow"."""

    compile_seconds = 3.0

    def supports(self, kind: str) -> bool:
        return kind == "choice"

    def compile(self, params) -> CompiledConstraint:
        choices = json.loads(params.spec)
        if any(not c.isprintable() for c in choices):
            raise InvalidConstraint("choices must be printable")
        if any("slow" in c for c in choices):
            time.sleep(self.compile_seconds)
        tokenizer = self.context.tokenizer
        return _Compiled([tokenizer.encode(c, add_special_tokens=False) for c in choices], self.context.eos_token_ids)


class ChoiceOnlyPlugin:
    @hookimpl
    def register_structured_output_backends(self, register):
        register("choice-only", ChoiceOnlyBackend)


@pytest.fixture(scope="module")
def choice_only_engine(model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("choice-only") / "engine.yaml"
    path.write_text(yaml.safe_dump({"model": str(model_dir("llama")), "structured_outputs": {"backend": "choice-only"},
                                    "cache": {"kv_cache_memory": 32 * 2**20}}))
    pm = make_plugin_manager()
    pm.register_plugin(ChoiceOnlyPlugin(), "test-choice-only")
    from tokenmill.core.config.engine_config import load_config

    return LLM(config=load_config(path), plugin_manager=pm)


def test_a_backend_defined_here_is_selected_from_yaml(choice_only_engine):
    choices = ["red apple", "green pear", "blue plum"]
    outputs = choice_only_engine.generate(["Fruit:"] * 4, [
        SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured_outputs={"choice": choices})
        for s in range(4)], use_tqdm=False)
    assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in outputs)
    from tokenmill.interfaces.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as info:
        choice_only_engine.generate("x", SamplingParams(structured_outputs={"regex": "a+"}), use_tqdm=False)
    assert "does not support regex" in str(info.value)


def test_a_slow_compile_does_not_delay_other_requests(choice_only_engine):
    """While one request's constraint compiles (3 s), another request streams all its tokens."""
    engine = choice_only_engine.llm_engine
    with running_server(engine, served_model_name=[MODEL]) as (url, _):
        async def scenario() -> tuple[float, float, float]:
            async with httpx.AsyncClient(timeout=60) as http:
                start = time.monotonic()
                slow = asyncio.ensure_future(http.post(url + "/v1/completions", json={
                    "model": MODEL, "prompt": "Pick:", "max_tokens": 10,
                    "structured_outputs": {"choice": ["slow one", "slow two"]}}))
                await asyncio.sleep(0.2)
                fast = await http.post(url + "/v1/completions", json={
                    "model": MODEL, "prompt": "Go on:", "max_tokens": 16, "ignore_eos": True, "temperature": 0})
                fast_done = time.monotonic() - start
                slow_response = await slow
                assert slow_response.status_code == 200 and fast.status_code == 200
                assert slow_response.json()["choices"][0]["text"] in ("slow one", "slow two")
                assert len(fast.json()["choices"][0]["text"]) > 0
                return fast_done, time.monotonic() - start, ChoiceOnlyBackend.compile_seconds

        fast_done, slow_done, compile_seconds = asyncio.run(scenario())
    assert fast_done < compile_seconds <= slow_done, (fast_done, slow_done)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constraints_survive_preemption(model_dir, mode):
    """Requests preempted mid-constraint (their matchers rebuilt from the history, or kept
    across a swap) still give exactly the replies an unpressed engine gives."""
    schema = SCHEMAS["array_of_objects"]
    prompts = [f"Order {i}: " + "lorem ipsum " * (8 + i) for i in range(10)]
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_outputs={"json": schema})
              for i in range(10)]
    roomy = make_llm(model_dir("llama")).generate(prompts, params, use_tqdm=False)
    tight = make_llm(model_dir("llama"), num_gpu_blocks_override=24, block_size=8, max_model_len=192,
                     preemption_mode=mode, swap_space="4MiB")
    pressed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    assert [o.outputs[0].text for o in pressed] == [o.outputs[0].text for o in roomy]
    for output in pressed:
        _valid(output.outputs[0].text, schema)


def test_replies_write_properties_in_the_schemas_order(client):
    """The schema's own property order is the reply's (no canonical re-sorting of the schema)."""
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha", "mid"],
              "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "integer", "minimum": 0, "maximum": 9},
                             "mid": {"enum": ["x", "y"]}}}
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                           response_format=_json_schema(schema))
    assert list(json.loads(reply.choices[0].message.content)) == ["zeta", "alpha", "mid"]


def test_a_schema_nested_past_the_bound_is_a_400(url):
    deep: dict = {"type": "integer"}
    for _ in range(80):
        deep = {"type": "array", "items": deep}
    for body in ({"guided_json": json.dumps(deep)}, {"structured_outputs": {"json": json.dumps(deep)}}):
        response = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body},
                              timeout=60)
        assert response.status_code == 400, response.text
        assert "nests deeper" in response.json()["error"]["message"]
    bad = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                         "guided_choice": ["a"], "bad_words": ["a"]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bad_words"


VLLM_STRUCTURED_FIELDS = (Path(__file__).parents[1] / "tokenmill" / "server" /
                          "vllm-0.32-structured-outputs-fields.txt").read_text().splitlines()[1].split()


def test_every_vllm_structured_outputs_field_is_honoured_or_refused_by_name(client):
    """vLLM 0.32's fields of structured_outputs: each one a field here; those that ask for
    what every reply is already (compact JSON) pass, the others are 400s naming them."""
    from tokenmill.server.protocol import StructuredOutputsField

    assert {StructuredOutputsField.model_fields[n].alias or n for n in StructuredOutputsField.model_fields} \
        == set(VLLM_STRUCTURED_FIELDS)
    schema = {"type": "object", "properties": {"id": {"type": "boolean"}}, "required": ["id"]}
    for extra in ({"disable_any_whitespace": True}, {"disable_additional_properties": True},
                  {"disable_additional_properties": False}):
        reply = client.completions.create(model=MODEL, prompt="Item: ", max_tokens=40, temperature=0,
                                          extra_body={"structured_outputs": {"json": schema, **extra}})
        text = reply.choices[0].text  # compact: only xgrammar's fixed separators
        assert set(json.loads(text)) == {"id"} and text == json.dumps(json.loads(text))
    for name, value in (("disable_any_whitespace", False), ("whitespace_pattern", r"[ ]?"),
                        ("structural_tag", "{}")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                      extra_body={"structured_outputs": {"json": schema, name: value}})
        assert refused.value.body["param"] == f"structured_outputs.{name}"


def test_disable_additional_properties_closes_every_object_that_does_not_say():
    from tokenmill.interfaces.structured_output import StructuredOutputsParams

    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {"a": {"type": "string"}}},
                                               "open": {"type": "object", "additionalProperties": True}}}
    closed = StructuredOutputsParams(json=schema, disable_additional_properties=True).json
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True  # the schema's own word stands
    assert "additionalProperties" not in StructuredOutputsParams(json=schema).json
