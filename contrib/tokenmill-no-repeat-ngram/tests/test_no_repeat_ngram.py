"""The third-party processor passes tokenmill's logits-processor conformance kit, is found
through its installed entry point, is selected from a YAML engine config, and gives
transformers' ``generate(no_repeat_ngram_size=...)`` tokens on the same weights."""

import random
from importlib import metadata

import pytest
import torch
import yaml

from tokenmill import LLM, SamplingParams
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.logits_processor import AddedRow, BatchUpdate
from tokenmill.testing.logits_processor_conformance import check_logits_processor, default_context
from tokenmill.testing.tiny_models import make_tiny_model
from tokenmill_no_repeat_ngram import NoRepeatNGram

#: prompts of different lengths, one repeating its own bigrams, one of a single token
PROMPTS = ([5, 9, 3, 7], list(range(3, 13)), [11, 4] * 4, [300, 200, 100], [1])
#: long enough that the tiny model's greedy output repeats bigrams without the processor
MAX_TOKENS = 24


def size(n):
    return SamplingParams(extra_args={"no_repeat_ngram_size": n})


def greedy(**extra_args):
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=extra_args or None)


def repeated_ngrams(prompt, output, n):
    """(output position, n-gram) for each generated token that completes an n-gram already
    in the sequence before it (prompt included: Hugging Face's rule)."""
    sequence = list(prompt) + list(output)
    seen, repeats = set(), []
    for end in range(n - 1, len(sequence)):
        ngram = tuple(sequence[end - n + 1:end + 1])
        if end >= len(prompt) and ngram in seen:
            repeats.append((end - len(prompt), ngram))
        seen.add(ngram)
    return repeats


@pytest.mark.parametrize("seed", range(4))
def test_no_repeat_ngram_conforms(seed):
    """State follows every kind of batch update, rows without the argument are untouched,
    and bad sizes are refused at admission."""
    inactive = SamplingParams() if seed % 2 else SamplingParams(extra_args={"some_other_processor": 3})
    check_logits_processor(NoRepeatNGram, active_params=[size(1), size(2), size(3)], inactive_params=inactive,
                           invalid_params=[size(0), size(-2), size(2.0), size("2"), size(True)], seed=seed)


def test_the_installed_entry_point_registers_it():
    """The distribution's real entry point (no mocks) is what the plugin host loads."""
    [entry] = [ep for ep in metadata.entry_points(group="tokenmill.plugins") if ep.name == "no_repeat_ngram"]
    assert entry.dist.name == "tokenmill-no-repeat-ngram" and entry.dist.version == "0.1.0"
    assert entry.load().NoRepeatNGram is NoRepeatNGram
    pm = make_plugin_manager()
    assert pm.info["no_repeat_ngram"].distribution == "tokenmill-no-repeat-ngram"
    assert collect_components(pm).logits_processors.get("no_repeat_ngram") is NoRepeatNGram


def test_bans_what_transformers_bans():
    """On random sequences over a small vocabulary (many repeats), n = 1..4, step by step as the
    output grows: the banned tokens are those of transformers' NoRepeatNGramLogitsProcessor."""
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    rng = random.Random(0)
    context = default_context(vocab_size=6)
    for _ in range(200):
        n, output = rng.randint(1, 4), []
        prompt = [rng.randrange(6) for _ in range(rng.randint(1, 8))]
        processor = NoRepeatNGram(context)
        processor.update_state(BatchUpdate(1, added=(AddedRow(0, size(n), prompt, output),)))
        for _ in range(12):
            sequence = torch.tensor([prompt + output])
            expected = NoRepeatNGramLogitsProcessor(n)(sequence, torch.zeros(1, 6))
            assert torch.equal(processor.apply(torch.zeros(1, 6)), expected), (n, prompt, output)
            output.append(rng.randrange(6))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory):
    """An engine selecting the processor in YAML."""
    config = tmp_path_factory.mktemp("config") / "engine.yaml"
    config.write_text(yaml.safe_dump({"model": str(model), "logits_processors": ["no_repeat_ngram"],
                                      "cache": {"kv_cache_memory": "32MiB"}}))
    llm = LLM.from_config(config)
    assert any(isinstance(p, NoRepeatNGram) for p in llm.llm_engine.runner.sampler.processors)
    return llm


@pytest.fixture(scope="module")
def baseline(model):
    """An engine without the processor."""
    llm = LLM(str(model), kv_cache_memory_bytes=32 * 2**20)
    assert not any(isinstance(p, NoRepeatNGram) for p in llm.llm_engine.runner.sampler.processors)
    return llm


@pytest.fixture(scope="module")
def prompts(baseline):
    """PROMPTS, then each followed by the start of its unconstrained output: there the model wants to
    go on with n-grams of the prompt, which only a processor that counts the prompt bans."""
    outputs = baseline.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False)
    return list(PROMPTS) + [list(p) + o.outputs[0].token_ids[:8] for p, o in zip(PROMPTS, outputs)]


def generate(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


def test_no_bigram_repeats_and_other_requests_are_untouched(engine, baseline, prompts):
    """In one batch: requests with no_repeat_ngram_size=2 never complete a bigram already in
    their prompt + output, though the same prompts' unconstrained outputs do; requests without
    the argument give the tokens of an engine without the processor."""
    unconstrained = generate(baseline, prompts, greedy())
    assert sum(bool(repeated_ngrams(p, out, 2)) for p, out in zip(prompts, unconstrained)) >= len(prompts) // 2, (
        "the unconstrained outputs hardly repeat bigrams, so this test could not fail")
    params = [greedy(no_repeat_ngram_size=2)] * len(prompts) + [greedy()] * len(prompts)
    outputs = generate(engine, prompts + prompts, params)
    constrained, plain = outputs[:len(prompts)], outputs[len(prompts):]
    for prompt, tokens in zip(prompts, constrained):
        assert len(tokens) == MAX_TOKENS
        assert repeated_ngrams(prompt, tokens, 2) == [], f"prompt {prompt}: {tokens}"
    assert plain == unconstrained


@pytest.fixture(scope="module")
def hf_model(model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


@pytest.mark.parametrize("n", [2, 3])
def test_greedy_output_matches_transformers(engine, hf_model, prompts, n):
    """The same tokens as transformers' generate(no_repeat_ngram_size=n, do_sample=False)."""
    hf = hf_model
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            # the mask is explicit: generate would otherwise mask every prompt token equal to the pad id
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                              no_repeat_ngram_size=n, eos_token_id=None, pad_token_id=hf.config.pad_token_id)
            expected.append(out[0, len(prompt):].tolist())
    assert generate(engine, prompts, greedy(no_repeat_ngram_size=n)) == expected


@pytest.mark.parametrize("bad", [0, -1, 2.5, "2", True, 65])
def test_a_bad_size_is_an_invalid_request(engine, bad):
    """validate_params' ValueError reaches the caller as InvalidRequest on vllm_xargs, before any step."""
    with pytest.raises(InvalidRequest, match="no_repeat_ngram_size") as info:
        engine.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(no_repeat_ngram_size=bad), use_tqdm=False)
    assert info.value.param == "vllm_xargs"
