"""The device-boundary net: the cuda platform's engine on the CPU's CUDA stand-in.

On a CPU-only machine host and device tensors are the same kind, so a host tensor handed
to a device kernel passes every CPU test and fails on the first GPU (it did: the profiling
forward pass without staged inputs, FP8 scales repeated by a host tensor). Here
``FakeCudaPlatform`` (``CudaPlatform`` less the CUDA runtime calls) runs the engine inside
``fake_cuda()``: its tensors say ``cuda``, hold real values, and meet host tensors only
where CUDA allows. Every family builds (the profiling forward included), stages each
step's inputs, replays decode steps from the faithful graph stand-in, and matches Hugging
Face; each quantization method's ``apply`` runs on device weights and matches its
reference; sleep mode frees the device memory it says it frees. The mutation checks put each
diagnosed GPU bug back and watch its test fail.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import PROMPTS, QUANT_CHECKPOINTS, make_llm, with_platforms
from tokenmill import LLM, SamplingParams, load_config
from tokenmill.core.distributed.messages import Row, Step
from tokenmill.core.engine.gc_heap import freeze_import_heap
from tokenmill.core.layers.custom_op import CustomOp
from tokenmill.core.layers.moe import FusedMoE
from tokenmill.core.worker import memory_profile, model_builder
from tokenmill.plugins.platforms.cuda.fused_ops import FUSED_OPS
from tokenmill.plugins.quantization import fp8
from tokenmill.plugins.quantization.group_quant import TritonGroupQuantizedLinear
from tokenmill.testing.device_graphs import FreedTensorError, HostSyncError
from tokenmill.testing.device_memory import DEVICE_MEMORY
from tokenmill.testing.device_queue import host_syncs
from tokenmill.testing.fake_cuda import DeviceMismatchError, DeviceTensor, fake_cuda, host_value
from tokenmill.testing.fake_cuda_platform import FakeCudaPlatform
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy
from tokenmill.testing.logits import prompt_logits

CHECKPOINTS = QUANT_CHECKPOINTS
#: one checkpoint per quantization method and weight layout
QUANTIZED = ["fp8-tensor-static", "ct-fp8-channel-dynamic", "ct-fp8-tensor-static", "fp8-block",
             "gptq-w4g64-sym-v1-rtn", "gptq-w8g64-sym-v1-rtn", "gptq-w4g64-sym-descact-v1-rtn", "awq-w4g64-gemm-rtn"]
#: one model per family (and the MoE layouts), built on the stand-in device
FAMILIES = ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3-moe", "phi3", "gemma", "gemma2", "gpt2"]


def fake_cuda_llm(path: Path, **overrides) -> LLM:
    """An engine on the stand-in device. Its contexts are short (the tests' prompts are): the
    memory profile prefills a ``max_model_len`` context through the interpreted Triton kernels,
    which at the tiny models' 512 took half of each build."""
    args = dict(model=str(path), device="fake-cuda", attention_backend="triton", dtype="float32", block_size=8,
                max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_bytes=2**23, max_model_len=128)
    return LLM(config=load_config(**{**args, **overrides}), plugin_manager=with_platforms(FakeCudaPlatform))


def launch_waits(llm: LLM) -> list[str]:
    """The host's waits for the device while each of ``llm``'s steps is launched, from now on
    (``host_syncs``; the engine must run inside ``fake_cuda()``)."""
    waits: list[str] = []
    runner = llm.llm_engine.runner
    launch = runner.launch

    def watched(batch, *args, **kwargs):
        with host_syncs() as events:
            launched = launch(batch, *args, **kwargs)
        waits.extend(events)
        return launched

    runner.launch = watched
    return waits


def greedy(llm: LLM, prompts, max_tokens: list[int]):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return tokens, logprobs


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_runs_on_the_device_stand_in_at_hf_parity(arch, model_dir):
    """Build (weights made on the device, the profiling forward), prompt steps through the
    staging buffers, the elementwise layers on the platform's Triton kernels, decode steps
    replayed from recorded graphs (buckets 4, 2 and 1): no host tensor meets a device one, and
    the tokens and logprobs are HF's."""
    prompts, max_tokens = [p[:14] for p in PROMPTS[:3]], [6, 4, 2]
    with fake_cuda():
        llm = fake_cuda_llm(model_dir(arch))
        engine = llm.llm_engine
        assert len(engine.platform.peaks) == 1
        assert isinstance(next(engine.runner.model.parameters()), DeviceTensor)
        ops = [m for m in engine.runner.model.modules() if isinstance(m, CustomOp)]
        assert all(m.op_impl in FUSED_OPS.values() for m in ops)  # every elementwise op on its Triton kernel
        tokens, logprobs = greedy(llm, prompts, max_tokens)
        graphs = engine.runner.model_step.graphs.graphs
        assert graphs[4].replays > 0 and graphs[2].replays > 0 and graphs[1].replays > 0
    reference = hf_greedy(model_dir(arch), prompts, max_tokens)
    assert_matches_reference(reference, tokens, logprobs)


@pytest.mark.parametrize("custom_ops", [["-fused_moe"], ["none"]])
def test_a_moe_model_on_its_loop_path_decodes_without_graphs(custom_ops, model_dir):
    """The mixture-of-experts loop (``FusedMoE.forward_native``) reads each expert's token count
    back, which a CUDA graph cannot record: where custom_ops turns the fused kernel off, decode
    steps run without graphs (enforce_eager not needed), at HF parity."""
    prompts, max_tokens = [p[:14] for p in PROMPTS[:2]], [5, 3]
    with fake_cuda():
        llm = fake_cuda_llm(model_dir("mixtral"), compilation_config={"custom_ops": custom_ops})
        assert llm.llm_engine.runner.model_step.graphs is None
        tokens, logprobs = greedy(llm, prompts, max_tokens)
    reference = hf_greedy(model_dir("mixtral"), prompts, max_tokens)
    assert_matches_reference(reference, tokens, logprobs)


def test_mutation_recording_the_moe_loop_fails(model_dir, monkeypatch):
    monkeypatch.setattr(FusedMoE, "native_in_graphs", True)
    with fake_cuda(), pytest.raises(HostSyncError, match="bincount"):
        fake_cuda_llm(model_dir("mixtral"), compilation_config={"custom_ops": ["-fused_moe"]})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prompt_prefilled_in_chunks_stages_each_chunk_after_the_last_ones_copies(async_scheduling, model_dir):
    """A prompt of several chunks runs steps that sample nothing, so no result is read between
    them: the host must not refill the pinned staging buffers before the device has run the
    last chunk's copies out of them (the stand-in raises ``PinnedBufferRace`` where a GPU would
    copy the next chunk's inputs into this one); so must one-token rows that sample nothing,
    replayed from the recorded graphs. Tokens and logprobs are HF's."""
    prompts, max_tokens = [PROMPTS[2][:100], PROMPTS[0][:10]], [4, 4]  # 32 tokens a step: 3 chunk-only steps
    assert len(prompts[0]) > 3 * 32
    with fake_cuda():
        tokens, logprobs = greedy(fake_cuda_llm(model_dir("llama"), async_scheduling=async_scheduling),
                                  prompts, max_tokens)
        # one token a step: the prompt's steps are one-token rows that sample nothing, replayed
        # from the recorded graphs, which stage their inputs through the same buffers
        one_by_one = fake_cuda_llm(model_dir("llama"), async_scheduling=async_scheduling, max_num_batched_tokens=1,
                                   max_num_seqs=1, long_prefill_token_threshold=1)
        single_tokens, single_logprobs = greedy(one_by_one, prompts[1:], [4])
        assert one_by_one.llm_engine.runner.model_step.graphs.graphs[1].replays > len(prompts[1])
    reference = hf_greedy(model_dir("llama"), prompts, max(max_tokens))
    assert_matches_reference(reference, tokens, logprobs)
    assert_matches_reference(reference[1:], single_tokens, single_logprobs)


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
@pytest.mark.parametrize("name", QUANTIZED)
def test_every_quantization_method_applies_to_device_weights(name):
    """Each method's weight processing and ``apply`` on device weights (FP8 through
    ``torch._scaled_mm`` or the block-FP8 Triton GEMM, as the cuda platform picks; GPTQ/AWQ
    through their Triton GEMM) reproduce the checkpoint's reference logits."""
    path = CHECKPOINTS / name
    reference = load_file(path / "reference.safetensors")
    # per-tensor and per-channel FP8 take torch._scaled_mm, which "auto" gives 16-bit models on a GPU
    config = load_config(model=str(path), device="fake-cuda", attention_backend="triton", dtype="float32",
                         block_size=8, max_num_seqs=1, max_num_batched_tokens=24, kv_cache_memory_bytes=2**23,
                         enforce_eager=True)
    if "fp8" in name and "block" not in name:
        config.quantization.fp8_kernel = "scaled_mm"
    with fake_cuda():
        engine = LLM(config=config, plugin_manager=with_platforms(FakeCudaPlatform)).llm_engine
        logits = prompt_logits(engine, reference["input_ids"][0].tolist()).cpu()  # one prompt: interpreted GEMMs
    expected = reference["logits_w8a8" if "fp8" in name else "logits_ref"][0]
    # the block-FP8 GEMM sums in another order than the reference, which flips a few FP8
    # roundings of the next layer's activations (tests/test_block_fp8_kernel.py): its bound
    # is the GPU test's; every other method is exact up to fp32 summation
    bound = 1e-2 if name == "fp8-block" else 1e-3
    assert ((logits - expected).norm() / expected.norm()).item() < bound


def load_overhead(name: str) -> tuple[int, int]:
    """(the device memory loading ``name`` peaked at above what it left resident, the largest
    layer's packed weight words), on the stand-in."""
    load, seen = model_builder._load_checkpoint, {}

    def measured(model, model_config):
        # device tensors earlier tests left in reference cycles are freed now, not by a collection
        # during the load, which would count them as the load's (peak before, freed after)
        gc.collect()
        DEVICE_MEMORY.reset_peak()
        load(model, model_config)
        seen["overhead"] = DEVICE_MEMORY.peak - DEVICE_MEMORY.allocated
        seen["largest"] = max(buffer.numel() * buffer.element_size() for key, buffer in model.named_buffers()
                              if key.endswith("t_qweight"))

    model_builder._load_checkpoint = measured
    try:
        with fake_cuda():
            fake_cuda_llm(CHECKPOINTS / name, enforce_eager=True)
    finally:
        model_builder._load_checkpoint = load
    return seen["overhead"], seen["largest"]


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
@pytest.mark.parametrize("name", [name for name in QUANTIZED if "gptq" in name or "awq" in name])
def test_gptq_and_awq_load_without_unpacking_on_the_device(name):
    """A GPU's memory is full of weights at load: GPTQ's packed words feed the Triton GEMM as they
    are and AWQ's are repacked word by word, so loading peaks at most one layer's packed words
    above what it keeps (unpacking to ints and repacking them took ~20 bytes a parameter of the
    largest layer: over 10 GB for a 70B model's)."""
    overhead, largest = load_overhead(name)
    assert overhead <= 1.25 * largest


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
def test_garbage_collected_during_a_load_is_not_counted_as_its_overhead(monkeypatch):
    """An earlier test's device tensors in a reference cycle, collected in the middle of the load
    (an automatic collection, as the tests before make them): CI measured 9 MB of overhead so,
    in one order of the tests, where the load's own is under 4 kB."""
    freeze_import_heap()  # its collection, where this process built no engine yet, comes first
    gc.disable()
    try:
        with fake_cuda():
            left = {"tensor": torch.empty(1 << 21, device="cuda")}
            left["self"] = left
        del left
        load = model_builder._load_checkpoint

        def collecting(model, model_config):
            gc.collect()
            load(model, model_config)

        monkeypatch.setattr(model_builder, "_load_checkpoint", collecting)
        overhead, largest = load_overhead("gptq-w4g64-sym-v1-rtn")
    finally:
        gc.enable()
    assert overhead <= 1.25 * largest


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
@pytest.mark.parametrize("name", ["gptq-w4g64-sym-v1-rtn", "awq-w4g64-gemm-rtn"])
def test_mutation_weights_unpacked_and_repacked_at_load_fail(name, monkeypatch):
    from tokenmill.plugins.quantization import awq, gptq, packing

    def repacked(qweight, zeros, scales, g_idx, bits, *args, **kwargs):
        words = packing.pack(packing.unpack(qweight, bits, dim=0), bits, dim=0)
        return TritonGroupQuantizedLinear(words, zeros, scales, g_idx, bits, *args, **kwargs)

    monkeypatch.setattr(awq, "awq_to_gptq", lambda words: packing.pack(packing.unpack_awq(words), 4, dim=0))
    monkeypatch.setattr(gptq, "TritonGroupQuantizedLinear", repacked)
    overhead, largest = load_overhead(name)
    assert overhead > 10 * largest


def test_mutation_profiling_forward_without_staging_fails(model_dir, monkeypatch):
    """The GPU bug put back: the profiling step's token ids stay on the host."""

    class NoStaging:
        @staticmethod
        def for_platform(platform):
            return None

    monkeypatch.setattr(memory_profile, "InputStaging", NoStaging)
    with fake_cuda(), pytest.raises(DeviceMismatchError, match="aten.embedding"):
        fake_cuda_llm(model_dir("llama"))


def profile_and_sampling_peaks(model_dir) -> tuple[int, int]:
    """(the startup profile's device memory peak, the highest peak of a real step's sampling),
    on the stand-in, for ``max_num_seqs`` requests with penalties, top-k/top-p and 20 logprobs:
    the sampler's [rows, vocab] temporaries outweigh this tiny model's forward pass."""
    peaks = []
    with fake_cuda():
        llm = fake_cuda_llm(model_dir("llama"), max_num_seqs=8, max_num_batched_tokens=8)
        sampler = llm.llm_engine.runner.sampler
        sample = sampler.sample

        def measured(logits, rows):
            before = DEVICE_MEMORY.allocated
            DEVICE_MEMORY.reset_peak()
            out = sample(logits, rows)
            peaks.append(DEVICE_MEMORY.peak - before)
            return out

        sampler.sample = measured
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, repetition_penalty=1.2,
                                frequency_penalty=0.2, max_tokens=3, ignore_eos=True, logprobs=20)
        llm.generate([{"prompt_token_ids": p[:3]} for p in (PROMPTS * 2)[:8]], params, use_tqdm=False)
    return llm.llm_engine.platform.peaks[0], max(peaks)


def test_the_memory_profile_holds_the_largest_sampling_step(model_dir):
    """The KV cache gets what the profile leaves: the profile runs the sampler on as many rows as
    a step can sample, so that a full batch of random rows cannot run out of device memory."""
    profiled, sampling = profile_and_sampling_peaks(model_dir)
    assert 0 < sampling <= profiled


def test_mutation_a_profile_without_sampling_is_below_a_sampling_step(model_dir, monkeypatch):
    monkeypatch.setattr(model_builder, "profile_sampling", lambda *args: None)
    profiled, sampling = profile_and_sampling_peaks(model_dir)
    assert profiled < sampling


@pytest.mark.skipif(not CHECKPOINTS.is_dir(), reason=f"shared checkpoints not found at {CHECKPOINTS}")
def test_mutation_fp8_scale_repeated_by_a_host_tensor_fails(monkeypatch):
    """The GPU bug put back: a per-tensor FP8 scale on the device repeated by host counts."""
    expanded_scale = fp8.Fp8LinearMethod._expanded_scale

    def host_repeats(self, layer, shape):
        if self.scheme.weights != "tensor":
            return expanded_scale(self, layer, shape)
        scale = getattr(layer, self.scheme.scale_name).data
        return torch.repeat_interleave(scale, torch.tensor(layer.quant_output_sizes)).unsqueeze(1)

    monkeypatch.setattr(fp8.Fp8LinearMethod, "_expanded_scale", host_repeats)
    with fake_cuda(), pytest.raises(DeviceMismatchError, match="same device"):
        fake_cuda_llm(CHECKPOINTS / "fp8-tensor-static", enforce_eager=True)


def test_the_draft_model_replays_its_decode_passes_from_recorded_graphs(model_dir):
    """A draft model decodes k one-token passes a step, each bound by its launches on a GPU:
    it records its own decode graphs over its own cache, and its passes replay them. The
    target drafts for itself, so every draft is accepted only where the replayed passes read
    the right buffers (positions, blocks, the KV the catch-up pass wrote); tokens and logprobs
    are HF's. Its passes chain on the device: a proposal reads the device back once, for all
    its drafts, and a pass's staging waits for the pass before last only. Mutations: graphs
    recorded before the cache is bound read freed memory (the proposals fail, and the steps go
    without drafts); one set of staging buffers waits for the last pass."""
    prompts, max_tokens = [p[:14] for p in PROMPTS[:3]], [9, 7, 5]
    with fake_cuda():
        llm = fake_cuda_llm(model_dir("llama"), speculative_config={"model": str(model_dir("llama")),
                                                                    "num_speculative_tokens": 3})
        engine = llm.llm_engine
        draft, waits = engine.speculator.proposer.model, []
        decode = draft.greedy_decode

        def watched(*args):
            with host_syncs() as events:
                drafts = decode(*args)
            waits.append(events)
            return drafts

        draft.greedy_decode = watched
        # the staging buffers' waits: each names the pass whose mark it waits for (a mark follows
        # a replay, so on a GPU waiting for the last pass's would wait for its forward)
        step, passes, staged = draft.model_step, [0], []
        run, record = step.run, step.staging._record_event

        def counted(*args, **kwargs):
            passes[0] += 1
            return run(*args, **kwargs)

        def tagged():
            event, made = record(), passes[0]

            class Tagged:
                def synchronize(self) -> None:
                    staged.append((made, passes[0]))
                    event.synchronize()

            return Tagged()

        step.run, step.staging._record_event = counted, tagged
        tokens, logprobs = greedy(llm, prompts, max_tokens)
        # the drafts, read once; the other waits are the staging buffers'
        reads = [[e for e in events if e != "waited for a recorded event"] for events in waits]
        assert reads and all(r == ["tolist of a device tensor"] for r in reads), waits
        # ... for the pass before last: the host builds a pass while the last one runs
        assert staged and all(made <= now - 2 for made, now in staged), staged
        graphs = engine.speculator.proposer.model.model_step.graphs
        assert graphs is not engine.runner.model_step.graphs
        # two speculating steps at least (4 tokens each), each a catch-up pass then two one-token passes
        assert sum(graph.replays for graph in graphs.graphs.values()) >= 4
        # a failed proposal goes without drafts (the step survives it): so count the drafts too
        stats = engine.scheduler.spec_stats
        assert stats.num_drafts >= 4 and stats.acceptance_rate > 0.9, stats
    reference = hf_greedy(model_dir("llama"), prompts, max_tokens)
    assert_matches_reference(reference, tokens, logprobs)


def test_mutation_graph_metadata_freed_after_capture_fails(model_dir):
    """The graph crash put back: each bucket's attention metadata freed once its graph is
    recorded (what DecodeGraphs did before it kept them), so replays read freed memory."""
    with fake_cuda():
        llm = fake_cuda_llm(model_dir("llama"))
        llm.llm_engine.runner.model_step.graphs.metadata.clear()
        gc.collect()
        with pytest.raises(FreedTensorError):
            llm.llm_engine.runner.model_step.run(Step([Row([7], 3, [1])], [0], False))


def test_device_rules_follow_cuda():
    """What CUDA refuses is refused; what it allows (host scalars, copies, host indices) runs."""
    with fake_cuda(), torch.inference_mode():
        weight = torch.randn(10, 4, device="cuda")
        with pytest.raises(DeviceMismatchError):
            torch.nn.functional.embedding(torch.tensor([1, 2]), weight)
        with pytest.raises(DeviceMismatchError):
            weight + torch.ones(10, 4)
        with pytest.raises(DeviceMismatchError):
            torch.repeat_interleave(torch.ones(2, device="cuda"), torch.tensor([2, 3]))
        with pytest.raises(TypeError, match="numpy"):
            weight.numpy()
        assert torch.equal((weight * torch.tensor(2.0)).cpu(), weight.cpu() * 2)  # a host scalar
        assert torch.equal(weight[torch.tensor([3, 1])].cpu(), weight.cpu()[[3, 1]])  # a host index
        staged = torch.zeros(4, pin_memory=True)
        staged.copy_(torch.arange(4.0))
        assert isinstance(staged.to("cuda", non_blocking=True), DeviceTensor)
        assert np.array_equal(weight.tolist(), weight.cpu().numpy())
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator"):
            weight.exponential_(generator=torch.Generator().manual_seed(0))  # a host generator
        mask = weight[:, 0] > 0
        with host_syncs() as waits:  # each waits for the device, as its output is sized by values
            weight[mask], weight.masked_select(weight > 0), torch.unique(weight), mask.nonzero(), weight.cpu()
            repr(weight)
        assert len(waits) == 6
        index = torch.tensor([3, 1], device="cuda")
        with host_syncs() as waits:  # sized without reading values
            weight[index], torch.where(mask, weight[:, 0], weight[:, 1])
        assert waits == []


def test_an_embedding_model_runs_on_the_device_stand_in(model_dir):
    """The encoder path (tokenize, batch, encode, pool) with the model on the device: its ids,
    mask and positions go there, the embeddings come back to the host, equal to the CPU's."""
    texts = ["The quick brown fox", "a", "Rivers run to the sea, and the sea returns to the clouds"]
    cpu = torch.tensor(LLM(str(model_dir("bert"))).embed(texts))
    with fake_cuda():
        llm = LLM(config=load_config(model=str(model_dir("bert")), device="fake-cuda", dtype="float32"),
                  plugin_manager=with_platforms(FakeCudaPlatform))
        assert isinstance(next(llm.llm_engine.model.parameters()), DeviceTensor)
        device = torch.tensor(llm.embed(texts))
    torch.testing.assert_close(device, cpu, atol=1e-6, rtol=1e-6)


def test_sleep_frees_the_device_memory_and_waking_gives_the_same_tokens(model_dir):
    """Sleep mode on the cuda platform (a trainer takes the GPU's memory between rollouts):
    level 1 moves the weights to the host and frees the KV cache, level 2 frees the weights
    too, reloaded from the checkpoint through each parameter's loader (level 2 after level 1
    as well). The device memory of both goes, cycle after cycle, and comes back with the same
    tokens (the graphs recorded again over the new addresses). Level 1's copies go through
    pinned memory: one wait for them all at sleep, one at wake (a pageable copy waited per
    parameter each way)."""
    def held() -> int:
        gc.collect()
        return DEVICE_MEMORY.allocated

    with fake_cuda():
        llm = fake_cuda_llm(model_dir("llama"), enable_sleep_mode=True, max_num_seqs=2)  # graphs of 1 and 2 rows
        engine = llm.llm_engine
        weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
        prompts = [p[:14] for p in PROMPTS[:2]]  # one prompt step: the test is about the memory, not chunks
        before = greedy(llm, prompts, [4, 4])
        awake = held()
        for levels in ((1,), (2,), (1, 2)):  # level 2 after level 1: the weights on the host go
            for level in levels:
                with host_syncs() as waits:
                    llm.sleep(level=level)
                assert len(waits) <= 1, waits
                assert held() <= awake - weights - 2**23  # the KV cache: kv_cache_memory_bytes
            with host_syncs() as waits:
                llm.wake_up()
            assert levels != (1,) or len(waits) == 1, waits
            assert greedy(llm, prompts, [4, 4]) == before
            engine.platform.graphs.clear()  # the stand-in keeps every graph it recorded, for tests
            assert held() <= awake


def test_lora_on_the_device_stand_in_launches_its_steps_without_a_wait(model_dir, tmp_path):
    """An adapter in the batch (the Triton LoRA kernel, async scheduling): the CPU engine's tokens,
    and each step launched without a wait for the device, the step that puts the adapter in its
    slot included (its weights cross from pinned memory, not with a blocking copy per part and
    layer). The token slots go to the device once a step, not with a blocking copy in every LoRA
    layer (each would wait for every kernel queued before it)."""
    from tokenmill.interfaces.adapters import LoRARequest
    from tokenmill.testing.tiny_adapters import make_lora_adapter

    adapter = make_lora_adapter(model_dir("llama"), tmp_path / "qvo", rank=4, targets=["q_proj", "v_proj", "o_proj"])
    prompts = [{"prompt_token_ids": PROMPTS[0][:12]}, {"prompt_token_ids": PROMPTS[1][:12]}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    requests = [LoRARequest("qvo", 1, str(adapter)), None]
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    cpu = LLM(str(model_dir("llama")), block_size=8, **lora).generate(prompts, params, use_tqdm=False,
                                                                       lora_request=requests)
    with fake_cuda():
        llm = fake_cuda_llm(model_dir("llama"), **lora)
        waits = launch_waits(llm)
        first = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
        device = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    assert llm.llm_engine.scheduler.async_scheduling
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in cpu]
    assert [o.outputs[0].token_ids for o in device] == [o.outputs[0].token_ids for o in cpu]
    assert waits == []


def test_pinned_memory_is_written_again_only_after_its_copies_ran():
    """A non-blocking copy out of pinned memory runs when the device reaches it: writing the
    buffer before the host knows that (an event recorded after the copy, or a wait for the
    device) is refused; pageable memory is copied before the call returns, so it is free."""
    from tokenmill.testing.pinned_copies import PinnedBufferRace
    from tokenmill.testing.fake_cuda_platform import StandInEvent

    with fake_cuda(), torch.inference_mode():
        pinned, pageable = torch.zeros(4, pin_memory=True), torch.zeros(4)
        pinned.to("cuda", non_blocking=True)
        pageable.to("cuda", non_blocking=True)
        pageable.copy_(torch.ones(4))
        with pytest.raises(PinnedBufferRace):
            pinned.copy_(torch.ones(4))
        event = StandInEvent()
        device = torch.zeros(4, device="cuda")
        device.copy_(pinned, non_blocking=True)  # queued after the event: still running after it
        event.synchronize()
        with pytest.raises(PinnedBufferRace):
            pinned.copy_(torch.ones(4))
        StandInEvent().synchronize()
        pinned.copy_(torch.ones(4))
        received = torch.zeros(4, pin_memory=True)
        received.copy_(device, non_blocking=True)  # the device writes it later
        with pytest.raises(PinnedBufferRace):
            received.copy_(torch.ones(4))
        device.tolist()  # a read back waits for the whole queue
        received.copy_(torch.ones(4))


def test_copies_into_pinned_memory_land_when_the_host_waits_past_them():
    """A non-blocking copy from the device into pinned memory is done when the device's queue
    reaches it: until the host waits past it (an event recorded after it, a read back), the
    buffer holds its old values, as on a GPU. Into pageable memory, CUDA returns only once
    the copy landed, so that copy is a wait; ``.to("cpu", non_blocking=True)`` gives pinned
    memory (torch's rule) that the values reach later."""
    from tokenmill.testing.fake_cuda_platform import StandInEvent

    with fake_cuda(), torch.inference_mode():
        device = torch.arange(4, dtype=torch.float32, device="cuda")
        received = torch.zeros(4, pin_memory=True)
        received.copy_(device, non_blocking=True)
        before = StandInEvent()  # recorded before the next copy: waiting for it lands this one only
        later = torch.zeros(4, pin_memory=True)
        device.add_(10)  # a kernel after the copy: the copy reads the values before it
        later.copy_(device, non_blocking=True)
        assert received.tolist() == [0.0] * 4 and later.tolist() == [0.0] * 4  # not landed: the old values
        before.synchronize()
        assert received.tolist() == [0.0, 1.0, 2.0, 3.0] and later.tolist() == [0.0] * 4
        StandInEvent().synchronize()
        assert later.tolist() == [10.0, 11.0, 12.0, 13.0]
        with host_syncs() as waits:
            moved = device.to("cpu", non_blocking=True)
            StandInEvent().synchronize()
        assert moved.tolist() == [10.0, 11.0, 12.0, 13.0] and waits == ["waited for a recorded event"]
        pageable = torch.zeros(4)
        with host_syncs() as waits:
            pageable.copy_(device, non_blocking=True)
        assert pageable.tolist() == [10.0, 11.0, 12.0, 13.0] and len(waits) == 1 and "pageable" in waits[0]


def test_a_device_tensor_has_an_address_of_its_own_and_copies_as_one():
    """Each device tensor gives its values' address (code that tells tensors apart by address,
    as a recorded graph's keep-or-record check does, sees one move), a view the address of its
    first element; ``copy.deepcopy`` gives a device tensor (a parameter stays one) with values
    of its own."""
    import copy

    with fake_cuda():
        layer = torch.nn.Linear(4, 4, device="cuda")
        weight = layer.weight
        assert weight.data_ptr() != layer.bias.data_ptr() != 0
        assert weight[1].data_ptr() == weight.data_ptr() + 4 * weight.element_size()
        moved = weight.data_ptr()
        weight.data = weight.data.clone()
        assert weight.data_ptr() != moved
        twin = copy.deepcopy(layer)
        assert isinstance(twin.weight, (DeviceTensor, torch.nn.Parameter)) and twin.weight.device.type == "cuda"
        assert isinstance(twin.weight, torch.nn.Parameter) and twin.weight.data_ptr() != weight.data_ptr()
        with torch.no_grad():
            twin.weight.add_(1)
        assert torch.equal(host_value(twin.weight), host_value(weight) + 1)


def test_mutation_sampled_tokens_read_before_their_copy_landed_fails(model_dir, monkeypatch):
    """Reading a step's sampled tokens from their pinned buffers without waiting for the event
    after their copy reads whatever the buffers held before (on a GPU: a token of an earlier
    step, or garbage): the tokens are no longer Hugging Face's."""
    from tokenmill.core.worker.input_staging import HostCopies

    monkeypatch.setattr(HostCopies, "wait", lambda self: self.tensors)
    prompt = {"prompt_token_ids": PROMPTS[0][:12]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with fake_cuda():
        output = fake_cuda_llm(model_dir("llama")).generate([prompt], params, use_tqdm=False)
    assert output[0].outputs[0].token_ids != hf_greedy(model_dir("llama"), [prompt["prompt_token_ids"]], 6)[0].token_ids


def test_mutation_staging_refilled_before_its_copies_ran_fails(model_dir, monkeypatch):
    """Without the mark after each step's input copies, the next prompt chunk refills the pinned
    buffers while the device may still be copying out of them: the chunked prompt fails."""
    from tokenmill.core.worker.input_staging import InputStaging

    monkeypatch.setattr(InputStaging, "mark_copies", lambda self: None)
    with fake_cuda():
        llm = fake_cuda_llm(model_dir("llama"), async_scheduling=False)
        output = llm.generate([{"prompt_token_ids": PROMPTS[2][:100]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert output[0].outputs[0].finish_reason == "error"


def test_triton_kernels_refuse_host_tensors():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(ptr, n: tl.constexpr):
        offsets = tl.arange(0, n)
        tl.store(ptr + offsets, tl.load(ptr + offsets) + 1)

    with fake_cuda():
        device = torch.zeros(4, device="cuda")
        add_one[(1,)](device, 4)
        assert device.cpu().tolist() == [1.0] * 4
        with pytest.raises(ValueError, match="cpu tensor"):
            add_one[(1,)](torch.zeros(4), 4)


def test_a_seeded_request_speculates_with_its_device_generator(model_dir):
    """A seeded request's generator is the device's: its draft acceptance draws (the uniforms of
    rejection sampling) are made on the device too. A host draw from a CUDA generator raises
    ("Expected a 'cpu' device type for generator"); the stand-in's device generators refuse it
    the same way. The request samples alike when run again."""
    prompt = (PROMPTS[0][:6] * 4)[:24]
    params = SamplingParams(temperature=0.7, seed=7, max_tokens=32, ignore_eos=True)
    with fake_cuda():  # a one-token match drafts (the seed fixes what is drawn, drafts included)
        llm = fake_cuda_llm(model_dir("llama"), enforce_eager=True, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
        runs = [llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0] for _ in range(2)]
        assert [run.finish_reason for run in runs] == ["length", "length"]  # no step failed
        assert llm.llm_engine.scheduler.spec_stats.num_drafts > 0
    assert runs[0].token_ids == runs[1].token_ids
    with fake_cuda(), pytest.raises(RuntimeError, match="device type for generator"):
        torch.rand(3, generator=FakeCudaPlatform.noise_generator(None, 1))


def test_verifying_drafts_reads_the_device_back_as_often_whatever_the_batch():
    """Rejection sampling reads the device back a fixed number of times however many requests
    verify: p and q of every draft with the seeded requests' uniforms, the residuals' draws, the
    logprobs of every request at once. A read per request (a seeded one's uniforms, a rejected
    one's residual sum, a logprobs request's tokens) would wait for the device once each."""
    from tokenmill.core.sample.rejection_sampler import verify
    from tokenmill.core.sample.sampler import Sampler, SamplingRow
    from tokenmill.testing.fake_cuda import device_generator

    def waits(requests: int) -> list[str]:
        g = torch.Generator().manual_seed(requests)
        with fake_cuda(), torch.inference_mode():
            rows, draft_probs = [], []
            for i in range(requests):  # every other one seeded, with a draft distribution; a third with logprobs
                params = SamplingParams(temperature=1.0, seed=i if i % 2 else None, logprobs=1 if i % 3 else None)
                rows += [SamplingRow(params, (), (), device_generator(i) if i % 2 else None)] * 4
                draft_probs.append(torch.softmax(torch.randn(3, 16, generator=g), -1).to("cuda") if i % 2 else None)
            logits = torch.randn(4 * requests, 16, generator=g).to("cuda")
            drafts = torch.randint(16, (requests, 3), generator=g).tolist()
            with host_syncs() as events:
                verified = verify(Sampler(0, noise_generator=device_generator(99)), logits, rows, drafts, draft_probs)
        assert sum(len(v.token_ids) < 4 for v in verified) > requests // 2  # most rejected a draft
        return events

    assert len(waits(12)) == len(waits(3)) <= 6  # the draws, the tests' values, four of the logprobs


def test_a_penalised_request_sends_its_prompt_once_and_its_output_as_it_grows(model_dir):
    """The penalties count the prompt's and the output's tokens every step; the prompt's ids go
    to the device once per request and the output's one step's worth at a time, not the whole
    history every step (a 2k-token prompt at 64 rows is 128k ids of Python and a copy, a step;
    1024 rows of 1k outputs 140 ms), and the tokens are the CPU engine's."""
    from tokenmill.testing.device_queue import host_to_device_copies

    prompt = (PROMPTS[0] * 2)[:37]  # prefilled in chunks of 32 and 5
    params = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5, max_tokens=24,
                            ignore_eos=True)
    with fake_cuda():
        llm = fake_cuda_llm(model_dir("llama"))
        with host_to_device_copies() as copies:
            device = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert copies.count((37,)) == 1
    assert not [shape for shape in copies if len(shape) == 1 and 6 <= shape[0] <= 23]  # no output history
    cpu = make_llm(model_dir("llama")).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert device.outputs[0].token_ids == cpu.outputs[0].token_ids


def test_random_sampling_draws_its_noise_on_the_device(model_dir):
    """Random rows draw the sampling noise with device generators (the platform's): a step
    copies the device no [rows, vocab] host tensor (on a GPU, 32 MB a step at 256 rows of a
    32k vocabulary), nor a seeded row's vocabulary-long draw (a host loop of 5-13 ms at a
    152k vocabulary). A seeded request samples alike in another batch. Mutation: drawn on the
    host and copied over, the first check fails."""
    from tokenmill.testing.device_queue import host_to_device_copies

    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    with fake_cuda():
        llm = fake_cuda_llm(model_dir("llama"))
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [{"prompt_token_ids": p[:10]} for p in PROMPTS[:4]]
        with host_to_device_copies() as copies:
            llm.generate(prompts, params, use_tqdm=False)
        assert copies and max(math.prod(shape) for shape in copies) < vocab
        seeded = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3)
        with host_to_device_copies() as copies:
            batched = llm.generate(prompts, [params] * 3 + [seeded], use_tqdm=False)[3]
        assert max(math.prod(shape) for shape in copies) < vocab
        alone = llm.generate(prompts[3:], seeded, use_tqdm=False)[0]
        assert batched.outputs[0].token_ids == alone.outputs[0].token_ids
