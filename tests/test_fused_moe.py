"""The device path for mixture-of-experts layers (tokenmill.plugins.models.triton_moe), run on
the CPU in Triton's interpreter: its routing groups every (token, k) pair once into one-expert
blocks, its output equals the loop path's (``FusedMoE.forward_native``), its host side reads
no value back from the device (so a CUDA graph can record it), and a Mixtral engine forced
onto it matches Hugging Face, with and without recorded decode steps."""

from __future__ import annotations

import pytest
import torch
import triton

from conftest import NEW_TOKENS, PROMPTS, make_llm
from test_decode_graphs import graphed_llm, run
from tokenmill import SamplingParams
from tokenmill.core.layers.moe import FusedMoE
from tokenmill.plugins.models import triton_moe
from tokenmill.plugins.models.triton_moe import (
    FP32_LARGE_TILES,
    LARGE_TILES,
    SMALL_TILES,
    align_block_size,
    fused_moe,
    tiles_for,
)
from tokenmill.testing.device_graphs import HostSyncCheck, HostSyncError, RecordingPlatform
from tokenmill.testing.hf_reference import assert_matches_reference


def random_routing(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    """``[tokens, top_k]`` distinct experts per token, drawn from the first half of the experts
    where there are enough of them, so that some experts get no tokens."""
    generator = torch.Generator().manual_seed(seed)
    pool = max(top_k, experts // 2) if seed % 2 else experts
    return torch.stack([torch.randperm(pool, generator=generator)[:top_k] for _ in range(tokens)])


def padded_length(num_pairs: int, experts: int, block_m: int) -> int:
    return triton.cdiv(num_pairs + min(experts, num_pairs) * (block_m - 1), block_m) * block_m


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [
    (1, 1, 4, 16), (1, 2, 8, 16), (7, 2, 8, 16), (7, 1, 4, 4), (33, 2, 4, 64), (50, 2, 8, 16), (5, 3, 3, 2),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_routing_puts_every_pair_once_in_blocks_of_one_expert(tokens, top_k, experts, block_m, seed):
    routing = random_routing(tokens, top_k, experts, seed)
    flat = routing.flatten()
    num_pairs = flat.numel()
    blocks = align_block_size(routing, experts, block_m)
    ids, expert_ids = blocks.sorted_pair_ids, blocks.expert_ids
    counts = torch.bincount(flat, minlength=experts)
    num_padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert blocks.num_padded.tolist() == [num_padded]
    assert ids.numel() == padded_length(num_pairs, experts, block_m) == expert_ids.numel() * block_m
    real = ids[ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    assert (ids[ids >= num_pairs] == num_pairs).all()  # padding is the sentinel
    assert (ids[num_padded:] == num_pairs).all()
    in_use = num_padded // block_m
    assert (expert_ids[in_use:] == -1).all()
    for block, expert in enumerate(expert_ids[:in_use].tolist()):
        pairs = ids[block * block_m:(block + 1) * block_m]
        pairs = pairs[pairs < num_pairs]
        assert len(pairs) > 0 and (flat[pairs] == expert).all()
    # each expert owns exactly the blocks its pairs fill, empty experts none
    assert torch.bincount(expert_ids[:in_use], minlength=experts).tolist() == \
        ((counts + block_m - 1) // block_m).tolist()


def make_moe(experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0) -> FusedMoE:
    moe = FusedMoE(experts, top_k, hidden, inter, True, "silu", dtype)
    generator = torch.Generator().manual_seed(seed)
    for param in moe.parameters():
        fan_in = param.shape[-1]
        param.copy_(torch.randn(param.shape, generator=generator) / fan_in ** 0.5)
    return moe


SHAPES = [  # (tokens, top_k, experts, hidden, inter): no size a multiple of the tiles
    (1, 1, 4, 72, 40), (1, 2, 8, 72, 40), (7, 2, 8, 72, 40), (7, 1, 4, 100, 24), (40, 2, 4, 72, 40),
]


@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_path_equals_the_loop_path(tokens, top_k, experts, hidden, inter, dtype):
    moe = make_moe(experts, top_k, hidden, inter, dtype)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = moe.forward_native(x)
    got = fused_moe(moe, x)
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # bf16 rounds each GEMM's output; the interpreter truncates where a GPU rounds
        torch.testing.assert_close(got.float(), expected.float(), rtol=0.05, atol=0.05 * expected.abs().max().item())


def test_the_shapes_exercise_both_tiles():
    tiles = [tiles_for(tokens * top_k, experts, dtype) for tokens, top_k, experts, *_ in SHAPES
             for dtype in (torch.float32, torch.bfloat16)]
    assert set(tiles) == {SMALL_TILES, FP32_LARGE_TILES, LARGE_TILES}


class RecordedLaunches:
    """Stands in for the kernel: records each launch's grid and constexprs, runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, int], dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launches.append((grid, constexprs))


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 8), (7, 2, 8), (40, 2, 4)])
def test_the_host_side_reads_no_value_from_the_device(tokens, top_k, experts, monkeypatch):
    """Meta tensors have shapes and no values: ``.item()``, ``.tolist()``, ``nonzero``, a
    boolean mask or a value-sized ``bincount`` raise on them. The whole fused path, bar the
    kernel itself, runs on them, so nothing reads the device back and every shape (and the
    kernel's grid) follows from (tokens, top_k, experts, BLOCK_M): what a CUDA graph needs."""
    recorded = RecordedLaunches()
    monkeypatch.setattr(triton_moe, "_fused_moe_kernel", recorded)
    moe = make_moe(experts, top_k, 72, 40, torch.bfloat16).to("meta")
    out = fused_moe(moe, torch.empty(tokens, 72, dtype=torch.bfloat16, device="meta"))
    assert out.shape == (tokens, 72) and out.device.type == "meta"
    block_m = tiles_for(tokens * top_k, experts, torch.bfloat16)[0]
    blocks = padded_length(tokens * top_k, experts, block_m) // block_m
    assert [(grid[0], constexprs["MUL_ROUTED_WEIGHT"]) for grid, constexprs in recorded.launches] == \
        [(blocks, False), (blocks, True)]
    with pytest.raises(NotImplementedError):  # the loop path counts tokens per expert, which meta tensors refuse
        moe.forward_native(torch.empty(tokens, 72, dtype=torch.bfloat16, device="meta"))


def test_the_fused_path_passes_the_host_sync_check_the_loop_path_fails():
    """The decode-graph stand-in's check (what CUDA stream capture refuses), kernels running."""
    moe = make_moe(8, 2, 72, 40, torch.float32)
    x = torch.randn(7, 72)
    with HostSyncCheck():
        out = fused_moe(moe, x)
    torch.testing.assert_close(out, moe.forward_native(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(HostSyncError), HostSyncCheck():
        moe.forward_native(x)


def test_routing_shapes_do_not_depend_on_the_routing():
    shapes = set()
    for routing in (torch.zeros(7, 2, dtype=torch.long), torch.tensor([[0, 1]] * 7),
                    random_routing(7, 2, 8, 0), random_routing(7, 2, 8, 1)):
        shapes.add(tuple(tuple(t.shape) for t in align_block_size(routing, 8, 16)))
    assert shapes == {((padded_length(14, 8, 16),), (padded_length(14, 8, 16) // 16,), (1,))}


def test_mixtral_on_the_fused_path_matches_hf(model_dir, hf_reference):
    """The cpu platform keeps the loop path; forced onto the fused one (each layer's op_impl),
    the engine still decodes HF's greedy tokens with fp32 logprobs."""
    llm = make_llm(model_dir("mixtral"))
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(m.op_impl is None for m in layers)
    calls = []

    def counted(layer, x):
        calls.append(x.shape[0])
        return fused_moe(layer, x)

    for layer in layers:
        layer.op_impl = counted
    prompts = PROMPTS[:4]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
                           use_tqdm=False)
    assert calls
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    assert_matches_reference(hf_reference("mixtral")[:4], tokens, logprobs)


def test_mixtral_records_its_decode_steps_on_the_fused_path(model_dir, monkeypatch):
    """A platform that returns ``fused_moe`` for the op (as a GPU platform would) records
    Mixtral's decode steps under the stand-in's host-sync check, and decodes as the eager
    engine on the loop path."""
    monkeypatch.setattr(RecordingPlatform, "custom_op",
                        lambda self, layer: fused_moe if layer.op_name == "fused_moe" else None)
    prompts, max_tokens = [p[:12] for p in PROMPTS[:3]], [6, 4, 2]
    graphed = graphed_llm(model_dir, "mixtral")
    tokens, logprobs = run(graphed, prompts, max_tokens)
    assert graphed.llm_engine.runner.model_step.graphs.graphs[4].replays > 0
    eager = graphed_llm(model_dir, "mixtral", enforce_eager=True, compilation_config={"custom_ops": ["-fused_moe"]})
    assert all(m.op_impl is None for m in eager.llm_engine.runner.model.modules() if isinstance(m, FusedMoE))
    eager_tokens, eager_logprobs = run(eager, prompts, max_tokens)
    assert tokens == eager_tokens
    torch.testing.assert_close(torch.tensor(sum(logprobs, [])), torch.tensor(sum(eager_logprobs, [])),
                               rtol=0, atol=1e-5)
