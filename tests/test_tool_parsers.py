"""Tool-call parsers (``hermes``, ``llama3_json``): whole replies, and the same replies streamed
in every way we can cut them, must give the same calls and content, with no markup as content."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.interfaces.tool_parser import DeltaMessage, ToolParser, make_tool_call_id
from tokenmill.plugins.tool_parsers.hermes import HermesToolParser
from tokenmill.plugins.tool_parsers.llama3_json import Llama3JsonToolParser

ID = re.compile(r"call_[0-9a-f]{24}")
HERMES_MARKUP = ("<tool_call>", "</tool_call>")
LLAMA_MARKUP = ("<|python_tag|>",)


# -- helpers ----------------------------------------------------------------------------------

def stream(cls, deltas: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """Feed deltas as the server does, then finish: (content, [(id, name, arguments)]).

    Checks the shape of what comes out on the way: a call's first piece carries its id and
    name, later ones only arguments; indices come 0, 1, 2...; one piece per call per message.
    """
    parser = cls(None)
    messages: list[DeltaMessage] = []
    previous = ""
    for delta in deltas:
        current = previous + delta
        message = parser.extract_tool_calls_streaming(previous, current, delta)
        previous = current
        if message is not None:
            messages.append(message)
    message = parser.finish_streaming()
    if message is not None:
        messages.append(message)
    content = ""
    calls: list[list[str]] = []
    for message in messages:
        assert isinstance(message, DeltaMessage)
        assert message.content or message.tool_calls, "an empty message should be None"
        content += message.content or ""
        indices = [piece.index for piece in message.tool_calls]
        assert len(indices) == len(set(indices))
        for piece in message.tool_calls:
            if piece.index == len(calls):  # a new call: its first piece
                assert piece.id is not None and ID.fullmatch(piece.id), piece
                assert piece.name, piece
                calls.append([piece.id, piece.name, piece.arguments or ""])
            else:
                assert piece.index < len(calls), f"call {piece.index} skipped ahead of {len(calls)}"
                assert piece.id is None and piece.name is None, f"name sent twice: {piece}"
                assert piece.arguments, piece
                calls[piece.index][2] += piece.arguments
    return content, [tuple(call) for call in calls]


def cuts(text: str, markup: tuple[str, ...]) -> list[list[str]]:
    """Ways to cut ``text`` into deltas: fixed sizes, two pieces cut at every position, three
    pieces cut at every pair of positions inside each markup tag, and random cuts."""
    ways = [[text]]
    for n in (1, 2, 3, 5, 7, 13):
        ways.append([text[i:i + n] for i in range(0, len(text), n)])
    for k in range(len(text) + 1):
        ways.append([text[:k], text[k:]])
    for tag in markup:
        for start in (m.start() for m in re.finditer(re.escape(tag), text)):
            for a in range(start, start + len(tag) + 1):
                for b in range(a, start + len(tag) + 1):
                    ways.append([text[:a], text[a:b], text[b:]])
    rng = random.Random(hash(text) & 0xFFFF)
    for _ in range(20):
        points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        ways.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)])])
    return ways


def check_non_streaming(cls, text, calls, content):
    extracted = cls(None).extract_tool_calls(text)
    assert extracted.tools_called == bool(calls)
    assert [(c.name, json.loads(c.arguments)) for c in extracted.tool_calls] == calls
    assert all(ID.fullmatch(c.id) for c in extracted.tool_calls)
    assert extracted.content == content
    return extracted


def check_streaming_matches(cls, text, markup):
    """Every way of cutting ``text`` streams the non-streaming content and exact arguments."""
    expected = cls(None).extract_tool_calls(text)
    for deltas in cuts(text, markup):
        content, calls = stream(cls, deltas)
        assert content == (expected.content or ""), deltas
        assert [(name, args) for _, name, args in calls] == [(c.name, c.arguments) for c in expected.tool_calls], deltas
        if expected.tools_called and not any(tag in (expected.content or "") for tag in markup):
            assert not any(tag in content for tag in markup), deltas


# -- hermes -----------------------------------------------------------------------------------

NESTED_ARGS = {"traveller": {"name": "Zoë", "tags": ["vip", {"seat": "1A", "meal": None}]},
               "city": "São Paulo", "emoji": "🚀", "note": 'say "hi"\n\ttab \\ /',
               "n": [0, -1.5, 2000.0, 1e-07, True, False, 12345678901234567890], "empty": {}, "list": []}
NESTED_RAW = ('{"traveller": {"name": "Zoë", "tags": ["vip", {"seat": "1A", "meal": null}]}, '
              '"city": "S\\u00e3o Paulo", "emoji": "\\ud83d\\ude80", "note": "say \\"hi\\"\\n\\ttab \\\\ \\/", '
              '"n": [0, -1.50, 2e3, 1E-7, true, false, 12345678901234567890], "empty": { }, "list": [ ]}')

HERMES_CASES = {
    "no call": ("The capital of France is Paris. 2 < 3, <b>bold</b> and a {brace}.", [],
                "The capital of France is Paris. 2 < 3, <b>bold</b> and a {brace}."),
    "one call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
                 '\n</tool_call>', [("get_weather", {"city": "Paris", "unit": "celsius"})], None),
    "two calls": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>\n',
                  [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})], None),
    "content before a call": ('Let me look that up.\n<tool_call>\n{"name": "search", "arguments": {"q": "tokenmill"}}'
                              '\n</tool_call>', [("search", {"q": "tokenmill"})], "Let me look that up.\n"),
    "content around calls": ('First: <tool_call>{"name": "a", "arguments": {}}</tool_call> then '
                             '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call> done.',
                             [("a", {}), ("b", {"x": 1})], "First:  then  done."),
    "nested and unicode arguments": (f'<tool_call>{{"name": "book", "arguments": {NESTED_RAW}}}</tool_call>',
                                     [("book", NESTED_ARGS)], None),
    "arguments before the name": ('<tool_call> {"arguments": {"x": [1, 2]}, "name": "f", "extra": [{"y": 1}]} '
                                  '</tool_call>', [("f", {"x": [1, 2]})], None),
    "markup in a string": ('<tool_call>{"name": "echo", "arguments": {"s": "<tool_call> a </tool_call"}}</tool_call>',
                           [("echo", {"s": "<tool_call> a </tool_call"})], None),
    "unclosed block": ('Sure.<tool_call>{"name": "f", "arguments": {"a": "b"}}\n', [("f", {"a": "b"})], "Sure."),
    "non-object arguments": ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', [("f", "x=1")], None),
}
# not calls: the whole reply is content, streamed or not
HERMES_INVALID = [
    '<tool_call>{"name": get_weather, "arguments": {}}</tool_call>',
    "<tool_call>not json at all</tool_call>",
    "<tool_call></tool_call>",
    '<tool_call>{"name": "f"}</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>["f", {}]</tool_call>',
    'Hi <tool_call>{"arguments": {"a": 1}, "name": }</tool_call> bye',
    '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>',
    "a <tool_cal b </tool_call> c <tool_call",
    "trailing partial tag <tool_ca",
    "  \n ",
    "",
]
# invalid only after the call's name could be sent: whole replies are content, streams differ
HERMES_INVALID_LATE = [
    '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',
    'Text <tool_call>{"name": "f", "arguments": {"a": 1}',
    '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": "</tool_call>"}}</tool_call>',
]


@pytest.mark.parametrize("case", sorted(HERMES_CASES))
def test_hermes_extracts_calls_and_content(case):
    text, calls, content = HERMES_CASES[case]
    check_non_streaming(HermesToolParser, text, calls, content)


@pytest.mark.parametrize("case", sorted(HERMES_CASES))
def test_hermes_streaming_matches_non_streaming(case):
    text = HERMES_CASES[case][0]
    check_streaming_matches(HermesToolParser, text, HERMES_MARKUP)


@pytest.mark.parametrize("text", HERMES_INVALID + HERMES_INVALID_LATE)
def test_hermes_invalid_markup_is_content(text):
    check_non_streaming(HermesToolParser, text, [], text)


@pytest.mark.parametrize("text", HERMES_INVALID)
def test_hermes_invalid_markup_streams_as_content(text):
    check_streaming_matches(HermesToolParser, text, HERMES_MARKUP)


def test_hermes_an_invalid_block_stays_content_beside_valid_calls():
    text = ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{oops}</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    check_non_streaming(HermesToolParser, text, [("f", {"a": 1}), ("g", {})], "\n<tool_call>{oops}</tool_call>")
    check_streaming_matches(HermesToolParser, text, HERMES_MARKUP)


@pytest.mark.parametrize("text", HERMES_INVALID_LATE)
def test_hermes_late_invalid_markup_never_raises_nor_leaks(text):
    """A call whose name went out stays sent, and the rest of its block is not sent as content:
    the content is the text around the block. Cut where the error shows before the name could
    go out (one delta), the reply is content, as when not streaming."""
    start = text.index("<tool_call>")
    end = text.find("</tool_call>")
    around = [text[:start], text[end + len("</tool_call>"):] if end >= 0 else ""]
    outside = "".join(part for part in around if part.strip())
    if end >= 0:  # a block that never closes can only be judged at the end, after it was sent
        assert stream(HermesToolParser, [text]) == (text, [])
    assert stream(HermesToolParser, list(text))[1], "the name goes out before the error shows"
    for deltas in cuts(text, HERMES_MARKUP):
        content, calls = stream(HermesToolParser, deltas)
        assert [name for _, name, _ in calls] in ([], ["f"])
        assert content == (outside if calls else text), deltas


def test_hermes_streams_content_before_a_call_at_once():
    """Plain text goes out with its own delta; only a possible tag start waits."""
    parser = HermesToolParser(None)
    text = ""

    def send(delta):
        nonlocal text
        previous, text = text, text + delta
        return parser.extract_tool_calls_streaming(previous, text, delta)

    assert send("Hello") == DeltaMessage(content="Hello")
    assert send(" <tool") == DeltaMessage(content=" ")
    assert send("_call>") is None
    first = send('{"name": "f", "arguments": {"a"')
    assert first.content is None and [(c.index, c.name, c.arguments) for c in first.tool_calls] == [(0, "f", '{"a"')]
    assert send(': 1}}</tool_call>').tool_calls[0].arguments == ": 1}"
    assert send("") is None
    assert parser.finish_streaming() is None


# -- llama3_json ------------------------------------------------------------------------------

LLAMA_CASES = {
    "no call": ("The answer is 42; see {the docs}.", [], "The answer is 42; see {the docs}."),
    "one call": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
                 [("get_weather", {"city": "Paris", "unit": "celsius"})], None),
    "python tag": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
                   [("get_weather", {"city": "Paris"})], None),
    "two calls": ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [2, 3]}}',
                  [("a", {"x": 1}), ("b", {"y": [2, 3]})], None),
    "two calls, tight, arguments": ('<|python_tag|> {"name": "a", "parameters": {}};'
                                    '{"name": "b", "arguments": {"k": "v"}};\n', [("a", {}), ("b", {"k": "v"})], None),
    "content before a call is not a call": ('Here you go: {"name": "f", "parameters": {}}', [],
                                            'Here you go: {"name": "f", "parameters": {}}'),
    "nested and unicode arguments": (f'  {{"name": "book", "parameters": {NESTED_RAW}}}\n',
                                     [("book", NESTED_ARGS)], None),
    "parameters before the name": ('{"parameters": {"q": "x"}, "name": "search"}', [("search", {"q": "x"})], None),
}
LLAMA_INVALID = [
    '{"result": 42}',
    '{"name": "Bob", "age": 3}',
    '{"name": f, "parameters": {}}',
    "[1, 2, 3]",
    '<|python_tag|>print("hi")',
    "<|python_tag|>",
    "<|python",
    "{",
    "  ",
    "",
]
LLAMA_INVALID_LATE = [
    '{"name": "f", "parameters": {"a": }}',
    '{"name": "f", "parameters": {}} and some words',
    '{"name": "f", "parameters": {}, "arguments": {}}',
    '{"name": "f", "parameters": {}}; {"name": "g"}',
    '{"name": "f", "parameters": {"a": 1',  # cut short: judged only at the end
]


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama3_json_extracts_calls_and_content(case):
    text, calls, content = LLAMA_CASES[case]
    check_non_streaming(Llama3JsonToolParser, text, calls, content)


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama3_json_streaming_matches_non_streaming(case):
    check_streaming_matches(Llama3JsonToolParser, LLAMA_CASES[case][0], LLAMA_MARKUP)


@pytest.mark.parametrize("text", LLAMA_INVALID + LLAMA_INVALID_LATE)
def test_llama3_json_invalid_is_content(text):
    check_non_streaming(Llama3JsonToolParser, text, [], text)


@pytest.mark.parametrize("text", LLAMA_INVALID)
def test_llama3_json_invalid_streams_as_content(text):
    check_streaming_matches(Llama3JsonToolParser, text, LLAMA_MARKUP)


@pytest.mark.parametrize("text", LLAMA_INVALID_LATE)
def test_llama3_json_late_invalid_never_raises_nor_leaks(text):
    """As for hermes: a call sent stays sent, and nothing of the reply becomes content then."""
    if text != LLAMA_INVALID_LATE[-1]:  # within one delta, calls not sent yet are taken back
        assert stream(Llama3JsonToolParser, [text]) == (text, [])
    assert stream(Llama3JsonToolParser, list(text))[1], "the name goes out before the error shows"
    for deltas in cuts(text, LLAMA_MARKUP):
        content, calls = stream(Llama3JsonToolParser, deltas)
        assert [name for _, name, _ in calls] in ([], ["f"])
        assert content == ("" if calls else text), deltas


# -- generated replies ------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
calls_st = st.lists(st.tuples(names, st.dictionaries(st.text(max_size=5), json_values, max_size=4)),
                    min_size=1, max_size=3)


@st.composite
def dumped(draw, value):
    """``value`` as a model might write it: any spacing, escaped non-ASCII or not."""
    indent = draw(st.sampled_from([None, 0, 2]))
    separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" , ", " :  ")]))
    return json.dumps(value, indent=indent, separators=separators, ensure_ascii=draw(st.booleans()))


@st.composite
def call_object(draw, name, args, args_key):
    pairs = [("name", name), (args_key, args)]
    if draw(st.booleans()):
        pairs.reverse()
    body = ", ".join(f"{json.dumps(key)}: {draw(dumped(value))}" for key, value in pairs)
    return "{" + body + "}"


def random_cut(draw, text):
    points = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


plain_text = st.text(st.sampled_from(list("ab <>/_{}\n tool_call")), max_size=12).filter(
    lambda s: "<tool_call>" not in s and not s.endswith("<tool_call"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), calls=calls_st)
def test_hermes_generated_replies(data, calls):
    pieces = [data.draw(plain_text)]
    for name, args in calls:
        body = data.draw(call_object(name, args, "arguments"))
        space = data.draw(st.sampled_from(["", "\n", " "]))
        pieces.append(f"<tool_call>{space}{body}\n</tool_call>")
        pieces.append(data.draw(plain_text))
    text = "".join(pieces)
    outside = "".join(p for p in pieces[::2] if p.strip()) or None
    expected = check_non_streaming(HermesToolParser, text, [(n, json.loads(json.dumps(a))) for n, a in calls], outside)
    content, streamed = stream(HermesToolParser, random_cut(data.draw, text))
    assert content == (outside or "")
    assert [(n, a) for _, n, a in streamed] == [(c.name, c.arguments) for c in expected.tool_calls]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), calls=calls_st)
def test_llama3_json_generated_replies(data, calls):
    objects = [data.draw(call_object(n, a, data.draw(st.sampled_from(["parameters", "arguments"])))) for n, a in calls]
    text = data.draw(st.sampled_from(["", " ", "<|python_tag|>", "\n<|python_tag|> "])) + "".join(
        obj + (data.draw(st.sampled_from([";", "; ", " ;\n"])) if i < len(objects) - 1 else "")
        for i, obj in enumerate(objects))
    expected = check_non_streaming(Llama3JsonToolParser, text, [(n, json.loads(json.dumps(a))) for n, a in calls], None)
    content, streamed = stream(Llama3JsonToolParser, random_cut(data.draw, text))
    assert content == ""
    assert [(n, a) for _, n, a in streamed] == [(c.name, c.arguments) for c in expected.tool_calls]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), cls=st.sampled_from([HermesToolParser, Llama3JsonToolParser]))
def test_garbage_never_raises(data, cls):
    """Any text, cut anywhere: no exception, well-formed deltas, and a stream without calls
    sends the text unchanged."""
    bits = list('<tool_call>/{}[]":,;\\u0 a\n') + [
        "<tool_call>", "</tool_call>", "<|python_tag|>",
        '{"name": "f", "arguments": {', '{"name": "f", "parameters": {']
    text = "".join(data.draw(st.lists(st.sampled_from(bits), max_size=40)))
    extracted = cls(None).extract_tool_calls(text)
    content, calls = stream(cls, random_cut(data.draw, text))
    if not calls:
        assert not extracted.tools_called and content == text == extracted.content


# -- the contract and the plugin ----------------------------------------------------------------

def test_ids_and_the_abstract_contract():
    assert ID.fullmatch(make_tool_call_id())
    with pytest.raises(TypeError):
        ToolParser(None)
    for cls in (HermesToolParser, Llama3JsonToolParser):
        assert issubclass(cls, ToolParser)
        assert cls(object()).model_tokenizer is not None


def test_installed_entry_point_registers_both_parsers():
    from tokenmill.core.plugin_host.components import collect_components
    from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager

    components = collect_components(make_plugin_manager())
    registry = components.tool_parsers
    assert {"hermes", "llama3_json"} <= set(registry.names())
    assert registry.get("hermes") is HermesToolParser
    assert registry.get("llama3_json") is Llama3JsonToolParser
    plugins = {entry.name: entry.plugin for entry in registry.entries()}
    assert plugins["hermes"] == plugins["llama3_json"] == "tool_parsers"
    assert components.by_kind()["tool_parsers"] is registry
