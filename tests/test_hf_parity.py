"""Greedy tokens and logprobs equal Hugging Face transformers' for every supported family,
under every scheduling and caching configuration that changes how the KV cache is built."""

from __future__ import annotations

import pytest

from conftest import NEW_TOKENS, PROMPTS, make_llm
from tokenmill import SamplingParams
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.interfaces.errors import UnknownComponent
from tokenmill.testing.hf_reference import assert_matches_reference
from tokenmill.testing.tiny_models import ARCHITECTURES

#: every tiny decoder LM the factory can make: one or more per registered architecture (the
#: sequence classifiers' parity is tests/test_pooling.py's)
DECODERS = sorted(name for name, spec in ARCHITECTURES.items()
                  if spec["model_type"] != "bert" and not spec["architectures"][0].endswith("ForSequenceClassification"))

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def generate(llm, prompts=PROMPTS):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[entry[t].logprob for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outputs]
    return outputs, tokens, logprobs


@pytest.mark.parametrize("arch", DECODERS)
def test_default_engine_matches_hf(arch, model_dir, hf_reference):
    """12 mixed-length prompts batched together decode exactly as HF does, alone."""
    _, tokens, logprobs = generate(make_llm(model_dir(arch)))
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


@pytest.mark.parametrize("arch", DECODERS)
def test_chunked_prefill_and_prefix_hits_match_hf_for_every_family(arch, model_dir, hf_reference):
    """Every family, with 16-token prefill chunks and a second, prefix-cached pass."""
    llm = make_llm(model_dir(arch), max_num_batched_tokens=16, block_size=8)
    generate(llm)
    second, tokens, logprobs = generate(llm)
    assert any(o.num_cached_tokens > 0 for o in second)
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


def test_every_registered_architecture_has_a_parity_model():
    """A model plugin is covered by the parity tests as soon as it registers: the tiny
    factory must know how to build each registered architecture."""
    registered = set(collect_components(make_plugin_manager()).model_architectures.names())
    buildable = {spec["architectures"][0] for spec in ARCHITECTURES.values()}
    assert registered <= buildable, f"no tiny model for {sorted(registered - buildable)}"


def test_unregistered_architecture_lists_the_registered_ones(model_dir, tmp_path):
    """A checkpoint whose architecture no plugin registers fails, naming what is available."""
    import json
    import shutil

    target = tmp_path / "unknown"
    shutil.copytree(model_dir("llama"), target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownComponent) as info:
        make_llm(target)
    assert "FancyNewForCausalLM" in str(info.value) and "LlamaForCausalLM" in info.value.available


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
