"""Where an engine step's time goes on a GPU: torch.profiler over batch-1 and batch-256 decoding.

For each workload: wall time per output token, the GPU's kernel time in the same window
(so the share of the wall the GPU sat idle: host-bound work, launches, syncs), kernel
launches per output token, the kernels that took the most GPU time, and the host-side ops
that took the most CPU time. The GPU speed issue's batch-1 gap (3.46 ms per token on an H100
against a 0.7 ms weight-streaming bound) is either GPU time or idle time: this says which.

    python benchmarks/gpu_profile.py --model /tmp/tokenmill-1b
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams


def device_time(event) -> float:
    """An averaged event's own device time, microseconds (torch renamed cuda -> device)."""
    value = getattr(event, "self_device_time_total", None)
    return value if value is not None else event.self_cuda_time_total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    engine_args = {"gpu_memory_utilization": args.gpu_memory_utilization} if on_gpu else {}
    llm = LLM(args.model, device=args.device, dtype="bfloat16", **engine_args)
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    for name, batch, input_len, output_len in (("batch 1", 1, 256, 64), ("batch 256", 256, 256, 16)):
        prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(input_len)]} for _ in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if on_gpu:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        tokens = batch * output_len
        averages = prof.key_averages()
        kernels = [e for e in averages if e.device_type == DeviceType.CUDA]
        gpu_us = sum(device_time(e) for e in kernels)
        launches = sum(e.count for e in kernels)
        print(f"== {name}: {batch} x ({input_len} -> {output_len}), prompts included")
        print(f"wall {wall * 1e3:.1f} ms, {wall / tokens * 1e3:.3f} ms per output token; GPU kernels "
              f"{gpu_us / 1e3:.1f} ms ({gpu_us / 1e6 / wall:.0%} of the wall: idle {1 - gpu_us / 1e6 / wall:.0%}); "
              f"{launches / tokens:.1f} kernels per output token")
        print(f"{'kernel':<72} {'calls':>7} {'GPU ms':>8} {'share':>6}")
        for event in sorted(kernels, key=device_time, reverse=True)[:args.top]:
            print(f"{event.key[:72]:<72} {event.count:>7} {device_time(event) / 1e3:>8.2f} "
                  f"{device_time(event) / max(gpu_us, 1):>6.1%}")
        host = [e for e in averages if e.device_type == DeviceType.CPU]
        print(f"{'host op':<72} {'calls':>7} {'CPU ms':>8} {'share':>6}")
        for event in sorted(host, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]:
            print(f"{event.key[:72]:<72} {event.count:>7} {event.self_cpu_time_total / 1e3:>8.2f} "
                  f"{event.self_cpu_time_total / 1e6 / wall:>6.1%}")


if __name__ == "__main__":
    main()
