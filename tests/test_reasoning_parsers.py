"""Reasoning parsers (``--reasoning-parser``): a reasoning model's thinking comes back as
``reasoning_content`` beside the answer, whole or streamed, and a stream cut at any point
gives the whole reply's parts; a constrained reply is constrained in its answer only (after
the thinking, as in vLLM); through a real server with the ``openai`` client. Replies that
think are scripted (tests/scripted_reply.py): the tiny model's own never hold the markers."""

from __future__ import annotations

import itertools
import json

import jsonschema
import openai
import pytest

from conftest import PREEMPTING, assert_preempted, make_llm
from server_harness import running_server
from tokenmill import SamplingParams
from tokenmill.interfaces.structured_output import StructuredOutputsParams
from tokenmill.plugins.reasoning_parsers.think_tags import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from tokenmill.server.reasoning import ReasoningStream

TEXTS = ["<think>\nI add 2 and 2.\n</think>\n\nThe answer is 4.", "I add 2 and 2.</think>4", "plain answer",
         "<think>cut short", "<think></think>only the answer", "<thinking>? no</think", "</think>", "<th", "",
         "a<think>b</think>c", "x</think>y</think>z"]
EXPECTED = {
    "deepseek_r1": {TEXTS[0]: ("\nI add 2 and 2.\n", "\n\nThe answer is 4."), TEXTS[1]: ("I add 2 and 2.", "4"),
                    TEXTS[2]: ("plain answer", None), TEXTS[3]: ("cut short", None),
                    TEXTS[4]: (None, "only the answer"), TEXTS[6]: (None, None),
                    TEXTS[10]: ("x", "y</think>z")},
    "qwen3": {TEXTS[0]: ("\nI add 2 and 2.\n", "\n\nThe answer is 4."), TEXTS[1]: (None, TEXTS[1]),
              TEXTS[2]: (None, "plain answer"), TEXTS[3]: ("cut short", None), TEXTS[4]: (None, "only the answer"),
              TEXTS[7]: (None, "<th"), TEXTS[9]: (None, "a<think>b</think>c")},
}
PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser(None), "qwen3": Qwen3ReasoningParser(None)}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_whole_replies_split_as_vllm_does(name):
    for text, expected in EXPECTED[name].items():
        assert PARSERS[name].split(text, True) == expected, text


def _streamed(parser, text: str, cuts: tuple[int, ...]) -> tuple[str, str]:
    stream, reasoning, content = ReasoningStream(parser), "", ""
    bounds = [0, *cuts, len(text)]
    for end, last in zip(bounds[1:], [False] * len(cuts) + [True]):
        thinking, answer = stream.feed(text[:end], last)
        reasoning, content = reasoning + thinking, content + answer
    return reasoning, content


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_stream_cut_anywhere_gives_the_whole_replys_parts(name):
    """Every text, in one-character deltas and in two deltas cut at every boundary: the
    concatenated reasoning and content deltas are the whole reply's parts."""
    parser = PARSERS[name]
    for text in TEXTS:
        reasoning, content = parser.split(text, True)
        whole = (reasoning or "", content or "")
        assert _streamed(parser, text, tuple(range(1, len(text)))) == whole, text
        for cut in range(len(text) + 1):
            assert _streamed(parser, text, (cut,)) == whole, (text, cut)
        for cuts in itertools.combinations(range(1, len(text)), 2) if len(text) < 24 else ():
            assert _streamed(parser, text, cuts) == whole, (text, cuts)


def test_a_partial_marker_is_held_back_until_it_is_decided():
    stream = ReasoningStream(PARSERS["deepseek_r1"])
    assert stream.feed("think </th", False) == ("think ", "")
    assert stream.feed("think </thx", False) == ("</thx", "")
    assert stream.feed("think </thx</think>ok", True) == ("", "ok")


SCRIPTED = ["scripted_reply:ScriptedReply"]
#: a template that writes reasoning_effort into the prompt, and closes the thinking in it when
#: thinking is off (as Qwen3's does with enable_thinking=False)
TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
            "{% if reasoning_effort == 'high' %} think very hard about it{% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")


@pytest.fixture(scope="module")
def served(model_dir):
    """A server per parser over the tiny Llama (whose own replies never hold the markers: the
    deepseek_r1 parser reads each as thinking cut short, qwen3 as an answer)."""
    servers = {}
    with running_server(make_llm(model_dir("llama"), logits_processors=SCRIPTED).llm_engine,
                        served_model_name=["m"], reasoning_parser="deepseek_r1", chat_template=TEMPLATE) as (r1, _), \
            running_server(make_llm(model_dir("llama"), logits_processors=SCRIPTED).llm_engine,
                           served_model_name=["m"], reasoning_parser="qwen3", chat_template=TEMPLATE) as (qwen, _):
        servers["deepseek_r1"], servers["qwen3"] = r1, qwen
        yield servers


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)


def test_replies_carry_reasoning_content_whole_and_streamed(served, model_dir):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    args = dict(model="m", messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    for name, base in served.items():
        client = _client(base)
        whole = client.chat.completions.create(**args).choices[0].message
        reasoning = content = ""
        for chunk in client.chat.completions.create(**args, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
            content += (delta.content or "") if delta else ""
        text = (whole.reasoning_content or "") + (whole.content or "")
        assert text and (reasoning, content) == (whole.reasoning_content or "", whole.content or "")
        if name == "deepseek_r1":
            assert whole.content is None and whole.reasoning_content == text
        else:
            assert whole.reasoning_content is None and whole.content == text
        hidden = client.chat.completions.create(**{**args, "extra_body": {"ignore_eos": True,
                                                                          "include_reasoning": False}})
        assert getattr(hidden.choices[0].message, "reasoning_content", None) is None


def test_reasoning_effort_reaches_the_chat_template(served):
    client = _client(served["deepseek_r1"])
    usage = {effort: client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1, reasoning_effort=effort).usage
        for effort in ("low", "high")}
    assert usage["high"].prompt_tokens > usage["low"].prompt_tokens


SCHEMA = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_a_constraint_holds_in_the_answer_after_the_thinking(served, name):
    """The reply thinks freely (the scripted thinking is no JSON), then answers under the
    constraint: structured outputs, and a required tool call read from the answer alone."""
    client = _client(served[name])
    args = dict(model="m", messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=40, temperature=0,
                extra_body={"vllm_xargs": {"scripted_reply": "<think>Two and two: four.</think>"},
                            "structured_outputs": {"json": SCHEMA}})
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.message.reasoning_content == "Two and two: four."
    jsonschema.validate(json.loads(whole.message.content), SCHEMA)
    assert whole.finish_reason == "stop"
    reasoning = content = ""
    for chunk in client.chat.completions.create(**args, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
        content += (delta.content or "") if delta else ""
    assert (reasoning, content) == (whole.message.reasoning_content, whole.message.content)

    called = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=200, temperature=0,
        tools=[WEATHER], tool_choice="required",
        extra_body={"vllm_xargs": {"scripted_reply": "<think>Ask the tool.</think>"}}).choices[0].message
    assert called.reasoning_content == "Ask the tool."
    [call] = called.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_prompt_that_closed_the_thinking_is_constrained_from_the_first_token(served):
    """Thinking off (the template closes an empty block in the prompt): no </think> to wait
    for, so the whole reply is the constrained answer."""
    reply = _client(served["qwen3"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA}, "chat_template_kwargs": {"enable_thinking": False}})
    message = reply.choices[0].message
    assert message.reasoning_content is None
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_a_reply_that_never_ends_its_thinking_stays_free(served):
    """Until the marker, the constraint holds back nothing: the tiny model's own words (no
    JSON) fill the thinking, as vLLM leaves a reply that thinks to its length limit."""
    reply = _client(served["deepseek_r1"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
    assert reply.finish_reason == "length" and reply.message.content is None
    assert len(reply.message.reasoning_content) > 3


def test_a_constraint_that_starts_after_a_marker_survives_preemption(model_dir):
    """Offline (StructuredOutputsParams.starts_after): rows preempted and resumed replay their
    history, marker included, and still answer under the constraint."""
    llm = make_llm(model_dir("llama"), logits_processors=SCRIPTED, **PREEMPTING)
    marker = llm.get_tokenizer().encode("</think>", add_special_tokens=False)
    params = [SamplingParams(temperature=0, max_tokens=60, extra_args={"scripted_reply": f"step {i} " * 3 + "</think>"},
                             structured_outputs=StructuredOutputsParams(json=SCHEMA, starts_after=marker))
              for i in range(8)]
    outputs = llm.generate(["count to ten " * (4 + i) for i in range(8)], params, use_tqdm=False)
    assert_preempted(llm, "recompute")
    for i, output in enumerate(outputs):
        thinking, answer = output.outputs[0].text.split("</think>")
        assert thinking == f"step {i} " * 3
        jsonschema.validate(json.loads(answer), SCHEMA)


def test_a_parser_that_cannot_place_the_answer_refuses_constraints(model_dir):
    """A third-party parser without constraint_starts_after: a constrained request gets a 400
    naming the request's field."""
    from transformers import AutoTokenizer

    from tokenmill.interfaces.reasoning_parser import ReasoningParser
    from tokenmill.server.reasoning import constraint_after_thinking
    from tokenmill.server.errors import APIError

    class SplitsOnly(ReasoningParser):
        def split(self, text, final):
            return None, text

    with pytest.raises(APIError, match="SplitsOnly reasoning parser cannot say where") as refused:
        constraint_after_thinking(SplitsOnly(None), AutoTokenizer.from_pretrained(model_dir("llama")),
                                  StructuredOutputsParams(choice=("a",), param="tool_choice"), [1, 2])
    assert refused.value.param == "tool_choice"


def test_an_unknown_parser_fails_at_startup(model_dir):
    from tokenmill.interfaces.errors import ConfigError

    with pytest.raises(ConfigError, match="no reasoning parser 'nope'"):
        with running_server(make_llm(model_dir("llama")).llm_engine, reasoning_parser="nope"):
            pass


def test_offline_text_is_untouched(model_dir):
    """The parser is the server's: LLM.generate returns the model's text as it is."""
    [output] = make_llm(model_dir("llama")).generate("hi", SamplingParams(max_tokens=3, temperature=0),
                                                      use_tqdm=False)
    assert output.outputs[0].text
