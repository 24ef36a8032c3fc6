"""Both structured output backends, xgrammar and guidance (llguidance), through the offline
engine over a tiny random-weight model: every schema of structured_schemas.py, regexes,
choices, a grammar in each backend's dialect, refused constraints, the matcher contract
itself, and the backend chosen from a YAML config.

A random-weight model's choices are noise, so every output below is the constraint's doing."""

from __future__ import annotations

import json
import random
import re
import threading

import jsonschema
import pytest
import torch
import yaml

from structured_schemas import SCHEMAS
from tokenmill import LLM, SamplingParams
from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.structured_output import StructuredOutputContext, StructuredOutputsParams

BACKENDS = ("xgrammar", "guidance")
PROMPT = "Answer: "
MAX_TOKENS = 300
SEEDS = (11, 12)


def _params(constraint: dict, seed: int | None = None, n: int = 1) -> SamplingParams:
    sampling = dict(temperature=1.0, seed=seed) if seed is not None else dict(temperature=0.0)
    return SamplingParams(max_tokens=MAX_TOKENS, n=n, structured_outputs=StructuredOutputsParams(**constraint),
                          **sampling)


def _variants(constraint: dict, n: int = 1) -> list[SamplingParams]:
    """Greedy, and one sampled request per seed."""
    return [_params(constraint)] + [_params(constraint, seed, n) for seed in SEEDS]


def _texts(llm: LLM, params: list[SamplingParams]) -> list[list[tuple[str, str]]]:
    """Per request, its completions' (text, finish_reason)."""
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    return [[(c.text, c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module", params=BACKENDS)
def backend_llm(request, model_dir) -> tuple[str, LLM]:
    llm = LLM(str(model_dir("llama")), kv_cache_memory_bytes=32 * 2**20, structured_outputs={"backend": request.param})
    assert llm.llm_engine.structured_outputs.name == request.param
    return request.param, llm


@pytest.fixture(scope="module")
def schema_outputs(backend_llm) -> dict[str, list[list[tuple[str, str]]]]:
    """Every schema's greedy and sampled outputs, from one batch."""
    _, llm = backend_llm
    names = list(SCHEMAS)
    params = [p for name in names for p in _variants({"json": SCHEMAS[name]})]
    texts = _texts(llm, params)
    per = len(SEEDS) + 1
    return {name: texts[i * per:(i + 1) * per] for i, name in enumerate(names)}


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
#: the separators each backend's JSON has: no free whitespace with either, but xgrammar's
#: (its defaults without any_whitespace) have one space after "," and ":"
SEPARATORS = {"xgrammar": (", ", ": "), "guidance": (",", ":")}


def _no_free_whitespace(text: str, separators: tuple[str, str]) -> bool:
    skeleton = _JSON_STRING.sub('""', text)
    for separator in separators:
        skeleton = skeleton.replace(separator, separator.strip())
    return not re.search(r"\s", skeleton)


@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_every_schema_gives_valid_json_without_free_whitespace(backend_llm, schema_outputs, schema):
    name, _ = backend_llm
    greedy, *sampled = schema_outputs[schema]
    unbounded_digits = name == "guidance" and schema == "number_range" and greedy[0][1] == "length"
    for completions in sampled if unbounded_digits else [greedy] + sampled:
        for text, finish in completions:
            assert finish == "stop", text
            value = json.loads(text)  # strict: no raw control characters in strings
            jsonschema.validate(value, SCHEMAS[schema])
            assert _no_free_whitespace(text, SEPARATORS[name]), text
    if unbounded_digits:
        # xgrammar gives a number with bounds at most 6 fraction digits; llguidance bounds its
        # value, not its digits, and the random model's greedy choice after "0.1" is "1" forever
        assert re.fullmatch(r'\{"score":0\.[0-9]+', greedy[0][0]), greedy[0][0]
        pytest.xfail("llguidance: a bounded number may have any number of digits")


REGEXES = (
    r"[a-z]{2,5}-\d{1,3}",
    r"(\+|-)?[0-9]{1,3}(\.[0-9]{1,2})?",
    r"(yes|no|maybe)!?",
    r"/[a-c]{3}/",  # a slash: llguidance wraps a regex in Lark's /.../
    r"\(\d{3}\) \d{3}-\d{4}",
)
CHOICES = ('plain', 'with "quotes"', "back\\slash", "new\nline", "π r²", "/slash/", "(parens)|[bars]")


def test_regexes_are_matched_in_full(backend_llm):
    _, llm = backend_llm
    params = [p for regex in REGEXES for p in _variants({"regex": regex}, n=3)]
    texts = _texts(llm, params)
    for i, regex in enumerate(REGEXES):
        for completions in texts[i * 3:(i + 1) * 3]:
            for text, finish in completions:
                assert finish == "stop" and re.fullmatch(regex, text), (regex, text)


def test_choices_are_one_of_them(backend_llm):
    _, llm = backend_llm
    texts = _texts(llm, _variants({"choice": list(CHOICES)}, n=3))
    assert sum(len(c) for c in texts) == 7
    for completions in texts:
        for text, finish in completions:
            assert finish == "stop" and text in CHOICES, text


def test_a_choice_outside_the_basic_plane(backend_llm):
    """A surrogate-pair escape in xgrammar's EBNF becomes two broken characters, so its choice
    grammar must carry such characters as they are."""
    _, llm = backend_llm
    choices = ["😀 smile", "🙂"]  # every choice outside the plane: a wrong encoding shows every time
    for completions in _texts(llm, _variants({"choice": choices}, n=3)):
        for text, finish in completions:
            assert finish == "stop" and text in choices, text


# -- grammars: calls like add(3,mul(4,5)), nested at most twice, in each backend's dialect

EBNF = r"""root ::= call
call ::= op "(" arg ("," arg)? ")"
leaf ::= op "(" num ("," num)? ")"
arg ::= num | leaf
op ::= "add" | "mul" | "neg"
num ::= [0-9] | [1-9] [0-9]
"""
LARK = r"""start: call
call: OP "(" arg ("," arg)? ")"
leaf: OP "(" NUM ("," NUM)? ")"
arg: NUM | leaf
OP: "add" | "mul" | "neg"
NUM: /[0-9]|[1-9][0-9]/
"""
#: xgrammar reads EBNF; guidance reads Lark, and converts GBNF (which this EBNF also is), as
#: vLLM's guidance backend does
GRAMMARS = {"xgrammar": [EBNF], "guidance": [LARK, EBNF]}


def _evaluate(text: str) -> int:
    """Parse (and evaluate) a sentence of the grammar above; ValueError if it is not one."""
    position = 0

    def expect(literal: str) -> None:
        nonlocal position
        if not text.startswith(literal, position):
            raise ValueError(f"expected {literal!r} at {position} in {text!r}")
        position += len(literal)

    def number() -> int:
        nonlocal position
        match = re.compile(r"[1-9][0-9]|[0-9]").match(text, position)
        if not match:
            raise ValueError(f"expected a number at {position} in {text!r}")
        position = match.end()
        return int(match.group())

    def call(depth: int) -> int:
        op = next((o for o in ("add", "mul", "neg") if text.startswith(o, position)), None)
        if op is None:
            raise ValueError(f"expected an operator at {position} in {text!r}")
        expect(op)
        expect("(")
        args = [argument(depth)]
        if text.startswith(",", position):
            expect(",")
            args.append(argument(depth))
        expect(")")
        return {"add": sum, "mul": lambda a: a[0] * (a[1] if len(a) > 1 else 1), "neg": lambda a: -a[0]}[op](args)

    def argument(depth: int) -> int:
        if depth > 0 and text[position:position + 1].isalpha():
            return call(depth - 1)
        return number()

    value = call(1)
    if position != len(text):
        raise ValueError(f"trailing text at {position} in {text!r}")
    return value


def test_the_grammar_checker_itself():
    assert _evaluate("add(3,mul(4,5))") == 23 and _evaluate("neg(7)") == -7
    for bad in ("add(3,mul(4,neg(1)))", "add(03)", "add(1,2,3)", "sub(1)", "add(1) "):
        with pytest.raises(ValueError):
            _evaluate(bad)


def test_a_grammar_in_the_backends_dialect(backend_llm):
    name, llm = backend_llm
    for grammar in GRAMMARS[name]:
        for completions in _texts(llm, _variants({"grammar": grammar})):
            for text, finish in completions:
                assert finish == "stop", text
                _evaluate(text)


# -- constraints a backend refuses are the request's error

INVALID = [
    {"json": {"type": "foo"}},
    {"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}},
    {"json": {"type": "string", "pattern": "[a-"}},
    {"json": {"type": "integer", "minimum": 5, "maximum": 1}},
    {"json": "{not json"},
    {"regex": "[a-"},
    {"regex": "a{3,1}"},
    {"regex": r"(a)\1"},  # backreferences: neither library has them
]
#: a grammar each backend refuses: a broken one, and the other library's dialect
INVALID_GRAMMARS = {
    "xgrammar": ['root ::= "a" undefined', 'root ::= "a', LARK],
    "guidance": ['start: "a" undefined', 'start: "a', 'root ::= "a" undefined'],
}


def test_invalid_constraints_are_the_requests_error(backend_llm):
    name, llm = backend_llm
    for constraint in INVALID + [{"grammar": g} for g in INVALID_GRAMMARS[name]]:
        with pytest.raises(InvalidRequest, match="invalid") as info:
            llm.generate([PROMPT], _params(constraint), use_tqdm=False)
        assert info.value.param == "structured_outputs", constraint
        assert "\n" not in str(info.value)
    # the engine still serves
    [output] = llm.generate([PROMPT], _params({"regex": "ok"}), use_tqdm=False)
    assert output.outputs[0].text == "ok"


# -- the matcher contract, directly

def _allowed(matcher, vocab: int) -> set[int]:
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    bits = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return set(torch.nonzero(bits).flatten().tolist())


def _mask(matcher, vocab: int, rows: int = 3, row: int = 1, fill: int = 0) -> torch.Tensor:
    bitmask = torch.full((rows, (vocab + 31) // 32), fill, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, row)
    return bitmask


def _manager(llm: LLM):
    return llm.llm_engine.structured_outputs


def test_accept_rollback_and_reaccept_give_the_same_masks(backend_llm):
    name, llm = backend_llm
    tokenizer, manager = llm.get_tokenizer(), _manager(llm)
    vocab, eos = manager.backend.context.vocab_size, manager.backend.context.eos_token_ids
    value = {"user": {"id": 42, "name": "a b"}}  # no escapes: xgrammar's bounded strings have none
    text = json.dumps(value, separators=SEPARATORS[name])
    tokens = tokenizer.encode(text, add_special_tokens=False)
    constraint = manager.compiled(StructuredOutputsParams(json=SCHEMAS["nested_object"]))
    matcher = constraint.new_matcher()
    masks = [_mask(matcher, vocab)]
    for token in tokens:
        assert token in _allowed(matcher, vocab)
        assert matcher.accept_token(token)
        masks.append(_mask(matcher, vocab))
    # complete: only end-of-sequence remains
    assert _allowed(matcher, vocab) == set(eos)
    for k in (1, 3, len(tokens)):
        matcher.rollback(k)
        assert torch.equal(_mask(matcher, vocab), masks[-1 - k]), k
        for token in tokens[len(tokens) - k:]:
            assert matcher.accept_token(token)
        assert torch.equal(_mask(matcher, vocab), masks[-1])
    # end-of-sequence ends it, and is rolled back like any token (llguidance's matcher counts
    # as terminated as soon as nothing but end-of-sequence can follow; xgrammar's once it
    # has accepted end-of-sequence)
    complete = matcher.is_terminated()
    assert matcher.accept_token(eos[0]) and matcher.is_terminated()
    matcher.rollback(1)
    assert matcher.is_terminated() == complete and torch.equal(_mask(matcher, vocab), masks[-1])
    matcher.rollback(1)
    assert not matcher.is_terminated() and torch.equal(_mask(matcher, vocab), masks[-2])
    # the bitmask row is written whole, and no other row is touched
    written = _mask(matcher, vocab, fill=-1)
    assert torch.equal(written[1], masks[-2][1])
    assert (written[0] == -1).all() and (written[2] == -1).all()


def test_a_token_outside_the_mask_is_refused_and_changes_nothing(backend_llm):
    name, llm = backend_llm
    tokenizer, manager = llm.get_tokenizer(), _manager(llm)
    vocab, eos = manager.backend.context.vocab_size, manager.backend.context.eos_token_ids
    matcher = manager.compiled(StructuredOutputsParams(json=SCHEMAS["string"])).new_matcher()
    prefix = tokenizer.encode('{"name":' + SEPARATORS[name][1][1:] + '"', add_special_tokens=False)
    for token in prefix:
        assert matcher.accept_token(token)
    before = _mask(matcher, vocab)
    allowed = _allowed(matcher, vocab)
    refused = sorted(set(range(vocab)) - allowed)
    assert refused and eos[0] in refused  # mid-string: the object cannot end here
    # JSON strings hold no raw control characters
    control = [t for t in range(vocab) if any(ord(c) < 0x20 for c in tokenizer.decode([t]))]
    assert control and not allowed & set(control)
    for token in random.Random(0).sample(refused, 20) + [eos[0]] + control[:3]:
        assert matcher.accept_token(token) is False
        assert torch.equal(_mask(matcher, vocab), before)
    # still usable: finish the object
    for token in tokenizer.encode('ab"}', add_special_tokens=False):
        assert matcher.accept_token(token)
    assert _allowed(matcher, vocab) == set(eos)


@pytest.mark.parametrize("extra", [70, -42], ids=["padded", "narrower"])
def test_a_vocabulary_of_another_width_than_the_tokenizers(backend_llm, extra):
    """Padded embeddings (or a tokenizer with ids the model lacks): the bitmask is the model's
    width, and only ids both know are ever allowed."""
    _, llm = backend_llm
    tokenizer, backend = llm.get_tokenizer(), _manager(llm).backend
    vocab = len(tokenizer) + extra
    instance = type(backend)(StructuredOutputContext(tokenizer, vocab, backend.context.eos_token_ids))
    matcher = instance.compile(StructuredOutputsParams(json_object=True)).new_matcher()
    allowed = _allowed(matcher, vocab)
    assert allowed and max(allowed) < min(vocab, len(tokenizer))
    assert not matcher.accept_token(min(vocab, len(tokenizer)) + 5)
    assert matcher.accept_token(tokenizer.encode("{", add_special_tokens=False)[0])


def test_concurrent_compiles(backend_llm):
    _, llm = backend_llm
    backend = _manager(llm).backend
    names = list(SCHEMAS)[:8]
    results: dict[str, object] = {}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            results[name] = backend.compile(StructuredOutputsParams(json=SCHEMAS[name]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(name,)) for name in names * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and set(results) == set(names)
    vocab = backend.context.vocab_size
    for compiled in results.values():
        assert _allowed(compiled.new_matcher(), vocab)


# -- the backend chosen in YAML

def test_the_guidance_backend_selected_from_yaml(model_dir, tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir("llama")), "cache": {"kv_cache_memory": 32 * 2**20},
                                      "structured_outputs": {"backend": "guidance"}}))
    llm = LLM.from_config(config)
    assert _manager(llm).name == "guidance"
    assert type(_manager(llm).backend).__name__ == "GuidanceBackend"
    [output] = llm.generate([PROMPT], _params({"json": SCHEMAS["mixed_required"]}, seed=3), use_tqdm=False)
    jsonschema.validate(json.loads(output.outputs[0].text), SCHEMAS["mixed_required"])
