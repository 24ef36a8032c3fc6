"""Every registered attention backend equals the torch reference on 200+ randomized cases,
and drives the engine to the same greedy tokens as Hugging Face."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import make_llm
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.interfaces.attention import AttentionLayerSpec
from tokenmill.testing.attention_conformance import check_backend, conformance_cases
from tokenmill.testing.hf_reference import assert_matches_reference

REGISTRY = collect_components(make_plugin_manager()).attention_backends
#: interpreted Triton is slow: its 200 cases are smaller (still mixed, same edge cases); flex takes
#: blocks of 16 and up, a third of the kit's cases, so it draws twice as many
CASES = {name: conformance_cases(200, scale=0.25) if name == "triton"
         else conformance_cases(440 if name == "flex" else 220) for name in REGISTRY.names()}


def backend_for_cases(name: str):
    """The registered backend; flex through FlexAttention's unfused path: compiled, every case's
    own cache size would be another compilation (the compiled path runs in the engine tests
    below, on a cache whose size is fixed, as an engine's is)."""
    return REGISTRY.get(name)(compile=False) if name == "flex" else REGISTRY.get(name)()


@pytest.mark.parametrize("name,case", [(n, c) for n, cases in CASES.items() for c in cases],
                         ids=lambda value: str(value))
def test_backend_matches_reference(name, case):
    """Output and written KV equal the reference (fp32 1e-5, bf16 1e-2)."""
    check_backend(backend_for_cases(name), case)


@pytest.mark.parametrize("backend", [n for n in REGISTRY.names() if n != "triton"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3-moe"])
def test_engine_with_each_backend_matches_hf(backend, arch, model_dir, hf_reference):
    """The engine decodes exactly as HF with each backend selected, chunked prefill included."""
    from tokenmill import SamplingParams

    from conftest import PROMPTS, NEW_TOKENS

    llm = make_llm(model_dir(arch), attention_backend=backend, max_num_batched_tokens=32)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    assert_matches_reference(hf_reference(arch), tokens, logprobs)


def test_auto_picks_the_fast_backend_unless_logits_are_soft_capped(model_dir):
    """'auto' means cpu on this machine, and torch for Gemma-2 (SDPA cannot soft-cap)."""
    def attention_of(arch):
        return make_llm(model_dir(arch)).llm_engine.runner.model.model.layers[0].self_attn.attn.backend.name

    assert attention_of("llama") == "cpu"
    assert attention_of("gemma2") == "torch"


def test_soft_capping_model_on_the_fast_backend_fails_with_the_reason(model_dir):
    """Choosing a backend that cannot run the model fails at startup, saying why."""
    from tokenmill.interfaces.errors import ConfigError

    with pytest.raises(ConfigError, match="soft"):
        make_llm(model_dir("gemma2"), attention_backend="cpu")


@pytest.mark.parametrize("case", conformance_cases(24, seed=7, scale=0.5), ids=str)
def test_triton_split_k_matches_reference(case):
    """Flash-decoding splits (forced by an 8-token split size) merge to the reference result."""
    pytest.importorskip("triton")
    from tokenmill.plugins.attention.triton_paged.backend import TritonPagedAttention

    check_backend(TritonPagedAttention(tokens_per_split=8), case)


#: the decode kernel's small case: 4 query heads over 2 KV heads of 16, blocks of 4 positions
DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM, DECODE_BLOCK = 4, 2, 16, 4


def decode_case(blocks: int, positions: list[int]) -> tuple[torch.Tensor, ...]:
    """(cache, query, block table, rows, positions): a random cache of ``blocks`` blocks, one
    decode row per position, every row's blocks in one random order."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, blocks, DECODE_BLOCK, DECODE_KV_HEADS, DECODE_DIM, generator=g)
    query = torch.randn(len(positions), DECODE_HEADS, DECODE_DIM, generator=g)
    table = torch.randperm(blocks, generator=g).to(torch.int32).reshape(1, blocks).repeat(len(positions), 1)
    return (cache, query, table, torch.arange(len(positions), dtype=torch.int32),
            torch.tensor(positions, dtype=torch.int32))


def test_triton_decode_leaves_the_splits_past_a_context_unwritten(monkeypatch):
    """A recorded decode step splits every row as many ways as its longest allowed context (16):
    the splits past a shorter context write only their statistics, and the merge reads no
    partial row of theirs (on a GPU each would cross memory twice, a head's row per split).
    The partial rows start as NaN here, so a read of an unwritten one would show."""
    pytest.importorskip("triton")
    from tokenmill.plugins.attention.triton_paged import kernels

    partial_rows = []
    empty = torch.empty

    def nan_filled(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        if tensor.dim() == 4:  # [tokens, heads, splits, head_dim]
            partial_rows.append(tensor)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", nan_filled)
    heads, kv_heads, dim, block = DECODE_HEADS, DECODE_KV_HEADS, DECODE_DIM, DECODE_BLOCK
    cache, query, table, rows, positions = decode_case(12, [2, 9, 40])
    out = kernels.paged_attention(query, cache, table, rows, positions, 0.25, None, None, 16, split_tokens=16)

    expected = []
    for token, pos in enumerate(positions.tolist()):
        slots = table[token, torch.arange(pos + 1) // block].long() * block + torch.arange(pos + 1) % block
        keys, values = (cache[i].reshape(-1, kv_heads, dim)[slots].repeat_interleave(heads // kv_heads, 1)
                        for i in (0, 1))
        weights = torch.softmax(torch.einsum("hd,phd->hp", query[token], keys) * 0.25, dim=-1)
        expected.append(torch.einsum("hp,phd->hd", weights, values))
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-5)
    # 16-position tiles (fp32 queries): position 40 fills three splits, 2 and 9 one each
    written = ~partial_rows[0].isnan().all(dim=-1)
    assert written.all(dim=1).sum(dim=-1).tolist() == [1, 1, 3]
    assert not (written.any(dim=1) & ~written.all(dim=1)).any()


def test_triton_decode_sums_a_context_alike_however_many_splits_the_step_allows():
    """A recorded decode step splits every row as its longest allowed context would be split
    (16 ways at 4096 tokens), the eager step as the batch's longest is: a context both cover
    in splits of ``split_tokens`` is split at the same positions, so the two agree to the bit
    (on an H200, splitting each context evenly among the step's splits made graphs and eager
    decode differ in bf16 logprobs)."""
    pytest.importorskip("triton")
    from tokenmill.plugins.attention.triton_paged import kernels

    cache, query, table, rows, positions = decode_case(64, [5, 47, 190])
    # 191 positions in splits of 64: 4 ways at the least (the eager step's count), 16 at the most
    outs = [kernels.paged_attention(query, cache, table, rows, positions, 0.25, None, None, splits, split_tokens=64)
            for splits in (4, 8, 16)]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("case", conformance_cases(8, seed=11, dtypes=(torch.float16,), scale=0.25), ids=str)
def test_triton_fp16_queries_read_a_bf16_cache(case):
    """An fp16 model may keep its K/V in bf16 (cache.kv_cache_dtype): both kernels meet the
    cache in the queries' dtype (tl.dot takes operands of one dtype)."""
    pytest.importorskip("triton")
    check_backend(REGISTRY.get("triton")(), case)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_engine_with_interpreted_triton_matches_hf(arch, model_dir):
    """The engine on the Triton backend (interpreted; the runner, metadata builder and sampler
    a GPU would use) decodes as HF: 16-token chunks of 32-token prompts go through the tiled
    prefill kernel over their cached prefix, decodes through the split-K kernel."""
    from tokenmill import SamplingParams
    from tokenmill.testing.hf_reference import hf_greedy

    from conftest import PROMPTS

    prompts = [(p * 3)[:32] for p in PROMPTS[:3]]
    llm = make_llm(model_dir(arch), attention_backend="triton", block_size=8, max_num_batched_tokens=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    assert_matches_reference(hf_greedy(model_dir(arch), prompts, 8), tokens, logprobs)


def test_cpu_backend_builds_its_decode_kernel():
    """The fast path is really in use here (a silent fallback would hide a slow engine)."""
    from tokenmill.plugins.platforms.cpu.attention import CpuAttention

    assert CpuAttention()._kernels is not None


@pytest.mark.parametrize("case", conformance_cases(60, seed=1), ids=str)
def test_cpu_backend_without_kernels_matches_reference(case):
    """The PyTorch fallback (no compiler on the machine) is as correct as the kernel path."""
    from tokenmill.plugins.platforms.cpu.attention import CpuAttention

    check_backend(CpuAttention(use_kernels=False), case)


@pytest.mark.parametrize("head_dim", [96, 128, 160, 192, 256])
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_decode_kernel_at_large_head_dims(head_dim, seed):
    """The bf16 decode kernel is specialised per head_dim / 32 (1..8); the random cases above
    cover 32 and 64, these the rest, with contexts across tile edges, GQA, windows and caps."""
    import random

    import torch

    from tokenmill.plugins.platforms.cpu.attention import CpuAttention
    from tokenmill.testing.attention_conformance import AttentionCase

    rng = random.Random(seed)
    case = AttentionCase(
        seed=seed, num_heads=rng.choice([4, 8]), num_kv_heads=2, head_dim=head_dim, block_size=rng.choice([8, 16]),
        dtype=torch.bfloat16, requests=tuple((rng.randint(0, 80), 1) for _ in range(4)),
        sliding_window=rng.choice([None, 20]), soft_cap=rng.choice([None, 30.0]))
    check_backend(CpuAttention(), case)


@pytest.mark.parametrize("head_dim", [32, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_prefill_kernel_at_head_dims_and_groups(head_dim, dtype, seed):
    """The prompt-chunk kernel is specialised per head_dim / 32 and works on blocks of up to
    8 (token, head) rows of one KV head: fresh prompts and chunks on cached prefixes, across tile
    and block edges, GQA groups of 1 to 8 (one token per block at 8), with and without a window."""
    import random

    import torch

    from tokenmill.plugins.platforms.cpu.attention import CpuAttention
    from tokenmill.testing.attention_conformance import AttentionCase

    rng = random.Random(seed)
    for heads, kv in ((2, 2), (6, 2), (8, 1)):
        case = AttentionCase(
            seed=seed, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, block_size=rng.choice([8, 16]),
            dtype=getattr(torch, dtype),
            requests=((0, rng.randint(2, 40)), (rng.randint(1, 40), rng.randint(2, 40)), (17, 1), (0, 33)),
            sliding_window=rng.choice([None, 12]))
        backend = CpuAttention()
        assert backend.prefill_kernel_takes(AttentionLayerSpec(heads, kv, head_dim, 1.0), case.dtype), "kernel path"
        check_backend(backend, case)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpu_kernels_read_a_bf16_cache_as_its_fp32_values(seed):
    """Under fp32 queries the decode and prompt-chunk kernels widen a bf16 cache as they read
    it, so the output equals, bit for bit, the fp32 kernels' over the same values stored in
    fp32: a bf16 ``kv_cache_dtype`` costs its rounding on write and nothing else."""
    import torch

    from tokenmill.plugins.platforms.cpu.attention import CpuAttention
    from tokenmill.plugins.attention.torch_ref import TorchReferenceAttention
    from tokenmill.testing.attention_conformance import AttentionCase, build_inputs

    case = AttentionCase(seed=seed, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
                         requests=((0, 37), (40, 1), (19, 1), (23, 12)), sliding_window=(None, 20, None)[seed],
                         cache_dtype=torch.bfloat16)
    spec, q, k, v, cache, metadata = build_inputs(case, TorchReferenceAttention())
    k, v = k.bfloat16().float(), v.bfloat16().float()  # values both caches hold exactly
    backend = CpuAttention()
    assert backend._kernels_take(torch.float32, torch.bfloat16) and backend.prefill_kernel_takes(spec, torch.float32)
    narrow = backend.forward(spec, q, k, v, cache.clone(), metadata)
    wide = CpuAttention().forward(spec, q, k, v, cache.float(), metadata)
    assert torch.equal(narrow, wide)


@pytest.mark.parametrize("head_dim,block_size", [(128, 128), (256, 64), (64, 4)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads,kv_heads", [(2, 1), (8, 2), (14, 2)])
def test_triton_decode_tiles_span_blocks_and_serve_a_kv_heads_group(head_dim, block_size, window, heads, kv_heads):
    """A decode tile is 32 or 64 positions gathered through the block table: part of a large
    block, or many small ones; a window that starts inside a tile masks its first positions.
    The query heads sharing a KV head are one dot's rows, padded to 16 (a group of 7 leaves
    9 padding rows)."""
    import torch

    from tokenmill.plugins.attention.triton_paged.backend import TritonPagedAttention
    from tokenmill.plugins.attention.triton_paged.kernels import decode_tiles
    from tokenmill.testing.attention_conformance import AttentionCase

    group_pad, tile_n, _ = decode_tiles(heads // kv_heads, head_dim, ieee_fp32=True)
    assert group_pad == 16 and (tile_n < block_size or tile_n > block_size)
    case = AttentionCase(seed=3, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                         dtype=torch.float32, requests=((150, 1), (70, 1), (0, 1)), sliding_window=window,
                         soft_cap=None)
    check_backend(TritonPagedAttention(), case)


@pytest.mark.skipif(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") < 12 * 2**30,
                    reason="Linux refuses an 8 GiB reservation past RAM + swap (only ~0.4 GB is touched)")
def test_triton_kernels_address_a_cache_past_int32_offsets():
    """A GPU's per-layer cache holds more than 2**31 elements per K/V half for a model of few
    layers (80 GB over 2 layers): the cache write, decode and prefill kernels compute block
    offsets in 64 bits. In a child process, since a 32-bit offset there reads and writes stray
    memory (a GPU's illegal address), which could take the test process with it."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from tokenmill.plugins.attention.triton_paged.backend import TritonPagedAttention\n"
            "from tokenmill.testing.attention_conformance import AttentionCase, check_backend\n"
            "case = AttentionCase(5, 4, 2, 16, 16, torch.bfloat16, ((20, 12), (40, 1), (0, 33)), sliding_window=24)\n"
            "check_backend(TritonPagedAttention(), case, past_int32=True)\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
