"""Reasoning parsers (``--reasoning-parser``): a reasoning model's thinking comes back as
``reasoning_content`` beside the answer, whole or streamed, and a stream cut at any point
gives the whole reply's parts; through a real server with the ``openai`` client."""

from __future__ import annotations

import itertools

import openai
import pytest

from conftest import make_llm
from server_harness import running_server
from tokenmill import SamplingParams
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


@pytest.fixture(scope="module")
def served(model_dir):
    """A server per parser over the tiny Llama (whose replies never hold the markers: the
    deepseek_r1 parser reads each as thinking cut short, qwen3 as an answer), with a chat
    template that writes reasoning_effort into the prompt."""
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if reasoning_effort == 'high' %} think very hard about it{% endif %}")
    servers = {}
    with running_server(make_llm(model_dir("llama")).llm_engine, served_model_name=["m"],
                        reasoning_parser="deepseek_r1", chat_template=template) as (r1, _), \
            running_server(make_llm(model_dir("llama")).llm_engine, served_model_name=["m"],
                           reasoning_parser="qwen3") as (qwen, _):
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


def test_a_constraint_with_a_reasoning_parser_is_refused_by_name(served):
    with pytest.raises(openai.BadRequestError) as refused:
        _client(served["qwen3"]).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert refused.value.body["param"] == "structured_outputs"


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
