"""Greedy tokens and logprobs equal Hugging Face transformers' for every supported family,
under every scheduling and caching configuration that changes how the KV cache is built."""

from __future__ import annotations

import pytest

from conftest import NEW_TOKENS, PROMPTS, make_llm
from tokenmill import SamplingParams
from tokenmill.testing.hf_reference import assert_matches_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def generate(llm, prompts=PROMPTS):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outputs]
    return outputs, tokens, logprobs


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen2-tied"])
def test_default_engine_matches_hf(arch, model_dir, hf_reference):
    """12 mixed-length prompts batched together decode exactly as HF does, alone."""
    _, tokens, logprobs = generate(make_llm(model_dir(arch)))
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


VARIANTS = {
    "chunked-prefill-16": dict(max_num_batched_tokens=16),
    "block-size-8": dict(block_size=8),
    "block-size-32": dict(block_size=32),
    "max-num-seqs-2": dict(max_num_seqs=2),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "no-chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_engine_variants_match_hf(arch, variant, model_dir, hf_reference):
    """Chunked prefill, block sizes and batch limits change the schedule, never the tokens."""
    _, tokens, logprobs = generate(make_llm(model_dir(arch), **VARIANTS[variant]))
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_preemption_by_recompute_matches_hf(arch, model_dir, hf_reference):
    """A KV pool of 24 blocks of 8 tokens forces preemption; outputs stay exact."""
    llm = make_llm(model_dir(arch), num_gpu_blocks_override=24, block_size=8, max_model_len=192)
    _, tokens, logprobs = generate(llm)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_prefix_cache_hits_match_hf(arch, model_dir, hf_reference):
    """The second pass over the same prompts is served from the prefix cache, unchanged."""
    llm = make_llm(model_dir(arch), block_size=8)
    first, _, _ = generate(llm)
    assert all(o.num_cached_tokens == 0 for o in first)
    second, tokens, logprobs = generate(llm)
    assert all(o.num_cached_tokens > 0 for o, p in zip(second, PROMPTS) if len(p) > 8)
    assert all(o.num_cached_tokens < len(p) for o, p in zip(second, PROMPTS))
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


def test_shared_prefixes_in_one_batch_match_hf(model_dir):
    """Prompts sharing a long prefix, submitted together, reuse blocks and still match HF."""
    from tokenmill.testing.hf_reference import hf_greedy

    prefix = PROMPTS[0][:40]
    prompts = [prefix + p[:10] for p in PROMPTS[1:7]]
    llm = make_llm(model_dir("llama"), block_size=8, max_num_seqs=1)
    outputs, tokens, logprobs = generate(llm, prompts)
    assert all(o.num_cached_tokens >= 32 for o in outputs[1:])
    assert_matches_reference(hf_greedy(model_dir("llama"), prompts, NEW_TOKENS), tokens, logprobs)
