"""Batch-1 latency, like ``vllm bench latency``: one request at a time, TTFT and TPOT.

tokenmill's engine is stepped directly (each step's wall time is one token);
HF transformers runs ``generate`` for 1 and for N new tokens on the same
prompt, TTFT = T(1) and TPOT = (T(N) - T(1)) / (N - 1). Medians over
``--iters`` runs, after a warm-up; same weights, same process. The TTFT is cold:
every timed request has a prompt of its own, so none hits the prefix cache. With
``--llama-cpp``, also llama.cpp's ``llama-batched-bench`` with one sequence
(TTFT = its prompt time, TPOT = its decode time per token; see llama_cpp.py).
With ``--rounds N`` the engines take turns N times (see common.interleaved_rounds);
medians are over all rounds' runs, and each round's TPOT ratio is printed.

    tokenmill bench latency --preset 350m --input-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Optional, Sequence

import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.bench.common import (add_async_scheduling_arg, add_common_args, add_gpu_memory_arg, add_kernel_args,
                                    engine_memory, hf_device, hf_dtype, interleaved_rounds, kernel_args, prepare,
                                    random_prompts, tokenmill_engines, write_json)
from tokenmill.bench.llama_cpp import add_llama_cpp_args, batched_bench
from tokenmill.bench.roofline import decode_bound, measure_bandwidth, model_workload

Timings = tuple[list[float], list[float]]  # TTFTs, TPOTs (seconds)


def tokenmill_pass(path, prompt, args, async_scheduling: Optional[bool] = None) -> Callable[[], Timings]:
    """A built engine after one warm-up request; each call times ``--iters`` requests, each
    with a prompt of its own (a repeated prompt would hit the prefix cache). A token's time is
    the end of the step that returned it (under async scheduling, the step after the one that
    computed it)."""
    engine = LLM(str(path), dtype=args.dtype, **kernel_args(args), num_threads=args.threads,
                 device=args.device, async_scheduling=async_scheduling, **args.engine_memory).llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    counter = iter(range(1 << 30))

    def one() -> tuple[float, float]:
        n = next(counter)
        fresh = random_prompts(1, len(prompt), path, seed=1000 + n)[0]
        engine.add_request(f"latency-{n}", {"prompt_token_ids": fresh}, params)
        stamps, start = [], time.perf_counter()
        while engine.has_unfinished_requests():
            if engine.step():
                stamps.append(time.perf_counter())
        assert len(stamps) == args.output_len, "one token per step expected"
        return stamps[0] - start, (stamps[-1] - stamps[0]) / (len(stamps) - 1)

    one()
    return lambda: _unzip([one() for _ in range(args.iters)])


def hf_pass(path, prompt, args) -> Callable[[], Timings]:
    device = hf_device(args.device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=hf_dtype(args.dtype, path)).to(device).eval()
    ids = torch.tensor([prompt], device=device)

    @torch.inference_mode()
    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        assert out.shape[1] == len(prompt) + new_tokens
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def one() -> tuple[float, float]:
        first = timed(1)
        return first, (timed(args.output_len) - first) / (args.output_len - 1)

    timed(2)
    return lambda: _unzip([one() for _ in range(args.iters)])


def llama_cpp_pass(path, prompt, args) -> Callable[[], Timings]:
    def one() -> tuple[float, float]:
        r = batched_bench(path, args.llama_cpp, len(prompt), args.output_len, 1, args.threads)
        return r["t_pp"], r["t_tg"] / args.output_len
    return lambda: _unzip([one() for _ in range(args.iters)])


def _unzip(pairs: list[tuple[float, float]]) -> Timings:
    return [a for a, _ in pairs], [b for _, b in pairs]


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenmill bench latency", description=__doc__.splitlines()[0])
    add_common_args(parser, default_preset="350m")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", "--iters", dest="iters", type=int, default=3, help="timed runs per round")
    parser.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "float16", "auto"])
    parser.add_argument("--device", default="auto", help="the engine's platform (cpu, cuda; vLLM's --device); HF "
                        "runs on the same device")
    add_kernel_args(parser)
    parser.add_argument("--skip-hf", action="store_true")
    add_async_scheduling_arg(parser)
    add_gpu_memory_arg(parser)
    add_llama_cpp_args(parser)
    args = parser.parse_args(argv)

    path = prepare(args)
    prompt = random_prompts(1, args.input_len, path, seed=0)[0]
    makers = {name: partial(tokenmill_pass, async_scheduling=overlapped)
              for name, overlapped in tokenmill_engines(args).items()}
    args.engine_memory = engine_memory(args, len(makers))
    results = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "engines": {}}
    makers.update({**({} if args.skip_hf else {"hf-generate": hf_pass}),
                   **({"llama.cpp": llama_cpp_pass} if args.llama_cpp else {})})
    rounds = interleaved_rounds({name: make(path, prompt, args) for name, make in makers.items()}, args.rounds)
    for name, timings in rounds.items():
        ttfts = [t for round_ttfts, _ in timings for t in round_ttfts]
        tpots = [t for _, round_tpots in timings for t in round_tpots]
        results["engines"][name] = {
            "ttft_ms_median": round(statistics.median(ttfts) * 1e3, 2),
            "tpot_ms_median": round(statistics.median(tpots) * 1e3, 2),
            "decode_tokens_per_s": round(1 / statistics.median(tpots), 2),
            "tpot_ms_median_by_round": [round(statistics.median(tp) * 1e3, 2) for _, tp in timings],
        }
    print("TTFT is cold: each timed request has a prompt of its own (no prefix-cache hit)")
    print(f"{'engine':<16} {'TTFT ms':>9} {'TPOT ms':>9} {'decode tok/s':>13}")
    for name, r in results["engines"].items():
        print(f"{name:<16} {r['ttft_ms_median']:>9.1f} {r['tpot_ms_median']:>9.2f} {r['decode_tokens_per_s']:>13.1f}")
    engines = results["engines"]
    if "tokenmill-async" in engines:
        by_round = [s / a for s, a in zip(engines["tokenmill"]["tpot_ms_median_by_round"],
                                          engines["tokenmill-async"]["tpot_ms_median_by_round"])]
        ratio = engines["tokenmill"]["tpot_ms_median"] / engines["tokenmill-async"]["tpot_ms_median"]
        results["tpot_speedup_async_vs_step_by_step"] = round(ratio, 3)
        print(f"tokenmill TPOT / tokenmill-async TPOT: {ratio:.2f}x; by round: "
              + ", ".join(f"{r:.2f}x" for r in by_round))
    for peer, key, label in (("hf-generate", "hf", "HF"), ("llama.cpp", "llama_cpp", "llama.cpp")):
        if peer in results["engines"]:
            ratio = results["engines"][peer]["tpot_ms_median"] / results["engines"]["tokenmill"]["tpot_ms_median"]
            by_round = [p / t for p, t in zip(results["engines"][peer]["tpot_ms_median_by_round"],
                                              results["engines"]["tokenmill"]["tpot_ms_median_by_round"])]
            results[f"tpot_speedup_vs_{key}"] = round(ratio, 3)
            results[f"tpot_speedup_vs_{key}_by_round"] = [round(r, 3) for r in by_round]
            print(f"{label} TPOT / tokenmill TPOT: {ratio:.2f}x; by round: " + ", ".join(f"{r:.2f}x" for r in by_round))
    print_roofline(results, path, args)
    write_json(args.json, results)


def print_roofline(results: dict, path, args) -> None:
    """Batch 1's weight-streaming bound on this machine (roofline.py: its bandwidth measured
    after the timed rounds) and each tokenmill engine's TPOT as a multiple of it."""
    dtype = hf_dtype(args.dtype, path)
    bandwidth = measure_bandwidth(hf_device(args.device))
    work = model_workload(path, dtype, dtype)
    bound = decode_bound(bandwidth, work, args.input_len, args.output_len)
    results["roofline"] = {"tpot_ms": round(bound * 1e3, 6), "bandwidth_gb_s": round(bandwidth / 1e9, 2)}
    shares = {name: r["tpot_ms_median"] / (bound * 1e3) for name, r in results["engines"].items()
              if name.startswith("tokenmill")}
    results["roofline"].update({f"{name}_tpot_vs_bound": round(x, 3) for name, x in shares.items()})
    print(f"roofline: TPOT >= {bound * 1e3:.3f} ms at batch 1 ({work.weight_bytes / 1e9:.2f} GB of weights and the "
          f"K/V read per token at {bandwidth / 1e9:.1f} GB/s, measured here); "
          + ", ".join(f"{name} at {x:.2f}x of it" for name, x in shares.items()))
    if any(x < 1 for x in shares.values()):
        print("(under the bound: the weights stay in the last-level cache between tokens, or the streaming read "
              "at this thread count understates what the memory gives)")


if __name__ == "__main__":
    main()
