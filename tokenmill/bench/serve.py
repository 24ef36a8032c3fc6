"""Online serving load, with ``vllm bench serve`` semantics, against any OpenAI-compatible server.

Sends N streaming /v1/completions requests with Poisson arrivals at
``--request-rate`` (``inf`` = all at once) and at most ``--max-concurrency``
in flight, then reports request and output-token throughput and
TTFT / TPOT / ITL / E2EL (mean, median, p99; TPOT = (e2e - ttft) / (n - 1)).

Point it at a running server (``--base-url``), or let it launch one per
engine in turn on the same model: ``--launch tokenmill,transformers,vllm,llama.cpp``
(``tokenmill-engine-process``: tokenmill with ``--engine-process``; ``tokenmill-api-servers``:
with ``--api-server-count``, this benchmark's, 2 by default)
(vllm: ``vllm serve``, where vLLM is installed; llama.cpp: ``llama-server`` with one
slot per concurrent request on the same weights as GGUF; needs ``--llama-cpp``, see
llama_cpp.py). ``--device cuda`` serves tokenmill on its cuda platform; transformers and
vLLM take the GPU wherever there is one. With ``--rounds N`` the engines take turns N times,
each pass with a server started afresh (common.interleaved_rounds); the figures are medians
over rounds, and each round's are kept under ``rounds``. The load comes from
``--client-processes`` processes (``serve_load``); each pass reports their busy share, and
says so when the client, not the server, may have set the pace.

    tokenmill bench serve --launch tokenmill,transformers --preset 52m --num-prompts 64 \\
        --input-len 256 --output-len 128 --max-concurrency 32
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from tokenmill.bench.common import (add_common_args, hf_device, hf_dtype, interleaved_rounds, prepare, stop_server,
                                    wait_ready, write_json)
from tokenmill.bench.llama_cpp import add_llama_cpp_args, server_command
from tokenmill.bench.roofline import model_workload
from tokenmill.bench.serve_load import Load, LoadSpec, generate_load
from tokenmill.bench.vllm_peer import vllm_dtype, vllm_env
from tokenmill.core.config.model_config import load_model_config


#: the load processes' busy share above which a pass says its figures may be the client's
CLIENT_BOUND = 0.85


def default_client_processes() -> int:
    """A quarter of the host's cores, 1 to 8: the rest for the server under test."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))


#: per engine, the fields it accepts beyond OpenAI's (transformers serve rejects unknown ones)
EXTRA_FIELDS = {"tokenmill": {"ignore_eos": True}, "tokenmill-engine-process": {"ignore_eos": True},
                "tokenmill-api-servers": {"ignore_eos": True}, "external": {"ignore_eos": True},
                "llama.cpp": {"ignore_eos": True}, "vllm": {"ignore_eos": True}, "transformers": {}}


def summarize(load: Load) -> dict:
    results, duration = load.results, load.duration
    ok = [r for r in results if r.ok]
    out = sum(r.output_tokens for r in ok)

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean_ms": None, "median_ms": None, "p99_ms": None}
        return {"mean_ms": round(1000 * statistics.fmean(values), 2),
                "median_ms": round(1000 * statistics.median(values), 2),
                "p99_ms": round(1000 * float(np.percentile(values, 99)), 2)}

    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": round(duration, 2),
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(out / duration, 2),
        "ttft": stats([r.ttft for r in ok]),
        "tpot": stats([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]),
        "itl": stats([x for r in ok for x in r.itl]),
        "e2el": stats([r.e2e for r in ok]),
        #: the share of the pass its load processes spent on the CPU: near 1, the figures are
        #: the client's as much as the server's
        "client_busy": round(load.client_busy, 3),
    }


def launch(engine: str, model_path: str, port: int, threads: int, max_num_seqs: int,
           args: argparse.Namespace) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if engine in ("tokenmill", "tokenmill-engine-process", "tokenmill-api-servers"):
        command = [sys.executable, "-m", "tokenmill.cli", "serve", model_path, "--port", str(port),
                   "--served-model-name", "bench", "--max-num-seqs", str(max_num_seqs), "--device", args.device,
                   "--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype, "--log-level", "warning"]
        if args.device != "cuda":
            command += ["--num-threads", str(threads)]
        if engine == "tokenmill-engine-process":
            command.append("--engine-process")
        if engine == "tokenmill-api-servers":
            command += ["--api-server-count", str(args.api_server_count)]
        if args.kv_cache_memory_bytes is not None:
            command += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    elif engine == "vllm":  # in the dtype tokenmill computes in (vLLM's CPU "auto" takes fp32 to bf16)
        env = vllm_env(threads)
        command = [args.vllm, "serve", model_path, "--port", str(port), "--served-model-name", "bench",
                   "--max-num-seqs", str(max_num_seqs), "--dtype", vllm_dtype(hf_dtype(args.dtype, Path(model_path)))]
        if args.kv_cache_memory_bytes is not None:
            command += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    elif engine == "transformers":
        command = ["transformers", "serve", model_path, "--port", str(port), "--continuous-batching"]
    elif engine == "llama.cpp":
        if args.llama_cpp is None:
            raise SystemExit("--launch llama.cpp needs --llama-cpp (a built llama.cpp source tree)")
        # text prompts of input_len ids may re-tokenize a little longer: room for that per slot
        command = server_command(Path(model_path), args.llama_cpp, port, threads, args.max_concurrency,
                                 args.input_len + args.output_len + 64)
    else:
        raise SystemExit(f"unknown engine to launch: {engine}")
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def serve_pass(name: str, url: Optional[str], path: Path, prompts: list[str], args: argparse.Namespace) -> dict:
    """One timed pass of ``name``: its server launched (unless ``url`` is one already running),
    a warm-up, the load, the server stopped; the pass's summary."""
    process = None
    model = args.served_model
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        process = launch(name, str(path), args.port, args.threads, args.max_num_seqs, args)
        model = str(path) if name == "transformers" else "bench"
    try:
        if process is not None:
            wait_ready(url, process)
        extra = EXTRA_FIELDS.get(name, {})
        rate = None if args.request_rate == float("inf") else args.request_rate
        generate_load(LoadSpec(url, model, prompts[:2], 4, None, 2, args.seed, extra))  # warm-up
        load = generate_load(LoadSpec(url, model, prompts, args.output_len, rate, args.max_concurrency, args.seed,
                                      extra), args.client_processes)
    finally:
        if process is not None:
            stop_server(process)
    summary = summarize(load)
    print(f"{name:<13} " + summary_line(summary, args.num_prompts))
    if summary["client_busy"] > CLIENT_BOUND:
        print(f"{name:<13} the load processes were busy {summary['client_busy']:.0%} of the pass: the server may "
              "be faster than this (--client-processes)")
    return summary


def over_rounds(rounds: list[dict]) -> dict:
    """One engine's passes as one summary: each figure the median over rounds, the requests
    completed and failed summed, the errors of all of them."""
    def median(values: list) -> Optional[float]:
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    merged: dict = {"completed": sum(r["completed"] for r in rounds), "failed": sum(r["failed"] for r in rounds),
                    "errors": sorted({e for r in rounds for e in r["errors"]})[:3]}
    for key, value in rounds[0].items():
        if key in merged:
            continue
        if isinstance(value, dict):
            merged[key] = {k: median([r[key][k] for r in rounds]) for k in value}
        else:
            merged[key] = median([r[key] for r in rounds])
    return merged


def summary_line(r: dict, requests: int) -> str:
    return (f"done {r['completed']}/{requests}  req/s {r['request_throughput']:.2f}  "
            f"out tok/s {r['output_throughput']:.1f}  TTFT p50 {r['ttft']['median_ms']} ms  "
            f"TPOT p50 {r['tpot']['median_ms']} ms  ITL p50 {r['itl']['median_ms']} ms  "
            f"E2EL p50 {r['e2el']['median_ms']} ms" + (f"  errors: {r['errors']}" if r["errors"] else ""))


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="tokenmill bench serve", description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--base-url", help="an already running server (skips --launch)")
    parser.add_argument("--served-model", default="bench", help="the 'model' field to send")
    parser.add_argument("--launch", default="tokenmill",
                        help="comma-separated: tokenmill,tokenmill-engine-process,tokenmill-api-servers,"
                             "transformers,vllm,llama.cpp")
    parser.add_argument("--api-server-count", type=int, default=2,
                        help="the HTTP server processes of a launched tokenmill-api-servers")
    parser.add_argument("--vllm", default="vllm", help="the vllm executable, or a wrapper such as benchmarks/vllm_cpu.sh")
    parser.add_argument("--device", default="auto", help="tokenmill's platform when launched (cpu, cuda)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="tokenmill's and vLLM's compute dtype when launched")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--random-input-len", "--input-len", dest="input_len", type=int, default=256)
    parser.add_argument("--random-output-len", "--output-len", dest="output_len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="tokenmill's batch limit when launched")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"],
                        help="tokenmill's KV cache when launched: auto is the compute dtype")
    parser.add_argument("--kv-cache-memory-bytes", type=int,
                        help="the KV cache of launched tokenmill and vLLM servers on a CPU (default: what "
                             "max-concurrency requests need at once, for both: each engine's own default "
                             "left one queueing requests the other ran); on a GPU each engine's own rule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-processes", type=int, default=default_client_processes(),
                        help="load processes the requests are split over (default: a quarter of the cores, "
                             "1 to 8): one Python client reads a few ten thousand tokens a second at most")
    add_llama_cpp_args(parser)
    args = parser.parse_args(argv)

    path = prepare(args)
    if args.kv_cache_memory_bytes is None and not args.base_url and hf_device(args.device) == "cpu":
        dtype = hf_dtype(args.dtype, path)
        work = model_workload(path, dtype, torch.bfloat16 if args.kv_cache_dtype == "bfloat16" else dtype)
        args.kv_cache_memory_bytes = work.kv_bytes(min(args.num_prompts, args.max_concurrency),
                                                   args.input_len + args.output_len,
                                                   load_model_config(path).max_model_len)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    rng = random.Random(args.seed)
    vocab = len(tokenizer)
    prompts = [tokenizer.decode([rng.randrange(10, vocab) for _ in range(args.input_len)]) for _ in range(args.num_prompts)]

    targets = [("external", args.base_url)] if args.base_url else [(e, None) for e in args.launch.split(",")]
    report = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "engines": {}}
    passes = {name: partial(serve_pass, name, url, path, prompts, args) for name, url in targets}
    by_engine = interleaved_rounds(passes, args.rounds)
    engines = report["engines"]
    for name, rounds in by_engine.items():
        engines[name] = {**over_rounds(rounds), "rounds": rounds}
        if args.rounds > 1:
            print(f"{name:<13} median of {args.rounds} rounds: "
                  + summary_line(engines[name], args.rounds * args.num_prompts))
    for subject, peer in (("tokenmill", "transformers"), ("tokenmill", "vllm"), ("tokenmill", "llama.cpp"),
                          ("tokenmill-engine-process", "tokenmill"), ("tokenmill-engine-process", "vllm"),
                          ("tokenmill-api-servers", "tokenmill"),
                          ("tokenmill-api-servers", "tokenmill-engine-process")):
        if subject in engines and peer in engines and engines[peer]["output_throughput"]:
            ratio = engines[subject]["output_throughput"] / engines[peer]["output_throughput"]
            by_round = [t["output_throughput"] / p["output_throughput"] if p["output_throughput"] else None
                        for t, p in zip(by_engine[subject], by_engine[peer])]
            key = f"ratio_{subject}_vs_{peer}".replace("-", "_").replace(".", "_")
            report[key] = round(ratio, 3)
            report[f"{key}_by_round"] = [None if r is None else round(r, 3) for r in by_round]
            print(f"{subject} / {peer} serve (output tok/s): {ratio:.2f}x; by round: "
                  + ", ".join("-" if r is None else f"{r:.2f}x" for r in by_round))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
