"""Speculative decoding changes how many tokens a step yields, never which: with either
proposer every family decodes Hugging Face's greedy tokens and logprobs, and every feature
that ends, penalises or reshapes a request gives what the engine without speculation gives."""

from __future__ import annotations

import json

import pytest

from conftest import NEW_TOKENS, PREEMPTING, PROMPTS, assert_preempted, make_llm
from tokenmill import LLM, LoRARequest, SamplingParams, load_config
from tokenmill.core.config.speculative_config import DEFAULT_DISABLE_BY_BATCH_SIZE
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.demo_models import DEMO_DRAFT_MODEL, DEMO_MODEL
from tokenmill.interfaces.errors import ConfigError, UnknownComponent
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.speculative import SpeculativeProposer
from tokenmill.testing.hf_reference import assert_matches_reference
from tokenmill.testing.tiny_adapters import make_lora_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
#: one model per family
FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3-moe", "phi3", "gemma", "gemma2", "gpt2"]


def draft_config(model_dir, arch="llama", k=3):
    """The target as its own draft: every draft should be accepted, so the acceptance rate
    checks that the draft model's KV and positions are right (outputs could not show it)."""
    return {"model": str(model_dir(arch)), "num_speculative_tokens": k}


def generate(llm, prompts=PROMPTS, params=GREEDY):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return outputs, tokens, logprobs


def stats(llm):
    return llm.llm_engine.scheduler.spec_stats


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_decodes_hf_greedy_tokens_with_each_proposer(arch, method, model_dir, hf_reference):
    spec = NGRAM if method == "ngram" else draft_config(model_dir, arch)
    llm = make_llm(model_dir(arch), speculative_config=spec)
    _, tokens, logprobs = generate(llm)
    assert_matches_reference(hf_reference(arch), tokens, logprobs)
    s = stats(llm)
    assert s.num_drafts > 0
    if method == "ngram":
        assert s.num_accepted_tokens > 0
    else:
        assert s.acceptance_rate > 0.9, s


def test_draft_model_with_other_weights_is_still_exact(model_dir, hf_reference, tmp_path):
    """A draft that disagrees most of the time (another seed's weights) costs speed, not tokens."""
    from tokenmill.testing.tiny_models import make_tiny_model

    draft = make_tiny_model("llama", tmp_path / "draft", seed=1)
    llm = make_llm(model_dir("llama"), speculative_config={"model": str(draft), "num_speculative_tokens": 4})
    _, tokens, logprobs = generate(llm)
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)
    assert 0 <= stats(llm).num_accepted_tokens < stats(llm).num_draft_tokens


def _feature_requests(baseline_tokens: list[int], tokenizer) -> list[SamplingParams]:
    """Requests whose ends fall inside a draft, from what the engine without speculation says."""
    stop_text = tokenizer.decode(baseline_tokens[5:7])
    return [
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0),  # max_tokens mid-draft
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, stop=[stop_text], logprobs=0),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0,
                       stop_token_ids=[baseline_tokens[6]]),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1,
                       repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, min_tokens=9,
                       stop_token_ids=[baseline_tokens[2]]),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=0),  # no room for drafts
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0,
                       bad_words=[tokenizer.decode(baseline_tokens[3:4])]),
    ]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stops_penalties_and_limits_apply_position_by_position(method, model_dir):
    """Stop strings and stop tokens that end inside a draft, max_tokens reached mid-draft,
    penalties, min_tokens, bad_words and top logprobs: the same replies as without speculation."""
    path = model_dir("llama")
    base = make_llm(path)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    (first,) = base.generate([prompt], GREEDY, use_tqdm=False)
    params = _feature_requests(first.outputs[0].token_ids, base.get_tokenizer())
    spec = NGRAM if method == "ngram" else draft_config(model_dir)
    llm = make_llm(path, speculative_config=spec)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:len(params)]]
    prompts[2] = prompts[3] = prompts[5] = prompts[7] = prompt  # the ones whose ends came from its reply
    expected = base.generate(prompts, params, use_tqdm=False)
    got = llm.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got):
        a, b = want.outputs[0], have.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                         a.stop_reason)
        for entry_a, entry_b in zip(a.logprobs, b.logprobs):
            assert entry_a.keys() == entry_b.keys()
            assert all(abs(entry_a[t].logprob - entry_b[t].logprob) < 1e-4 for t in entry_a)
    assert [o.outputs[0].finish_reason for o in got[1:4]] == ["length", "stop", "stop"]
    # the self-draft is mostly accepted (not where penalties or bad_words move the target's
    # choice: the draft sees raw logits), so the ends above fall inside accepted drafts
    assert stats(llm).num_drafts > 0 and (method == "ngram" or stats(llm).acceptance_rate > 0.5)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_prefix_caching_and_chunked_prefill(method, model_dir, hf_reference):
    """16-token steps (drafts count against them) over 8-token blocks, then a cached pass."""
    spec = NGRAM if method == "ngram" else draft_config(model_dir)
    llm = make_llm(model_dir("llama"), max_num_batched_tokens=16, block_size=8, speculative_config=spec)
    generate(llm)
    second, tokens, logprobs = generate(llm)
    assert any(o.num_cached_tokens > 0 for o in second)
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)
    assert stats(llm).num_accepted_tokens > 0


def test_the_draft_model_reads_a_prompt_in_passes_within_the_token_budget(model_dir, hf_reference):
    """A draft's first rows are whole prompts, which no memory profile sized: they are fed in
    passes of at most max_num_batched_tokens, a prompt's pieces in order (each reads the KV the
    last wrote: the target as its own draft accepts nearly every draft)."""
    llm = make_llm(model_dir("llama"), max_num_batched_tokens=16, block_size=8,
                   speculative_config=draft_config(model_dir))
    step = llm.llm_engine.speculator.proposer.model.model_step
    run, sizes = step.run, []

    def watched(batch, *args, **kwargs):
        sizes.append(sum(len(row.token_ids) for row in batch.rows))
        return run(batch, *args, **kwargs)

    step.run = watched
    _, tokens, logprobs = generate(llm)
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)
    assert max(sizes) == 16 and sum(sizes) >= sum(map(len, PROMPTS))
    assert stats(llm).acceptance_rate > 0.9, stats(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_preemption_with_drafts_in_flight(mode, method, model_dir, hf_reference):
    """A pool of 24 blocks forces preemption of requests holding drafts and lookahead slots."""
    spec = NGRAM if method == "ngram" else draft_config(model_dir)
    llm = make_llm(model_dir("llama"), preemption_mode=mode, speculative_config=spec, **PREEMPTING)
    _, tokens, logprobs = generate(llm)
    assert_preempted(llm, mode)
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)
    assert stats(llm).num_accepted_tokens > 0


def test_disable_by_batch_size_turns_speculation_off_for_large_batches(model_dir):
    """Replies of 2..24 tokens: drafts only once at most 4 requests are left."""
    path = model_dir("llama")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=2 * (i + 1), ignore_eos=True) for i in range(len(PROMPTS))]
    limited = make_llm(path, speculative_config=dict(NGRAM, disable_by_batch_size=4))
    full = make_llm(path, speculative_config=NGRAM)
    replies = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
               for llm in (make_llm(path), limited, full)]
    assert replies[0] == replies[1] == replies[2]
    assert 0 < stats(limited).num_drafts < stats(full).num_drafts


def test_seeded_sampling_is_reproducible_and_mixes_with_greedy(model_dir):
    """Seeded sampled requests repeat their replies run after run; greedy requests beside them,
    and a constrained one (which does not speculate), decode as without speculation."""
    path = model_dir("llama")
    sampled = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=NEW_TOKENS, ignore_eos=True, seed=11)
    constrained = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, structured_outputs={"regex": "[a-f]{3,9}"})
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:7]]
    params = [sampled, GREEDY] * 3 + [constrained]

    def run():
        llm = make_llm(path, speculative_config=NGRAM)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], stats(llm)

    first, s = run()
    again, _ = run()
    assert first == again and s.num_accepted_tokens > 0
    plain = [o.outputs[0].token_ids for o in make_llm(path).generate(prompts, params, use_tqdm=False)]
    assert first[1::2] == plain[1::2]  # the greedy ones and the constrained one


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_lora_adapters_in_the_batch(method, model_dir, tmp_path):
    """Two adapters and the base model in one batch (the draft model runs without adapters):
    the replies of the engine without speculation, which test_lora holds to merged HF models."""
    base = model_dir("llama")
    adapters = [make_lora_adapter(base, tmp_path / f"a{i}", seed=i, rank=8, targets=["q_proj", "v_proj", "down_proj"])
                for i in range(2)]
    requests = [None, LoRARequest("a0", 1, str(adapters[0])), LoRARequest("a1", 2, str(adapters[1]))] * 4
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    spec = NGRAM if method == "ngram" else draft_config(model_dir)
    replies = []
    for extra in ({}, {"speculative_config": spec}):
        llm = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, **extra)
        replies.append(generate_lora(llm, prompts, requests))
    assert replies[0][0] == replies[1][0]
    for expected, got in zip(replies[0][1], replies[1][1]):
        assert max(abs(a - b) for a, b in zip(expected, got)) < 1e-4
    assert len({tuple(t) for t in replies[0][0][:3]}) == 3  # the adapters change the replies


def generate_lora(llm, prompts, requests):
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    return ([o.outputs[0].token_ids for o in outputs],
            [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs])


def test_demo_model_ends_with_eos_inside_drafts():
    """The trained demo pair: replies end with EOS, often inside a draft; the draft model's
    guesses are accepted often, and the replies are those of the engine alone."""
    prompts = ["def add(a, b):\n    \"\"\"Return the sum of", "Read the file and return its lines.",
               "The quick brown fox jumps over the lazy dog. The quick brown fox", "class Stack:\n    \"\"\"",
               "Return a new list of the items. Return a new list",
               "The with statement is used to wrap the execution of a block",
               "If the object is not a string, raise TypeError. If the object"]
    params = SamplingParams(temperature=0, max_tokens=64, logprobs=0)
    target = str(DEMO_MODEL)
    expected = LLM(target, kv_cache_memory_bytes=64 * 2**20).generate(prompts, params, use_tqdm=False)
    for spec in (NGRAM, {"model": str(DEMO_DRAFT_MODEL), "num_speculative_tokens": 4}):
        llm = LLM(target, kv_cache_memory_bytes=64 * 2**20, speculative_config=spec)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
        assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
        assert stats(llm).num_accepted_tokens > 0
        assert all(o.metrics.num_draft_tokens >= o.metrics.num_accepted_tokens for o in got)
    assert any(o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason is None for o in expected)


class _Adversary(SpeculativeProposer):
    """A third-party proposer that guesses badly: random ids, some outside the vocabulary."""

    calls = 0

    def propose(self, requests):
        _Adversary.calls += 1
        if _Adversary.calls % 7 == 0:
            raise RuntimeError("the proposer broke")
        return [[(r.token_ids[-1] * 31 + j) % 600 for j in range(r.max_draft_tokens + 2)] for r in requests]


class _AdversaryPlugin:
    @hookimpl
    def register_speculative_proposers(self, register):
        register("adversary", _Adversary)


def test_a_third_party_proposer_registers_and_cannot_change_replies(model_dir, hf_reference):
    """Out-of-vocabulary guesses are cut, too many are cut, a proposer that raises costs its
    step's drafts: the replies stay Hugging Face's."""
    pm = make_plugin_manager()
    pm.register(_AdversaryPlugin(), "adversary")
    llm = LLM(str(model_dir("llama")), plugin_manager=pm, kv_cache_memory_bytes=32 * 2**20,
              speculative_config={"method": "adversary", "num_speculative_tokens": 2})
    _, tokens, logprobs = generate(llm)
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)
    assert stats(llm).num_drafts > 0 and _Adversary.calls >= 7


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_tensor_and_pipeline_parallelism(parallel, method, model_dir, hf_reference):
    """The target's ranks verify; the draft model runs unsharded beside the driver."""
    spec = NGRAM if method == "ngram" else draft_config(model_dir)
    with make_llm(model_dir("llama"), speculative_config=spec, **parallel) as llm:
        _, tokens, logprobs = generate(llm)
        assert stats(llm).num_accepted_tokens > 0
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)


def test_config_takes_vllm_shapes_and_names_problems(model_dir, tmp_path):
    config = load_config(speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 2}))
    assert (config.speculative.prompt_lookup_min, config.speculative.prompt_lookup_max) == (5, 5)
    assert config.speculative.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE  # measured, see its comment
    never = {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": None}
    assert load_config(speculative_config=never).speculative.disable_by_batch_size is None
    yaml_file = tmp_path / "engine.yaml"
    yaml_file.write_text("speculative:\n  model: ./draft\n  num_speculative_tokens: 3\n")
    spec = load_config(yaml_file).speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "./draft", 3)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        load_config(speculative_config={"method": "ngram"})
    with pytest.raises(ConfigError, match="speculative.prompt_lookup_mx"):
        load_config(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_mx": 3})
    with pytest.raises(UnknownComponent, match="ngram"):  # the error lists what is registered
        make_llm(model_dir("llama"), speculative_config={"method": "eagle9", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="vocabulary"):
        make_llm(model_dir("llama"), speculative_config={"model": str(DEMO_DRAFT_MODEL),
                                                          "num_speculative_tokens": 2})


def test_the_draft_models_kv_cache_comes_out_of_the_same_budget(model_dir):
    """cache.kv_cache_memory covers the target's and the draft's caches together: with the
    target as its own draft (the same bytes per block), the pool holds half the blocks."""
    budget = dict(kv_cache_memory_bytes=2 * 2**20, max_num_seqs=256)
    alone = LLM(str(model_dir("llama")), **budget)
    paired = LLM(str(model_dir("llama")), speculative_config=draft_config(model_dir), **budget)
    blocks = [llm.llm_engine.scheduler.kv_cache.pool.num_blocks for llm in (alone, paired)]
    assert blocks[1] == blocks[0] // 2
