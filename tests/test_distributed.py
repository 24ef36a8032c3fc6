"""Tensor and pipeline parallelism over real torch.distributed (gloo) worker processes:
the same greedy tokens and logprobs as Hugging Face transformers, for every feature that
changes how a step is built."""

from __future__ import annotations


import pytest
import torch

from conftest import NEW_TOKENS, PLAIN, PREEMPTING, PROMPTS, QUANT_CHECKPOINTS, assert_preempted, make_llm
from tokenmill import LLM, LoRARequest, SamplingParams, load_config
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy
from tokenmill.testing.logits import prompt_logits
from tokenmill.testing.tiny_adapters import make_lora_adapter, merge_lora

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
CHECKPOINTS = QUANT_CHECKPOINTS


def generate(llm, prompts=PROMPTS, params=GREEDY, **kwargs):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kwargs)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return outputs, tokens, logprobs


#: GQA with one KV head (replicated over both ranks), tied embeddings, MoE, soft-caps and
#: sliding windows, q/k norms, checkpoint-fused q/k/v, Conv1D weights
TP_ARCHS = ["llama-mqa-bias", "qwen2-tied", "mixtral", "gemma2", "qwen3-moe", "phi3", "gpt2-untied"]


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_tensor_parallel_matches_hf(arch, model_dir, hf_reference):
    with make_llm(model_dir(arch), tensor_parallel_size=2) as llm:
        assert llm.llm_engine.runner.model_step.parallel.tp_size == 2
        _, tokens, logprobs = generate(llm)
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


@pytest.mark.parametrize("arch", ["llama", "qwen2-tied", "mixtral", "gemma2"])
def test_pipeline_parallel_matches_hf(arch, model_dir, hf_reference):
    with make_llm(model_dir(arch), pipeline_parallel_size=2) as llm:
        layers = llm.llm_engine.runner.model.model.layers
        assert sum(1 for layer in layers if sum(p.numel() for p in layer.parameters())) == len(layers) // 2
        _, tokens, logprobs = generate(llm)
        # two batches in flight, each with half the requests: twice the steps of one batch
        assert llm.llm_engine.runner.model_step.steps >= 2 * NEW_TOKENS
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


@pytest.mark.parametrize("arch", ["llama-mqa-bias", "qwen2-tied"])
def test_tensor_and_pipeline_parallel_together_match_hf(arch, model_dir, hf_reference):
    """Four ranks: two stages of two tensor-parallel ranks each."""
    with make_llm(model_dir(arch), tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        assert len(llm.llm_engine.workers.hellos) == 3
        _, tokens, logprobs = generate(llm)
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


def test_each_rank_holds_its_shard(model_dir):
    """Half the weights per rank (the norms and KV heads of a 1-KV-head model are replicated)."""
    with make_llm(model_dir("llama"), **PLAIN) as whole, \
            make_llm(model_dir("llama"), **PLAIN, tensor_parallel_size=2) as half:
        full = dict(whole.llm_engine.runner.model.named_parameters())
        shard = dict(half.llm_engine.runner.model.named_parameters())
        assert full.keys() == shard.keys()
        q = "model.layers.0.self_attn.qkv_proj.weight"
        assert shard[q].shape[0] * 2 == full[q].shape[0] and shard[q].shape[1] == full[q].shape[1]
        o = "model.layers.0.self_attn.o_proj.weight"
        assert shard[o].shape[1] * 2 == full[o].shape[1]
        embed = "model.embed_tokens.weight"
        assert torch.equal(shard[embed], full[embed][: shard[embed].shape[0]])


@pytest.mark.parametrize("arch", ["llama", "qwen2-tied"])
def test_prefix_caching_and_chunked_prefill_under_tp(arch, model_dir, hf_reference):
    """16-token prefill chunks, then a second pass served from the prefix cache."""
    with make_llm(model_dir(arch), tensor_parallel_size=2, max_num_batched_tokens=16, block_size=8) as llm:
        first, _, _ = generate(llm)
        second, tokens, logprobs = generate(llm)
    assert all(o.num_cached_tokens == 0 for o in first)
    assert all(o.num_cached_tokens > 0 for o, p in zip(second, PROMPTS) if len(p) > 8)
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_preemption_under_parallelism(mode, parallel, model_dir, hf_reference):
    """A pool of 24 blocks forces preemption; swapped blocks move on every rank."""
    with make_llm(model_dir("llama"), preemption_mode=mode, **PREEMPTING, **parallel) as llm:
        _, tokens, logprobs = generate(llm)
        assert_preempted(llm, mode)
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)


def test_sampling_and_prompt_logprobs_under_tp(model_dir):
    """Seeded sampling draws the same tokens, and prompt logprobs agree, with or without TP."""
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7, logprobs=3, prompt_logprobs=2,
                            ignore_eos=True)
    with make_llm(model_dir("llama")) as one, make_llm(model_dir("llama"), tensor_parallel_size=2) as two:
        a = one.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
        b = two.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for ex, ey in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert ex.keys() == ey.keys()
            assert all(abs(ex[t].logprob - ey[t].logprob) < 1e-4 for t in ex)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    base, root = model_dir("llama"), tmp_path_factory.mktemp("tp-adapters")
    specs = {"qv": dict(rank=4, targets=["q_proj", "v_proj"]),
             "all": dict(rank=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"])}
    made = {}
    for i, (name, spec) in enumerate(specs.items()):
        adapter = make_lora_adapter(base, root / name, seed=10 + i, **spec)
        made[name] = (adapter, merge_lora(base, adapter, root / f"{name}-merged"))
    return made


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_two_adapters_and_base_in_one_batch(parallel, model_dir, adapters):
    """Adapters loaded at request time reach every rank, sliced like their base layers (TP)
    or split by layers (PP)."""
    names = [None, "qv", "all"]
    assigned = [names[i % 3] for i in range(len(PROMPTS))]
    requests = [None if n is None else LoRARequest(n, 1 + names.index(n), str(adapters[n][0])) for n in assigned]
    with make_llm(model_dir("llama"), enable_lora=True, max_loras=2, max_lora_rank=8, **parallel) as llm:
        _, tokens, logprobs = generate(llm, lora_request=requests)
    for name in names:
        rows = [i for i, n in enumerate(assigned) if n == name]
        reference_model = model_dir("llama") if name is None else adapters[name][1]
        assert_matches_reference(hf_greedy(reference_model, [PROMPTS[i] for i in rows], NEW_TOKENS),
                                 [tokens[i] for i in rows], [logprobs[i] for i in rows])


QUANTIZED = ["gptq-w4g64-sym-descact-v1-rtn", "gptq-w4g64-asym-v1-gptqmodel", "awq-w4g64-gemm-gptqmodel"]


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
@pytest.mark.parametrize("name", QUANTIZED)
def test_quantized_checkpoints_split_by_packs_and_groups(name):
    """GPTQ (act-order too) and AWQ at TP=2: the reference logits, and TP=1's greedy tokens."""
    from safetensors.torch import load_file

    reference = load_file(CHECKPOINTS / name / "reference.safetensors")
    prompts = [row.tolist() for row in reference["input_ids"]]
    config = dict(dtype="float32", kv_cache_memory_bytes=2**24)
    with LLM(str(CHECKPOINTS / name), tensor_parallel_size=2, **config) as two:
        logits = torch.stack([prompt_logits(two.llm_engine, p) for p in prompts])
        _, tokens, logprobs = generate(two, prompts)
    expected = reference["logits_ref"]
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-3
    with LLM(str(CHECKPOINTS / name), **config) as one:
        _, tokens_one, logprobs_one = generate(one, prompts)
    assert tokens == tokens_one
    assert max(abs(a - b) for x, y in zip(logprobs, logprobs_one) for a, b in zip(x, y)) < 1e-4


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
@pytest.mark.parametrize("kernel", ["dequantize", "scaled_mm"])
@pytest.mark.parametrize("name", ["ct-fp8-channel-dynamic", "fp8-tensor-static"])
def test_fp8_checkpoints_split_with_their_activation_scales(name, kernel):
    """FP8 weights split like plain ones, with either kernel; a dynamic per-token activation
    scale is the whole row's (a max all-reduce), so TP=2 reproduces the W8A8 reference exactly."""
    from safetensors.torch import load_file

    reference = load_file(CHECKPOINTS / name / "reference.safetensors")
    config = load_config(model=str(CHECKPOINTS / name), tensor_parallel_size=2, dtype="float32",
                         kv_cache_memory_bytes=2**24)
    config.quantization.fp8_kernel = kernel
    with LLM(config=config) as two:
        logits = torch.stack([prompt_logits(two.llm_engine, row.tolist()) for row in reference["input_ids"]])
    expected = reference["logits_w8a8"]
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-5


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
def test_fp8_blocks_that_straddle_the_slices_are_refused():
    from tokenmill.interfaces.errors import ConfigError

    with pytest.raises(ConfigError, match="tensor_parallel_size: .*cannot be split over ranks"):
        LLM(str(CHECKPOINTS / "fp8-block"), tensor_parallel_size=2, kv_cache_memory_bytes=2**24)


def test_contrib_attention_plugin_from_yaml_at_tp2(model_dir, hf_reference, tmp_path):
    """An installed package's attention backend, selected in YAML, runs on every rank."""
    (tmp_path / "engine.yaml").write_text(
        f"model: {model_dir('llama')}\nattention:\n  backend: flat\nparallel:\n  tensor_parallel_size: 2\n"
        "cache:\n  kv_cache_memory: 32MiB\n")
    with LLM.from_config(tmp_path / "engine.yaml") as llm:
        assert llm.llm_engine.runner.model.model.layers[0].self_attn.attn.backend.name == "flat"
        _, tokens, logprobs = generate(llm)
    assert_matches_reference(hf_reference("llama"), tokens, logprobs)


def test_parallel_flags_and_yaml_use_vllm_names(tmp_path):
    config = load_config(tensor_parallel_size=2, pipeline_parallel_size=3, distributed_executor_backend="ray")
    assert (config.parallel.world_size, config.parallel.executor) == (6, "ray")
    assert load_config(tensor_parallel_size=2).parallel.executor == "mp"
    assert load_config().parallel.executor == "uni"


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_constrained_sampling_matches_one_process(parallel, model_dir):
    """JSON-schema constraints and seeded sampling run on the driver: the same replies as one
    process, also where two micro-batches alternate (their matchers replay their history)."""
    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array",
              "items": {"enum": ["a", "b"]}}}, "required": ["id", "tags"], "additionalProperties": False}
    prompts = [f"Item {i}: " + "lorem " * (3 + i) for i in range(6)]
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured_outputs={"json": schema})
              for i in range(6)]
    with make_llm(model_dir("llama")) as one, make_llm(model_dir("llama"), **parallel) as many:
        expected = [o.outputs[0].text for o in one.generate(prompts, params, use_tqdm=False)]
        assert [o.outputs[0].text for o in many.generate(prompts, params, use_tqdm=False)] == expected
    assert all(text.startswith('{"id": ') or text.startswith('{"id":') for text in expected), expected
