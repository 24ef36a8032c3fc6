"""Every Triton kernel tokenmill ships, compiled ahead of time for real GPUs, without one.

Triton's interpreter (``TRITON_INTERPRET=1``) checks what a kernel computes; it cannot see
what only the compiler sees (an op the backend rejects, a layout it cannot lower, a tile
that overflows shared memory). ``triton.compile`` with an explicit ``GPUTarget`` runs the
whole pipeline down to a cubin with the ptxas Triton ships, so those errors surface on a
machine without a GPU. ``kernel_cases()`` holds the constexpr choices the engine can make:
every value of every axis at least once (block sizes, head sizes, GQA group sizes, split
counts, dtypes, bit widths, flags) rather than their full product, which would take hours
to compile; ``compile_case`` returns the cubin's register, shared-memory, spill and stack figures.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from tokenmill.plugins.adapters.triton_lora import _bgmv_kernel
from tokenmill.plugins.attention.triton_paged.kernels import (
    MIN_SPLIT_TOKENS,
    _merge_splits_kernel,
    _paged_attention_kernel,
    _prefill_attention_kernel,
    _write_kv_kernel,
    decode_tiles,
    prefill_tiles,
)
from tokenmill.plugins.models.triton_moe import _fused_moe_kernel, tiles_for
from tokenmill.plugins.platforms.cuda.fused_ops import (
    ACT_TILE,
    RMS_NORM_TILE,
    _act_and_mul_kernel,
    _rms_norm_kernel,
    ROTARY_OPTIONS,
    _rotary_kernel,
    rms_norm_warps,
    rotary_warps,
)
from tokenmill.plugins.quantization.triton_block_fp8 import _block_fp8_gemm_kernel, gpu_tiles
from tokenmill.plugins.quantization.triton_gemm import _dequant_gemm_kernel, gemm_block_k

#: what the engine computes in, and the Triton pointer types of those dtypes
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
BLOCK_SIZES = (4, 8, 16, 32, 64, 128)  # the triton backend's block_sizes
#: head sizes of the supported families (vLLM's list), with the group sizes seen in them
HEAD_DIMS = (64, 80, 96, 112, 128, 256)
GROUPS = (1, 2, 4, 8)
NUM_SPLITS = (1, 2, 4, 8, 16)  # the backend splits long contexts up to 16 ways
TARGETS = {"sm80": GPUTarget("cuda", 80, 32), "sm90": GPUTarget("cuda", 90, 32)}


@dataclass(frozen=True)
class KernelCase:
    kernel: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    #: the launch's warps (Triton's default, 4, unless the wrapper picks)
    num_warps: int = 4
    #: the wrapper's other compile options (``enable_fp_fusion``), as (name, value) pairs
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def id(self) -> str:
        types = "-".join(sorted({t.lstrip("*") for t in self.signature.values() if t.startswith("*")}))
        warps = "" if self.num_warps == 4 else f",num_warps={self.num_warps}"
        options = "".join(f",{k}={v}" for k, v in self.options)
        return (f"{self.kernel}[{types};" + ",".join(f"{k}={v}" for k, v in self.constexprs.items()) + warps
                + options + "]")


@dataclass(frozen=True)
class Compiled:
    registers: int
    shared_bytes: int
    spill_bytes: int  # cuobjdump's LOCAL
    #: the per-thread stack frame (cuobjdump's STACK): where ptxas puts the registers it spills
    #: (its ``-v`` reports them as spill stores), which LOCAL does not count
    stack_bytes: int
    cubin_bytes: int
    #: multiplies fused into adds in the PTX: none where the wrapper launches without FP fusion
    fused_products: int


def _signature(fn: Any, types: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    """Every argument's type: pointers and scalars from ``types`` (strides default to i32)."""
    return {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in fn.arg_names}


def _case(kernel: str, fn: Any, types: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4,
          options: Optional[dict[str, Any]] = None) -> KernelCase:
    return KernelCase(kernel, _compilable(fn), _signature(fn, types, constexprs), constexprs, num_warps,
                      tuple((options or {}).items()))


def _compilable(fn: Any) -> JITFunction:
    """The kernel as the compiler takes it: under ``TRITON_INTERPRET=1`` (the test suite's
    setting) ``triton.jit`` made an interpreter function around the same Python source."""
    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)


def _cycle(values: tuple, count: int) -> list:
    return list(itertools.islice(itertools.cycle(values), count))


def kernel_cases() -> list[KernelCase]:
    dtypes = tuple(DTYPES.values())
    cases = []
    # KV write: K/V are converted to the cache dtype first; one row is num_kv_heads * head_dim
    for block, row, dtype in zip(BLOCK_SIZES, _cycle((64, 256, 640, 1024), 6), _cycle(dtypes, 6)):
        cases.append(_case("write_kv", _write_kv_kernel,
                           {"key_ptr": f"*{dtype}", "value_ptr": f"*{dtype}", "cache_ptr": f"*{dtype}",
                            "slot_ptr": "*i64"},
                           {"BLOCK_SIZE": block, "ROW": row, "ROW_PAD": triton.next_power_of_2(row)}))
    # paged attention: the cache in the query's dtype, or bf16 under an fp32 model, then (its
    # own cycle, so the others' combinations stay as they were) bf16 under an fp16 model
    query_cache = (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "bf16"))
    flags = tuple(itertools.product((False, True), repeat=2))
    pairs = list(itertools.product(HEAD_DIMS, query_cache)) + list(itertools.product(HEAD_DIMS, [("fp16", "bf16")]))
    # decode: every head size with every query/cache dtype pair, each with the tile the wrapper picks
    for (head, (query, cache)), block, group, splits, (soft_cap, window) in zip(
            pairs, _cycle(BLOCK_SIZES, len(pairs)), _cycle(GROUPS, len(pairs)),
            _cycle(NUM_SPLITS, len(pairs)), _cycle(flags, len(pairs))):
        head_pad = triton.next_power_of_2(head)
        group_pad, tile_n, num_warps = decode_tiles(group, head_pad, query == "fp32")
        cases.append(_case("paged_attention", _paged_attention_kernel,
                           {"q_ptr": f"*{query}", "cache_ptr": f"*{cache}", "block_table_ptr": "*i32",
                            "token_req_ptr": "*i32", "token_pos_ptr": "*i32", "part_acc_ptr": "*fp32",
                            "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "scale": "fp32", "soft_cap": "fp32"},
                           {"GROUP": group, "GROUP_PAD": group_pad, "BLOCK_SIZE": block, "HEAD_DIM": head,
                            "HEAD_PAD": head_pad, "NUM_SPLITS": splits, "SPLIT_TOKENS": MIN_SPLIT_TOKENS,
                            "TILE_N": tile_n,
                            "USE_SOFT_CAP": soft_cap, "USE_WINDOW": window, "IEEE_FP32": query == "fp32"},
                           num_warps))
    # a recorded decode step (decode_graphs) reads the graph's int64 position buffer
    cases.append(dataclasses.replace(cases[-1], signature={**cases[-1].signature, "token_pos_ptr": "*i64"}))
    # prefill: the backend's GPU tile (32 query tokens) and the context step and warps the
    # wrapper picks per head size and dot precision (fp32 dots for fp32 queries, tensor-core
    # dots for bf16/fp16), every head size with every query/cache dtype pair
    for (head, (query, cache)), block, group, (soft_cap, window) in zip(
            pairs, _cycle(BLOCK_SIZES[::-1], len(pairs)), _cycle(GROUPS[::-1], len(pairs)),
            _cycle(flags[::-1], len(pairs))):
        head_pad = triton.next_power_of_2(head)
        block_n, num_warps = prefill_tiles(query == "fp32", head_pad)
        cases.append(_case("prefill_attention", _prefill_attention_kernel,
                           {"q_ptr": f"*{query}", "cache_ptr": f"*{cache}", "block_table_ptr": "*i32",
                            "out_ptr": f"*{query}", "tile_req_ptr": "*i32", "tile_start_ptr": "*i32",
                            "query_start_ptr": "*i32", "seq_lens_ptr": "*i32", "scale": "fp32", "soft_cap": "fp32"},
                           {"GROUP": group, "BLOCK_SIZE": block, "HEAD_DIM": head, "HEAD_PAD": head_pad,
                            "BLOCK_M": 32, "BLOCK_N": block_n, "USE_SOFT_CAP": soft_cap, "USE_WINDOW": window,
                            "IEEE_FP32": query == "fp32"}, num_warps))
    for head, splits, dtype in zip(HEAD_DIMS, _cycle(NUM_SPLITS, 6), _cycle(dtypes, 6)):
        cases.append(_case("merge_splits", _merge_splits_kernel,
                           {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                            "out_ptr": f"*{dtype}"},
                           {"HEAD_DIM": head, "HEAD_PAD": triton.next_power_of_2(head), "NUM_SPLITS": splits}))
    for name, dtype in DTYPES.items():
        # GPTQ/AWQ dequant-GEMM: 4 and 8 bits (AWQ is repacked to GPTQ's 4-bit layout); fp32
        # activations take the IEEE dot, fp16/bf16 the tensor-core one
        for bits in (4, 8):
            cases.append(_case("dequant_gemm", _dequant_gemm_kernel,
                               {"a_ptr": f"*{dtype}", "qweight_ptr": "*i32", "zeros_ptr": "*i32",
                                "scales_ptr": f"*{dtype}", "g_idx_ptr": "*i32", "c_ptr": f"*{dtype}"},
                               {"BITS": bits, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": gemm_block_k(getattr(torch, name)),
                                "IEEE_FP32": dtype == "fp32"}))
        # block FP8: 128x128 scale blocks (every block checkpoint's), e4m3 weights read as bytes,
        # in each tile the wrapper picks for the dtype (decode- and prefill-sized for fp16/bf16)
        for block_m, block_n, block_k in sorted({gpu_tiles(getattr(torch, name), m, 128) for m in (1, 64)}):
            cases.append(_case("block_fp8_gemm", _block_fp8_gemm_kernel,
                               {"a_ptr": f"*{dtype}", "w_ptr": "*u8", "scale_ptr": "*fp32", "scale_row_ptr": "*i32",
                                "c_ptr": f"*{dtype}"},
                               {"GROUP_K": 128, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                "IEEE_FP32": dtype == "fp32"}))
        # LoRA: shrink (x in the model dtype -> fp32) and expand (fp32 -> the base output, accumulating)
        for accumulate in (False, True):
            x, y = ("fp32", dtype) if accumulate else (dtype, "fp32")
            cases.append(_case("bgmv", _bgmv_kernel,
                               {"x_ptr": f"*{x}", "w_ptr": f"*{dtype}", "slot_ptr": "*i32", "y_ptr": f"*{y}"},
                               {"ACCUMULATE": accumulate, "BLOCK_N": 32, "BLOCK_K": 64}))
        # MoE expert GEMMs: each tile the wrapper picks for the dtype (few pairs per expert, many),
        # gate/up (no routed weight) and down (with)
        moe_tiles = sorted({tiles_for(pairs, 1, getattr(torch, name)) for pairs in (1, 64)})
        for (block_m, block_n, block_k), routed in itertools.product(moe_tiles, (False, True)):
            cases.append(_case("fused_moe", _fused_moe_kernel,
                               {"a_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "c_ptr": f"*{dtype}",
                                "routed_weight_ptr": "*fp32", "sorted_pair_ptr": "*i32", "expert_ids_ptr": "*i32",
                                "num_padded_ptr": "*i32"},
                               {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                "MUL_ROUTED_WEIGHT": routed, "IEEE_FP32": dtype == "fp32"}))
        # the elementwise ops: RMSNorm (q/k head norms to an 8B model's rows in one pass, wider
        # rows in two; Llama's and Gemma's weights; with and without the residual add), both gated
        # activations, and rotary over each head size's half (Phi's partial rotary: 16 of 32) with
        # up to 64 query heads
        for (hidden, one_pass), gemma, residual in zip(
                ((64, True), (128, True), (2048, True), (4096, True), (RMS_NORM_TILE, True), (RMS_NORM_TILE, False)),
                _cycle((False, True), 6), _cycle((True, False, True), 6)):
            cases.append(_case("rms_norm", _rms_norm_kernel,
                               {"x_ptr": f"*{dtype}", "residual_ptr": f"*{dtype}", "weight_ptr": f"*{dtype}",
                                "out_ptr": f"*{dtype}", "sum_ptr": f"*{dtype}", "eps": "fp32"},
                               {"BLOCK": hidden, "ONE_PASS": one_pass, "GEMMA": gemma, "RESIDUAL": residual},
                               rms_norm_warps(hidden)))
        for act in (0, 1):
            cases.append(_case("act_and_mul", _act_and_mul_kernel, {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"},
                               {"ACT": act, "BLOCK": ACT_TILE}))
        for half, q_heads, k_heads in ((16, 32, 32), (32, 16, 8), (40, 32, 8), (64, 64, 8), (128, 16, 8)):
            cases.append(_case("rotary", _rotary_kernel,
                               {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "cos_ptr": f"*{dtype}",
                                "sin_ptr": f"*{dtype}"},
                               {"HALF": half, "HALF_PAD": triton.next_power_of_2(half), "Q_HEADS_PAD": q_heads,
                                "K_HEADS_PAD": k_heads}, rotary_warps(q_heads * triton.next_power_of_2(half)),
                               ROTARY_OPTIONS))
    return cases


def compile_case(case: KernelCase, target: GPUTarget) -> Compiled:
    compiled = triton.compile(ASTSource(case.fn, case.signature, constexprs=case.constexprs), target=target,
                              options={"num_warps": case.num_warps, **dict(case.options)})
    cubin = compiled.asm["cubin"]
    usage = _resource_usage(cubin)
    return Compiled(usage["REG"], compiled.metadata.shared, usage["LOCAL"], usage["STACK"], len(cubin),
                    fused_products(compiled.asm["ptx"]))


def fused_products(ptx: str) -> int:
    """Floating-point FMAs that fuse a product into an add. Not counted: an FMA adding -0 (a
    plain multiply: sm_80 writes bf16 products of bf16 values, exact in fp32, that way) or
    multiplying by +-1 (a plain add or subtract: sm_80 has no bf16 add). Each of those rounds
    once, as the operation alone would."""
    def constants(*values: str) -> set[str]:
        pattern = "|".join(values)
        return set(values) | set(re.findall(rf"mov\.b(?:16|32)\s+(%\w+),\s*(?:{pattern});", ptx))

    negative_zero = constants("0x8000", "0f80000000")
    unit = constants("0x3F80", "0xBF80", "0x3C00", "0xBC00", "0f3F800000", "0fBF800000")
    operands = re.findall(r"\bfma\.rn(?:\.ftz)?\.(?:f32|f16|bf16)\s+[^,]+,([^,]+),([^,]+),([^;]+);", ptx)
    return sum(c.strip() not in negative_zero and a.strip() not in unit and b.strip() not in unit
               for a, b, c in operands)


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage``'s figures for the cubin's one function (REG, SHARED, LOCAL, ...)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([tool, "-res-usage", handle.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"([A-Z]+):(\d+)", line)}


def compile_all() -> dict[str, dict[str, Any]]:
    """{target: {case id: Compiled figures as a dict, or {"error": message}}}. Needs a process
    without ``TRITON_INTERPRET=1``: the interpreter patches ``triton.language`` process-wide."""
    results: dict[str, dict[str, Any]] = {}
    for name, target in TARGETS.items():
        for case in kernel_cases():
            try:
                figures: dict[str, Any] = dataclasses.asdict(compile_case(case, target))
            except Exception as exc:  # reported per case, so one broken kernel hides no other
                figures = {"error": f"{type(exc).__name__}: {exc}"}
            results.setdefault(name, {})[case.id] = figures
    return results


def main() -> None:
    """``python -m tokenmill.testing.triton_aot [--json]``: every case for every target, as a
    Markdown table (or JSON)."""
    results = compile_all()
    if "--json" in sys.argv:
        print(json.dumps(results))
        return
    print("| target | kernel case | registers | shared bytes | spill bytes | stack bytes |")
    print("|---|---|---|---|---|---|")
    for name, cases in results.items():
        for case_id, figures in cases.items():
            if "error" in figures:
                print(f"| {name} | `{case_id}` | error: {figures['error'].splitlines()[0]} | | | |")
            else:
                print(f"| {name} | `{case_id}` | {figures['registers']} | {figures['shared_bytes']} "
                      f"| {figures['spill_bytes']} | {figures['stack_bytes']} |")


if __name__ == "__main__":
    main()
