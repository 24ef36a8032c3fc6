"""Where a step's time goes: one offline workload under cProfile, its time in buckets.

C++ kernels and torch ops appear in cProfile as built-in calls with exact
self time; everything else (engine loop, scheduler, runner bookkeeping,
detokenizer, module dispatch) is Python, slightly inflated by the profiler.

    python benchmarks/profile_step.py --preset 52m --num-prompts 64 --output-len 64
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from tokenmill.bench.common import add_common_args, add_kernel_args, kernel_args, prepare, random_prompts, write_json
from tokenmill import LLM, SamplingParams

#: bucket -> substrings of cProfile function names (first match wins)
BUCKETS = {
    "GEMM (prepacked oneDNN or panel kernel / GEMV kernel)": ("_linear_pointwise", "packed_gemm", "gemv", "int4pack",
                                                               "linear"),
    "attention: decode kernel": ("paged_decode_attention",),
    "attention: prefill kernel (or SDPA + gathers)": ("paged_prefill_attention", "scaled_dot_product_attention",
                                                      "index_select"),
    "decode stack (all layers of a 1-2 row step)": ("DecodeStack",),
    "KV-cache writes": ("index_copy_",),
    "fused norm / activation / rotary": ("rms_norm", "silu_and_mul", "rotary_embedding"),
    "logits sampling (argmax, log-softmax, greedy screen)": ("argmax", "log_softmax", "topk"),
}


def bucket_of(name: str, builtin: bool) -> str:
    for bucket, needles in BUCKETS.items():
        if builtin and any(needle in name for needle in needles):
            return bucket
    return "other torch ops" if builtin else "Python: engine, scheduler, runner, detokenizer, modules"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    add_kernel_args(parser)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"],
                        help="tokenmill's KV cache: auto is the compute dtype")
    args = parser.parse_args()
    path = prepare(args)
    llm = LLM(str(path), **kernel_args(args), num_threads=args.threads,
              kv_cache_dtype=args.kv_cache_dtype)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(args.num_prompts, args.input_len, path, seed=0)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    wall = time.perf_counter() - start

    totals: dict[str, float] = {}
    for (filename, _, name), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        builtin = filename == "~"
        totals[bucket_of(name, builtin)] = totals.get(bucket_of(name, builtin), 0.0) + tottime
    print(f"{args.num_prompts} x {args.input_len} in / {args.output_len} out, preset {args.preset}: "
          f"{wall:.1f} s under the profiler")
    for bucket, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {bucket:<58} {seconds:7.2f} s  {100 * seconds / wall:5.1f}%")
    write_json(args.json, {"config": {k: v for k, v in vars(args).items() if k != "json"},
                           "wall_s": round(wall, 2), "buckets_s": {k: round(v, 3) for k, v in totals.items()}})


if __name__ == "__main__":
    main()
