"""Every Triton kernel compiles to a cubin for sm_80 (A100) and sm_90 (H100) with each
constexpr choice the engine can make, on this machine, without a GPU: what the interpreter
runs is also what a GPU would be given. A kernel that spills registers to local memory, or
asks for more shared memory than the architecture has, fails here.

The compiler runs in a child process without ``TRITON_INTERPRET=1`` (the suite's setting,
under which the interpreter patches ``triton.language`` for the whole process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenmill.plugins.models.triton_moe import FP32_LARGE_TILES, LARGE_TILES, SMALL_TILES
from tokenmill.testing.triton_aot import TARGETS, kernel_cases

#: shared memory one block may use: sm_80's and sm_90's opt-in maxima
SHARED_LIMIT = {"sm80": 163 * 1024, "sm90": 227 * 1024}
CASES = kernel_cases()
#: the attention kernels' (query, cache) dtypes: the cache in the query's, or bf16 under fp32 and fp16
PAIRS = (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "bf16"), ("fp16", "bf16"))


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tokenmill.testing.triton_aot", "--json"], env=env,
                            capture_output=True, text=True, timeout=900, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def test_the_cases_cover_every_kernel_and_every_choice():
    assert {case.kernel for case in CASES} == {"write_kv", "paged_attention", "prefill_attention", "merge_splits",
                                               "dequant_gemm", "bgmv", "fused_moe", "block_fp8_gemm",
                                               "rms_norm", "act_and_mul", "rotary"}
    attention = [case.constexprs for case in CASES if case.kernel == "paged_attention"]
    assert {c["BLOCK_SIZE"] for c in attention} == {4, 8, 16, 32, 64, 128}
    assert {c["HEAD_DIM"] for c in attention} == {64, 80, 96, 112, 128, 256}
    assert {c["GROUP"] for c in attention} == {1, 2, 4, 8}
    assert {(c["USE_SOFT_CAP"], c["USE_WINDOW"]) for c in attention} == {(a, b) for a in (0, 1) for b in (0, 1)}
    assert {c["NUM_SPLITS"] for c in attention} == {1, 2, 4, 8, 16}
    prefill = [case.constexprs for case in CASES if case.kernel == "prefill_attention"]
    assert {c["BLOCK_SIZE"] for c in prefill} == {4, 8, 16, 32, 64, 128}
    assert {c["HEAD_DIM"] for c in prefill} == {64, 80, 96, 112, 128, 256}
    assert {(c["USE_SOFT_CAP"], c["USE_WINDOW"]) for c in prefill} == {(a, b) for a in (0, 1) for b in (0, 1)}
    assert {c["IEEE_FP32"] for c in prefill} == {True, False}
    assert {(case.signature["q_ptr"], case.signature["cache_ptr"], case.constexprs["HEAD_DIM"])
            for case in CASES if case.kernel == "prefill_attention"} == {
        (f"*{q}", f"*{c}", head) for q, c in PAIRS for head in (64, 80, 96, 112, 128, 256)
    }  # each with the tile the wrapper picks for it
    assert {(case.signature["q_ptr"], case.signature["cache_ptr"], case.constexprs["HEAD_DIM"])
            for case in CASES if case.kernel == "paged_attention"} == {
        (f"*{q}", f"*{c}", head) for q, c in PAIRS for head in (64, 80, 96, 112, 128, 256)
    }  # each with the tile the wrapper picks for it
    assert {(c["BITS"], c["IEEE_FP32"]) for c in (case.constexprs for case in CASES if case.kernel == "dequant_gemm")} \
        == {(4, True), (8, True), (4, False), (8, False)}
    moe = [(case.signature["a_ptr"], case.constexprs) for case in CASES if case.kernel == "fused_moe"]
    assert {(a, c["IEEE_FP32"]) for a, c in moe} == {("*fp32", True), ("*bf16", False), ("*fp16", False)}
    large = {"*fp32": FP32_LARGE_TILES, "*bf16": LARGE_TILES, "*fp16": LARGE_TILES}
    assert {(a, c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["MUL_ROUTED_WEIGHT"]) for a, c in moe} == {
        (a, *tiles, routed) for a in large for tiles in (SMALL_TILES, large[a]) for routed in (False, True)}
    # block FP8: the engine's 128x128 blocks, each tile the wrapper picks per dtype
    block_fp8 = [(case.signature["a_ptr"], case.constexprs) for case in CASES if case.kernel == "block_fp8_gemm"]
    assert {c["GROUP_K"] for _, c in block_fp8} == {128}
    assert {(a, c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["IEEE_FP32"]) for a, c in block_fp8} == {
        ("*fp32", 16, 32, 32, True), ("*bf16", 16, 64, 64, False), ("*bf16", 64, 64, 32, False),
        ("*fp16", 16, 64, 64, False), ("*fp16", 64, 64, 32, False)}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_kernel_compiles_for_the_gpu(case, target, compiled):
    figures = compiled[target][case.id]
    assert "error" not in figures, figures.get("error")
    assert figures["cubin_bytes"] > 0
    assert figures["spill_bytes"] == 0, f"{case.id} spills {figures['spill_bytes']} bytes on {target}"
    if case.kernel == "rotary":  # each product rounded as eager rounds it: on an H200 an FMA kept one unrounded
        assert figures["fused_products"] == 0, \
            f"{case.id} fuses {figures['fused_products']} products into FMAs on {target}"
    # ptxas spills registers into the stack frame (``ptxas -v``'s spill stores), which LOCAL does
    # not count: every tile the wrappers pick is sized to need none
    assert figures["stack_bytes"] == 0, f"{case.id} spills {figures['stack_bytes']} stack bytes on {target}"
    assert figures["shared_bytes"] <= SHARED_LIMIT[target]


def test_decode_splits_are_the_compiled_powers_of_two():
    """``NUM_SPLITS`` is a kernel constant: any context length takes a split count that the
    table compiles, not one of sixteen compiled on first use in the middle of serving."""
    from tokenmill.plugins.attention.triton_paged.backend import TritonPagedAttention
    from tokenmill.testing.triton_aot import NUM_SPLITS

    backend = TritonPagedAttention()
    assert {backend.num_splits(n) for n in range(0, 2**17)} == set(NUM_SPLITS)
