"""On a CUDA GPU: the engine's features beyond plain decoding, each against the same engine
without it, or against HF, in fp32 (no TF32: torch's default for fp32 matmuls), so that the
bound is fp32's up to summation order: GPTQ/AWQ through the Triton dequant-GEMM, LoRA, both
speculative proposers, penalties, structured outputs, preemption by swapping to host memory, long
prompts in chunks and an embedding model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import NEW_TOKENS, PREEMPTING, PROMPTS, QUANT_CHECKPOINTS, assert_preempted
from cuda_engines import cuda_llm
from tokenmill import SamplingParams
from tokenmill.interfaces.adapters import LoRARequest
from tokenmill.demo_models import DEMO_DRAFT_MODEL, DEMO_MODEL
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy
from tokenmill.testing.logits import prompt_logits
from tokenmill.testing.tiny_adapters import make_lora_adapter, merge_lora

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
GROUP_QUANTIZED = ["gptq-w4g64-sym-v1-rtn", "gptq-w4g64-asym-v2-rtn", "gptq-w8g64-sym-v1-rtn",
                   "gptq-w4g64-sym-descact-v1-rtn", "awq-w4g64-gemm-rtn"]


def greedy(llm, prompts, params=GREEDY, **kwargs):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kwargs)
    return ([o.outputs[0].token_ids for o in outputs],
            [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs])


@pytest.mark.skipif(not QUANT_CHECKPOINTS.is_dir(), reason=f"no checkpoints at {QUANT_CHECKPOINTS}")
@pytest.mark.parametrize("name", GROUP_QUANTIZED)
def test_gptq_and_awq_take_the_triton_gemm_and_match_exact_dequantization(name):
    path = QUANT_CHECKPOINTS / name
    reference = load_file(path / "reference.safetensors")
    engine = cuda_llm(path, dtype="float32").llm_engine
    layer = engine.runner.model.model.layers[0].mlp.down_proj
    assert layer.kernel.kind == "triton" and layer.t_qweight.device.type == "cuda"
    logits = torch.stack([prompt_logits(engine, row.tolist()).cpu() for row in reference["input_ids"]])
    expected = reference["logits_ref"]
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-3


def test_lora_adapters_in_one_batch_match_merged_hf(model_dir, tmp_path):
    base = model_dir("llama")
    adapter = make_lora_adapter(base, tmp_path / "adapter", seed=1, rank=8,
                                targets=["q_proj", "v_proj", "gate_proj", "down_proj"])
    merged = merge_lora(base, adapter, tmp_path / "merged")
    llm = cuda_llm(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = PROMPTS[:4]
    requests = [None, LoRARequest("a", 1, str(adapter))] * 2
    tokens, logprobs = greedy(llm, prompts, lora_request=requests)
    for rows, model in (([0, 2], base), ([1, 3], merged)):
        reference = hf_greedy(model, [prompts[i] for i in rows], 16)
        assert_matches_reference(reference, [tokens[i] for i in rows], [logprobs[i] for i in rows])


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"model": str(DEMO_DRAFT_MODEL), "num_speculative_tokens": 4},
    {"model": str(DEMO_MODEL), "num_speculative_tokens": 3}], ids=["ngram", "draft_model", "self_draft"])
def test_speculative_decoding_gives_the_plain_engines_tokens(spec):
    """The target drafting for itself has every draft accepted only where the draft model's
    passes, replayed from its own CUDA graphs, read the right KV and positions (a failed
    proposal goes without drafts, so the outputs alone could not show it)."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 13, 14]]
    plain = greedy(cuda_llm(DEMO_MODEL, dtype="float32"), prompts)
    speculating = cuda_llm(DEMO_MODEL, dtype="float32", speculative_config=spec)
    replays = []
    if "model" in spec:  # count the draft's replayed passes (a torch.cuda.CUDAGraph counts none)
        graphs = speculating.llm_engine.speculator.proposer.model.model_step.graphs
        run = graphs.run
        graphs.run = lambda size, *args, **kwargs: replays.append(size) or run(size, *args, **kwargs)
    tokens, logprobs = greedy(speculating, prompts)
    assert tokens == plain[0]
    assert max(abs(a - b) for x, y in zip(logprobs, plain[1]) for a, b in zip(x, y)) < 1e-3
    stats = speculating.llm_engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    if "model" in spec:
        assert replays
    if spec.get("model") == str(DEMO_MODEL):
        assert stats.num_drafts >= 6 and stats.acceptance_rate > 0.9, stats


def test_structured_outputs_constrain_the_reply(model_dir):
    """A bounded integer: the random tiny model, sampling, writes digits until max_tokens
    where the schema allows any integer (on the CPU as on an H100)."""
    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["a", "b"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    llm = cuda_llm(model_dir("llama"), dtype="float32")
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=i, structured_outputs={"json": schema})
              for i in range(4)]
    for output in llm.generate(["Item: "] * 4, params, use_tqdm=False):
        assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
        reply = json.loads(output.outputs[0].text)
        assert set(reply) == {"id", "tag"} and isinstance(reply["id"], int) and reply["tag"] in ("a", "b")


def test_preemption_by_swap_gives_the_unpressed_tokens(model_dir):
    """PREEMPTING's 24 blocks preempt PROMPTS once they grow by NEW_TOKENS (16 fit)."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    roomy = greedy(cuda_llm(model_dir("llama"), dtype="float32"), PROMPTS, params)
    pressed = cuda_llm(model_dir("llama"), dtype="float32", preemption_mode="swap", **PREEMPTING)
    tokens, logprobs = greedy(pressed, PROMPTS, params)
    assert_preempted(pressed, "swap")
    assert tokens == roomy[0]
    assert max(abs(a - b) for x, y in zip(logprobs, roomy[1]) for a, b in zip(x, y)) < 1e-3


def test_async_scheduling_decodes_as_hf_with_graphs_and_as_the_step_by_step_engine(model_dir):
    """One step in flight while the next is launched: the placeholders take the last step's
    tokens on the GPU (in a graph's input buffer for decode steps), the host reads each step's
    tokens through pinned copies; fp32, so HF's bound holds, and seeded sampling is the same
    as step by step (each seeded row draws from its own CUDA generator)."""
    prompts = PROMPTS[:6]
    llm = cuda_llm(model_dir("llama"), dtype="float32", async_scheduling=True, max_num_seqs=4)
    assert llm.llm_engine.runner.model_step.graphs is not None
    tokens, logprobs = greedy(llm, prompts)
    assert_matches_reference(hf_greedy(model_dir("llama"), prompts, 16), tokens, logprobs)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True, logprobs=0)
    step_by_step = cuda_llm(model_dir("llama"), dtype="float32", async_scheduling=False, max_num_seqs=4)
    assert not step_by_step.llm_engine.scheduler.async_scheduling
    assert greedy(llm, prompts, seeded)[0] == greedy(step_by_step, prompts, seeded)[0]


def test_penalised_rows_decode_alike_with_and_without_prompt_lookup(model_dir):
    """Repetition, frequency and presence penalties count prompt and output ids kept on the GPU,
    the output's growing by each step's tokens; a verify step's draft rows count the output then
    their drafts. The penalties change the tokens, and speculation does not."""
    penalised = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                               max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = [(p * 3)[:24] for p in PROMPTS[:3]]
    plain = cuda_llm(model_dir("llama"), dtype="float32", max_num_seqs=4)
    tokens = greedy(plain, prompts, penalised)[0]
    unpenalised = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    assert tokens != greedy(plain, prompts, unpenalised)[0]
    speculating = cuda_llm(model_dir("llama"), dtype="float32", max_num_seqs=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert greedy(speculating, prompts, penalised)[0] == tokens
    assert speculating.llm_engine.scheduler.spec_stats.num_draft_tokens > 0


def test_unseeded_sampling_draws_on_the_gpu_and_follows_the_engine_seed(model_dir):
    """The noise of unseeded random rows comes from a CUDA generator seeded with the engine
    seed: two engines with one seed sample alike, another seed samples otherwise."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        llm = cuda_llm(model_dir("llama"), dtype="float32", seed=seed, max_num_seqs=4)
        assert llm.llm_engine.runner.sampler.noise_generator.device.type == "cuda"
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params, use_tqdm=False)
        runs[name] = [o.outputs[0].token_ids for o in outputs]
    assert runs["a"] == runs["b"] and runs["a"] != runs["c"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_long_prompts_prefill_in_chunks_as_hf(model_dir, async_scheduling):
    """Prompts of several chunks run steps that sample nothing, back to back, with no result
    read between them: each chunk is staged in the pinned buffers only once the last chunk's
    copies out of them ran (tests/test_device_boundaries.py has the stand-in's race check)."""
    prompts = [p for p in PROMPTS if len(p) > 96][:3]
    llm = cuda_llm(model_dir("llama"), dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
                   async_scheduling=async_scheduling)
    tokens, logprobs = greedy(llm, prompts)
    assert_matches_reference(hf_greedy(model_dir("llama"), prompts, 16), tokens, logprobs)


def test_an_embedding_model_embeds_on_the_gpu_as_on_the_cpu(model_dir, monkeypatch):
    """The encoder path on the GPU (fp32, no TF32): the CPU engine's embeddings to fp32 summation
    (the CPU side on PyTorch's ops: building the C++ kernels would take a bare GPU machine a minute)."""
    from tokenmill import LLM

    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    texts = ["The quick brown fox", "a", "Rivers run to the sea, and the sea returns to the clouds"]
    gpu = torch.tensor(cuda_llm(model_dir("bert"), dtype="float32").embed(texts))
    cpu = torch.tensor(LLM(str(model_dir("bert")), device="cpu").embed(texts))
    torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=1e-5)
