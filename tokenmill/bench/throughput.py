"""Offline throughput, with ``vllm bench throughput`` semantics, against HF transformers.

N requests with random prompts of a fixed input length (fixed seed), a fixed
number of output tokens each (EOS ignored), all submitted at once. Prints
requests/s, output tokens/s and total tokens/s for tokenmill and for
``transformers`` ``generate`` (static batches, KV cache on) on the same
weights, in the same process, and their ratio; with ``--llama-cpp``, also
llama.cpp's ``llama-batched-bench`` on the same weights (see llama_cpp.py); with
``--vllm``, also ``vllm bench throughput`` (see vllm_peer.py).
With ``--rounds N`` the engines take turns N times (see common.interleaved_rounds):
figures are medians, and each round's ratio is printed beside them. Each round
draws new prompts (seed + round), the same for every engine: a repeated prompt
set would be served from tokenmill's prefix cache (so warm-ups use one more set).

    tokenmill bench throughput --preset 52m --num-prompts 128 --input-len 256 --output-len 128 --rounds 3

``--async-scheduling both`` adds a tokenmill engine with async scheduling beside the plain one
(``on``: the one tokenmill engine has it).

``--parallel tp1,tp2,pp2`` adds a tokenmill engine per layout (tensor x pipeline ranks, each
rank with ``--threads`` threads), and reports the time the driver rank spent in
collectives per step: all-reduces and gathers under TP; under PP, the wait for the last
stage's result, which is the driver's share of the pipeline bubble.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional, Sequence

import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.bench.common import (add_async_scheduling_arg, add_common_args, add_gpu_memory_arg, add_kernel_args,
                                    engine_memory, engine_platform, hf_device, hf_dtype, interleaved_rounds,
                                    kernel_args, prepare, random_prompts, tokenmill_engines, write_json)
from tokenmill.bench.llama_cpp import add_llama_cpp_args, batched_bench
from tokenmill.bench.roofline import Workload, measure_machine, model_workload, offline_bound
from tokenmill.bench.vllm_peer import add_vllm_args, throughput_seconds
from tokenmill.core.config.model_config import load_model_config

#: (engine, key in the JSON ratios, label) of the peers tokenmill is compared with
PEERS = (("hf-generate", "hf", "HF generate"), ("vllm", "vllm", "vLLM"), ("llama.cpp", "llama_cpp", "llama.cpp"))


def layout(name: str) -> tuple[int, int]:
    """"tp2" -> (2, 1), "pp2" -> (1, 2), "tp2pp2" -> (2, 2), "tp1" -> (1, 1)."""
    match = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?", name)
    if not match or not name:
        raise argparse.ArgumentTypeError(f"{name!r} is not a layout such as tp2, pp2 or tp2pp2")
    return int(match.group(1) or 1), int(match.group(2) or 1)


def tokenmill_pass(path, prompt_sets, output_len, args, tp: int = 1, pp: int = 1,
                   async_scheduling: Optional[bool] = None) -> Callable[[], float]:
    """A built and warmed-up engine; each call times one pass over the next prompt set."""
    llm = LLM(str(path), dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
              **kernel_args(args), num_threads=args.threads, kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=tp, pipeline_parallel_size=pp, device=args.device,
              async_scheduling=async_scheduling, **args.engine_memory,
              **({"kv_cache_memory_bytes": args.kv_cache_memory_bytes} if args.kv_cache_memory_bytes else {}))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # on a GPU, Triton compiles a kernel at the first use of each specialization (seconds each):
    # the warm-up set runs the workload's own shapes; the CPU's kernels are built ahead of it
    warm_up = prompt_sets[-1] if hf_device(args.device) == "cuda" else prompt_sets[-1][:2]
    llm.generate([{"prompt_token_ids": p} for p in warm_up], params, use_tqdm=False)
    rounds = iter(prompt_sets)
    step = llm.llm_engine.runner.model_step
    comm = step.parallel.comm

    def timed() -> float:
        prompts = next(rounds)
        before = (comm.stats.seconds, comm.stats.calls, comm.stats.bytes, step.steps) if comm else None
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
        if comm is not None:
            seconds, calls, nbytes, steps = (a - b for a, b in zip(
                (comm.stats.seconds, comm.stats.calls, comm.stats.bytes, step.steps), before))
            timed.collectives.append(dict(ms_per_step=1e3 * seconds / steps, calls_per_step=calls / steps,
                                          kib_per_step=nbytes / steps / 1024, share_of_time=seconds / elapsed,
                                          steps=steps))
        return elapsed
    timed.collectives = []
    return timed


def hf_pass(path, prompt_sets, output_len, args) -> Callable[[], float]:
    device = hf_device(args.device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=hf_dtype(args.dtype, path)).to(device)
    model.eval()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=0)
    with torch.inference_mode():  # on a GPU a whole batch, as tokenmill's warm-up is its workload
        if device == "cuda":
            model.generate(torch.tensor(prompt_sets[-1][:args.hf_batch_size], device=device), **kwargs)
        else:
            model.generate(torch.tensor(prompt_sets[-1][:2], device=device),
                           **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
    rounds = iter(prompt_sets)

    @torch.inference_mode()
    def timed() -> float:
        prompts = next(rounds)
        start = time.perf_counter()
        for i in range(0, len(prompts), args.hf_batch_size):
            out = model.generate(torch.tensor(prompts[i:i + args.hf_batch_size], device=device), **kwargs)
            assert out.shape[1] == len(prompts[0]) + output_len
        return time.perf_counter() - start
    return timed


def llama_cpp_pass(path, prompt_sets, output_len, args) -> Callable[[], float]:
    """``llama-batched-bench`` makes its own prompts of the same shape."""
    prompts = prompt_sets[0]
    return lambda: batched_bench(path, args.llama_cpp, len(prompts[0]), output_len, len(prompts), args.threads)["t"]


def vllm_pass(path, prompt_sets, output_len, args) -> Callable[[], float]:
    """One ``vllm bench throughput`` process per round (its prompts drawn with the round's seed)."""
    dtype = hf_dtype(args.dtype, path)  # what tokenmill computes in
    rounds = iter(range(len(prompt_sets)))
    return lambda: throughput_seconds(args.vllm, path, dtype, len(prompt_sets[0]), len(prompt_sets[0][0]),
                                      output_len, args.threads, args.seed + next(rounds), args.kv_cache_memory_bytes)


def print_roofline(results: dict, path: Path, work: Workload, dtype: torch.dtype, args) -> None:
    """The workload's bound on this machine (see roofline.py), measured after the timed rounds,
    and tokenmill's share of it."""
    device = hf_device(args.device)  # on a GPU the engine's linear layers are torch's (cuBLAS)
    machine = measure_machine(dtype, device, platform=engine_platform(path, args.dtype) if device == "cpu" else None)
    bound = offline_bound(machine, work, args.num_prompts, args.input_len, args.output_len)
    share = results["engines"]["tokenmill"]["output_tokens_per_s"] / bound
    results["roofline"] = {"output_tokens_per_s": round(bound, 1), "bandwidth_gb_s": round(machine.bandwidth / 1e9, 2),
                           "peak_tflops": round(machine.peak_flops / 1e12, 3), "tokenmill_share": round(share, 3)}
    print(f"roofline: {bound:.1f} out tok/s at {args.threads} thread(s) ({machine.bandwidth / 1e9:.1f} GB/s read, "
          f"{machine.peak_flops / 1e12:.2f} TFLOP/s {str(dtype).removeprefix('torch.')} GEMM, both measured here); "
          f"tokenmill at {100 * share:.0f}% of it")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenmill bench throughput", description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device", default="auto", help="the engine's platform (cpu, cuda; vLLM's --device); HF "
                        "runs on the same device")
    parser.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "float16", "auto"],
                        help="auto: the checkpoint's (presets: 52m fp32, 350m bf16), or fp32 for bf16 where the "
                             "CPU has no bf16 arithmetic; HF computes in the same dtype")
    add_kernel_args(parser)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"],
                        help="tokenmill's KV cache: auto is the compute dtype")
    parser.add_argument("--kv-cache-memory-bytes", type=int,
                        help="the KV cache of tokenmill and of the vLLM peer on a CPU (default: what every request "
                             "needs at once, so that neither engine preempts; on a GPU each engine's own rule)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", default="tp1", help="tokenmill layouts, comma-separated (tp1,tp2,pp2): "
                                                          "one engine each; tp1 is the one peers are compared with")
    add_async_scheduling_arg(parser)
    add_gpu_memory_arg(parser)
    add_llama_cpp_args(parser)
    add_vllm_args(parser)
    args = parser.parse_args(argv)

    path = prepare(args)
    dtype = hf_dtype(args.dtype, path)  # what tokenmill computes in
    work = model_workload(path, dtype, torch.bfloat16 if args.kv_cache_dtype == "bfloat16" else dtype)
    if args.kv_cache_memory_bytes is None and hf_device(args.device) == "cpu":
        args.kv_cache_memory_bytes = work.kv_bytes(args.num_prompts, args.input_len + args.output_len,
                                                   load_model_config(path).max_model_len)
    # one set per round, and the last for warm-ups
    prompt_sets = [random_prompts(args.num_prompts, args.input_len, path, args.seed + r) for r in range(args.rounds + 1)]
    total_in, total_out = args.num_prompts * args.input_len, args.num_prompts * args.output_len

    layouts = {name: layout(name) for name in args.parallel.split(",")}
    makers = {("tokenmill" if shape == (1, 1) else f"tokenmill-{name}"):
              (lambda p, s, o, a, shape=shape: tokenmill_pass(p, s, o, a, *shape)) for name, shape in layouts.items()}
    for name, overlapped in tokenmill_engines(args).items():  # one process each: the tp1 layout
        makers[name] = lambda p, s, o, a, overlapped=overlapped: tokenmill_pass(p, s, o, a, async_scheduling=overlapped)
    args.engine_memory = engine_memory(args, len(makers))
    makers.update({**({} if args.skip_hf else {"hf-generate": hf_pass}),
                   **({"vllm": vllm_pass} if args.vllm else {}),
                   **({"llama.cpp": llama_cpp_pass} if args.llama_cpp else {})})
    passes = {name: make(path, prompt_sets, args.output_len, args) for name, make in makers.items()}
    seconds = interleaved_rounds(passes, args.rounds)
    results = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "engines": {}}
    for name, times in seconds.items():
        elapsed = statistics.median(times)
        results["engines"][name] = {
            "seconds": round(elapsed, 3),
            "seconds_by_round": [round(t, 4) for t in times],
            "requests_per_s": round(args.num_prompts / elapsed, 3),
            "output_tokens_per_s": round(total_out / elapsed, 2),
            "total_tokens_per_s": round((total_in + total_out) / elapsed, 2),
        }
        collectives = getattr(passes[name], "collectives", None)
        if collectives:
            results["engines"][name]["collectives_by_round"] = [{k: round(v, 4) for k, v in c.items()}
                                                                for c in collectives]
    print(f"{'engine':<16} {'req/s':>8} {'out tok/s':>10} {'total tok/s':>12} {'seconds':>8}  (medians of {args.rounds})")
    for name, r in results["engines"].items():
        print(f"{name:<16} {r['requests_per_s']:>8.2f} {r['output_tokens_per_s']:>10.1f} "
              f"{r['total_tokens_per_s']:>12.1f} {r['seconds']:>8.1f}")
    for name, r in results["engines"].items():
        for c in r.get("collectives_by_round", [])[-1:]:
            print(f"{name}: collectives on the driver rank {c['ms_per_step']:.2f} ms/step "
                  f"({c['calls_per_step']:.0f} calls, {c['kib_per_step']:.0f} KiB), "
                  f"{100 * c['share_of_time']:.1f}% of the time, {c['steps']:.0f} steps (last round)")
        if name.startswith("tokenmill-") and "tokenmill" in seconds:
            ratio = statistics.median(seconds["tokenmill"]) / statistics.median(seconds[name])
            results[f"ratio_{name}_vs_tokenmill"] = round(ratio, 3)
            print(f"{name} / tokenmill (output tok/s): {ratio:.2f}x")
    if "tokenmill" in results["engines"]:
        print_roofline(results, path, work, dtype, args)
    for peer, key, label in PEERS:
        if peer in seconds and "tokenmill" in seconds:
            # output tok/s ratio = inverse ratio of seconds
            ratio = statistics.median(seconds[peer]) / statistics.median(seconds["tokenmill"])
            by_round = [p / t for p, t in zip(seconds[peer], seconds["tokenmill"])]
            results[f"ratio_tokenmill_vs_{key}"] = round(ratio, 3)
            results[f"ratio_tokenmill_vs_{key}_by_round"] = [round(r, 3) for r in by_round]
            print(f"tokenmill / {label} (output tok/s): {ratio:.2f}x; by round: "
                  + ", ".join(f"{r:.2f}x" for r in by_round))
    write_json(args.json, results)


if __name__ == "__main__":
    main()
