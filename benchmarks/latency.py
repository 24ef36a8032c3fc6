"""Batch-1 latency, like ``vllm bench latency``: one request at a time, TTFT and TPOT.

tokenmill's engine is stepped directly (each step's wall time is one token);
HF transformers runs ``generate`` for 1 and for N new tokens on the same
prompt, TTFT = T(1) and TPOT = (T(N) - T(1)) / (N - 1). Medians over
``--iters`` runs, after a warm-up; same weights, same process. With
``--llama-cpp``, also llama.cpp's ``llama-batched-bench`` with one sequence
(TTFT = its prompt time, TPOT = its decode time per token; see llama_cpp.py).

    python benchmarks/latency.py --preset 350m --input-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from common import add_common_args, hf_dtype, prepare, random_prompts, write_json
from llama_cpp import add_llama_cpp_args, batched_bench
from tokenmill import LLM, SamplingParams


def run_tokenmill(path, prompt, args) -> tuple[list[float], list[float]]:
    llm = LLM(str(path), dtype=args.dtype, enforce_eager=args.enforce_eager, num_threads=args.threads)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    ttfts, tpots = [], []
    for i in range(args.iters + 1):  # the first run warms up
        engine.add_request(f"latency-{i}", {"prompt_token_ids": prompt}, params)
        stamps, start = [], time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            stamps.append(time.perf_counter())
        assert len(stamps) == args.output_len, "one token per step expected"
        if i:
            ttfts.append(stamps[0] - start)
            tpots.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return ttfts, tpots


def run_hf(path, prompt, args) -> tuple[list[float], list[float]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=hf_dtype(args.dtype)).eval()
    ids = torch.tensor([prompt])

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        assert out.shape[1] == len(prompt) + new_tokens
        return time.perf_counter() - start

    ttfts, tpots = [], []
    with torch.inference_mode():
        timed(2)
        for _ in range(args.iters):
            first = timed(1)
            whole = timed(args.output_len)
            ttfts.append(first)
            tpots.append((whole - first) / (args.output_len - 1))
    return ttfts, tpots


def run_llama_cpp(path, prompt, args) -> tuple[list[float], list[float]]:
    runs = [batched_bench(path, args.llama_cpp, len(prompt), args.output_len, 1, args.threads)
            for _ in range(args.iters)]
    return [r["t_pp"] for r in runs], [r["t_tg"] / args.output_len for r in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, default_preset="350m")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--enforce-eager", action="store_true", help="tokenmill without prepacked/fused ops")
    parser.add_argument("--skip-hf", action="store_true")
    add_llama_cpp_args(parser)
    args = parser.parse_args()

    path = prepare(args)
    prompt = random_prompts(1, args.input_len, path, seed=0)[0]
    results = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "engines": {}}
    engines = [("tokenmill", run_tokenmill)] + ([] if args.skip_hf else [("hf-generate", run_hf)])
    engines += [("llama.cpp", run_llama_cpp)] if args.llama_cpp else []
    for name, runner in engines:
        ttfts, tpots = runner(path, prompt, args)
        results["engines"][name] = {
            "ttft_ms_median": round(statistics.median(ttfts) * 1e3, 2),
            "tpot_ms_median": round(statistics.median(tpots) * 1e3, 2),
            "decode_tokens_per_s": round(1 / statistics.median(tpots), 2),
        }
    print(f"{'engine':<12} {'TTFT ms':>9} {'TPOT ms':>9} {'decode tok/s':>13}")
    for name, r in results["engines"].items():
        print(f"{name:<12} {r['ttft_ms_median']:>9.1f} {r['tpot_ms_median']:>9.2f} {r['decode_tokens_per_s']:>13.1f}")
    for peer, key, label in (("hf-generate", "hf", "HF"), ("llama.cpp", "llama_cpp", "llama.cpp")):
        if peer in results["engines"]:
            ratio = results["engines"][peer]["tpot_ms_median"] / results["engines"]["tokenmill"]["tpot_ms_median"]
            results[f"tpot_speedup_vs_{key}"] = round(ratio, 3)
            print(f"{label} TPOT / tokenmill TPOT: {ratio:.2f}x")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
