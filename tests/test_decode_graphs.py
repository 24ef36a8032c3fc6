"""Decode steps replayed from recorded graphs: bucketing, padding and the engine at HF parity.

No GPU here, so the recording is ``RecordingPlatform``'s stand-in (``device_graphs.record``:
the aten operations and Triton launches of one run, re-issued on the same tensors without
running Python; what capture refuses is refused); the attention is the Triton backend in
the interpreter, through the same runner and metadata a GPU uses.
tests/test_device_boundaries.py runs the same path on the CUDA stand-in device, and
tests/gpu/test_cuda_graphs.py compares real CUDA graphs with eager decoding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import PROMPTS, with_platforms
from tokenmill import LLM, SamplingParams, load_config
from tokenmill.core.config.compilation_config import CompilationConfig
from tokenmill.core.worker.decode_graphs import DecodeGraphs
from tokenmill.testing.device_graphs import FreedTensorError, HostSyncCheck, HostSyncError, RecordingPlatform, record
from tokenmill.testing.fake_cuda import fake_cuda
from tokenmill.testing.hf_reference import assert_matches_reference, hf_greedy


def graphed_llm(model_dir, arch: str, **overrides) -> LLM:
    args = dict(model=str(model_dir(arch)), device="cpu-graphs", attention_backend="triton", block_size=8,
                max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_bytes=2**23)
    return LLM(config=load_config(**{**args, **overrides}), plugin_manager=with_platforms(RecordingPlatform))


def run(llm: LLM, prompts, max_tokens):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
                            for n in max_tokens], use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return tokens, logprobs


@pytest.mark.parametrize("max_num_seqs,sizes", [
    (1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12]), (20, [1, 2, 4, 8, 16, 20]),
    (256, [1, 2, 4, *range(8, 257, 8)]), (300, [1, 2, 4, *range(8, 256, 8), 256, 272, 288, 300]),
    (1024, [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]),
])
def test_buckets_are_vllms_up_to_max_num_seqs(max_num_seqs, sizes):
    """vLLM's default buckets (1, 2, 4, steps of 8, then of 16 from 256), none above 512 unless
    asked, and max_num_seqs itself, so a full batch replays unpadded."""
    assert CompilationConfig().capture_sizes(max_num_seqs) == sizes


def test_a_batch_pads_by_at_most_a_buckets_step():
    sizes = CompilationConfig().capture_sizes(512)
    for rows in range(1, 513):
        bucket = next(size for size in sizes if size >= rows)
        assert bucket - rows < (8 if rows <= 256 else 16)


@pytest.mark.parametrize("given,max_num_seqs,sizes", [
    ({"max_cudagraph_capture_size": 48}, 256, [1, 2, 4, 8, 16, 24, 32, 40, 48]),
    ({"max_cudagraph_capture_size": 1024}, 1024, [1, 2, 4, *range(8, 256, 8), *range(256, 1025, 16)]),
    ({"max_cudagraph_capture_size": 48}, 16, [1, 2, 4, 8, 16]),
    ({"cudagraph_capture_sizes": [8, 1, 3, 3, 512]}, 256, [1, 3, 8]),
    ({"cudagraph_capture_sizes": [1, 3], "max_cudagraph_capture_size": 3}, 256, [1, 3]),
    ({"cudagraph_capture_sizes": []}, 256, []),
])
def test_vllms_capture_sizes_choose_the_buckets(given, max_num_seqs, sizes):
    """vLLM's names: the sizes as given, or vLLM's buckets up to the largest; none above max_num_seqs."""
    assert CompilationConfig(**given).capture_sizes(max_num_seqs) == sizes


def test_a_step_replays_the_smallest_given_size_that_holds_it_and_runs_eagerly_above(model_dir):
    """Buckets 1 and 3 only: decode batches of 2 and 3 replay bucket 3, of 1 bucket 1, and a
    batch of 4 (above the largest) runs eagerly; the tokens are those of the same engine without
    graphs, and the tokens and logprobs HF's."""
    prompts, max_tokens = [p[:10] for p in PROMPTS[:4]], [10, 7, 5, 3]
    llm = graphed_llm(model_dir, "llama", compilation_config={"cudagraph_capture_sizes": [1, 3]})
    graphs = llm.llm_engine.runner.model_step.graphs
    assert sorted(graphs.graphs) == [1, 3]
    tokens, logprobs = run(llm, prompts, max_tokens)
    assert graphs.graphs[3].replays > 0 and graphs.graphs[1].replays > 0
    eager = graphed_llm(model_dir, "llama", enforce_eager=True)
    assert eager.llm_engine.runner.model_step.graphs is None and run(eager, prompts, max_tokens)[0] == tokens
    reference = hf_greedy(model_dir("llama"), prompts, max_tokens)
    assert_matches_reference(reference, tokens, logprobs)


@pytest.mark.parametrize("arch", ["llama"])
def test_engine_with_recorded_decode_steps_matches_hf(arch, model_dir):
    """Three requests of different lengths: decode batches of 3 (bucket 4, one padding row),
    2 and 1 replay their graphs; prompts (chunks of 16) run eagerly; tokens and logprobs are
    HF's, and those of the same engine without graphs."""
    prompts = [(p * 3)[:n] for p, n in zip(PROMPTS[:3], (32, 20, 9))]
    max_tokens = [12, 8, 4]
    llm = graphed_llm(model_dir, arch, max_num_batched_tokens=16)
    graphs = llm.llm_engine.runner.model_step.graphs
    assert isinstance(graphs, DecodeGraphs) and sorted(graphs.graphs) == [1, 2, 4]
    tokens, logprobs = run(llm, prompts, max_tokens)
    reference = hf_greedy(model_dir(arch), prompts, max_tokens)
    assert_matches_reference(reference, tokens, logprobs)
    assert graphs.graphs[4].replays > 0 and graphs.graphs[2].replays > 0 and graphs.graphs[1].replays > 0
    eager = graphed_llm(model_dir, arch, max_num_batched_tokens=16, enforce_eager=True)
    assert eager.llm_engine.runner.model_step.graphs is None
    assert run(eager, prompts, max_tokens)[0] == tokens


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gpt2"])
def test_every_family_records_its_decode_step_without_host_synchronisation(arch, model_dir):
    """Recording runs under the stand-in's host-sync check (CUDA capture would fail on a
    ``.tolist()`` in the forward pass); the replayed steps decode as the same engine's eager
    steps (run second, on the prefix-cached prompts)."""
    prompts, max_tokens = [p[:12] for p in PROMPTS[:3]], [6, 4, 2]
    llm = graphed_llm(model_dir, arch)
    step = llm.llm_engine.runner.model_step
    tokens, logprobs = run(llm, prompts, max_tokens)
    assert step.graphs.graphs[4].replays > 0
    step.graphs = None
    eager_tokens, eager_logprobs = run(llm, prompts, max_tokens)
    assert tokens == eager_tokens
    assert np.allclose(np.concatenate(logprobs), np.concatenate(eager_logprobs), atol=1e-5)


def test_padding_rows_write_no_kv_and_real_rows_read_their_own(model_dir):
    """A step of 3 decode rows replays bucket 4: the KV cache changes at the 3 real slots
    only, and the hidden states equal an eager forward of the same rows."""
    llm = graphed_llm(model_dir, "llama")
    step = llm.llm_engine.runner.model_step
    graphs, model = step.graphs, step.model
    caches = [m.kv_cache for m in model.modules() if hasattr(m, "kv_cache")]
    for cache in caches:
        cache.normal_()
    before = [cache.clone() for cache in caches]
    token_ids = np.array([5, 6, 7])
    positions = np.array([3, 10, 0])
    block_table = np.array([[1, 2], [3, 4], [5, 0]], dtype=np.int32)
    slots = np.array([1 * 8 + 3, 4 * 8 + 2, 5 * 8 + 0])
    seq_lens = positions + 1
    size = graphs.bucket(np.ones(3, dtype=np.int64), 2)
    assert size == 4
    with torch.inference_mode():
        hidden = graphs.run(size, token_ids, positions, slots, seq_lens, block_table, step._put).clone()
    for cache, old in zip(caches, before):
        changed = (cache != old).any(-1).any(-1).any(0).flatten()  # [2, blocks, block_size, ...] -> per slot
        assert changed.nonzero().flatten().tolist() == sorted(slots.tolist())
        cache.copy_(old)
    from tokenmill.core.distributed.messages import Row, Step  # an eager step of the same rows
    rows = [Row([int(t)], int(p), [int(b) for b in table if b] or [0], None)
            for t, p, table in zip(token_ids, positions, block_table)]
    rows[2] = Row([7], 0, [5], None)
    step.graphs = None
    eager = step.run(Step(rows, [0, 1, 2], False))
    step.graphs = graphs
    torch.testing.assert_close(model.compute_logits(hidden), eager.logits, rtol=1e-5, atol=1e-5)


def test_steps_that_are_not_all_decode_rows_or_too_large_run_eagerly(model_dir):
    graphs = graphed_llm(model_dir, "llama").llm_engine.runner.model_step.graphs
    assert graphs.bucket(np.array([1, 1, 1]), 2) == 4
    assert graphs.bucket(np.array([1]), 2) == 1
    assert graphs.bucket(np.array([1, 2]), 2) is None  # a prompt chunk or a verify step
    assert graphs.bucket(np.ones(5, dtype=np.int64), 2) is None  # past max_num_seqs
    assert graphs.bucket(np.array([1]), graphs.block_table.shape[1] + 1) is None


def test_no_graphs_on_a_platform_without_them_or_with_lora(model_dir):
    cpu = LLM(str(model_dir("llama")), attention_backend="triton", block_size=8, kv_cache_memory_bytes=2**23)
    assert cpu.llm_engine.runner.model_step.graphs is None  # the cpu platform records none
    lora = graphed_llm(model_dir, "llama", enable_lora=True)
    assert lora.llm_engine.runner.model_step.graphs is None  # per-step adapter indices


@pytest.mark.parametrize("operation", [
    lambda x: x.tolist(), lambda x: x[0].item(), lambda x: bool(x[0]), lambda x: x.nonzero(),
    lambda x: x[x > 1], lambda x: torch.bincount(x), lambda x: x.repeat_interleave(x),
    lambda x: x.cpu(), lambda x: x.unique()])
def test_the_stand_in_refuses_what_cuda_capture_refuses(operation):
    x = torch.arange(4)
    with pytest.raises(HostSyncError), HostSyncCheck():
        operation(x)
    with HostSyncCheck():  # device-side work stays allowed
        torch.cumsum(x, 0), x.argsort(), x.repeat_interleave(2), x[torch.tensor([0, 2])]


def test_a_replay_runs_no_python_and_keeps_the_values_fixed_at_capture():
    """As a CUDA graph: the recorded kernels see the buffers' new values, while a Python
    number read at capture stays what it was, and the function itself never runs again."""
    buffer, out, calls, scale = torch.arange(4.0), torch.zeros(4), [], [2.0]

    def run():
        calls.append(1)
        out.copy_(buffer * scale[0] + 1)

    run()
    graph = record(run)
    buffer.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    scale[0] = 100.0
    graph.replay()
    assert len(calls) == 2 and out.tolist() == [21.0, 41.0, 61.0, 81.0]


def test_a_tensor_freed_after_capture_fails_the_replay_and_temporaries_live_on():
    """A tensor made before the recording is held by address only: freed, the replay reads
    freed memory (a GPU's illegal address). What the recording made belongs to the graph."""
    out = torch.zeros(3)
    index = [torch.tensor([2, 0, 1])]

    def run():
        temporary = torch.arange(3.0) * 2  # made while recording: the graph keeps it
        out.copy_(temporary[index[0]])

    graph = record(run)
    graph.replay()
    assert out.tolist() == [4.0, 0.0, 2.0]
    index.clear()
    with pytest.raises(FreedTensorError, match="freed"):
        graph.replay()


def test_copies_between_host_and_device_are_refused_while_recording():
    with fake_cuda():
        device = torch.zeros(4, device="cuda")
        with pytest.raises(HostSyncError, match="between host and device"):
            record(lambda: device.copy_(torch.ones(4)))
        with pytest.raises(HostSyncError):
            record(lambda: device.sum().item())
        graph = record(lambda: device.add_(1))  # device work records
        graph.replay()
        assert device.cpu().tolist() == [2.0] * 4
