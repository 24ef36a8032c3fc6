"""Engines for the GPU suite. Each takes an explicit, small share of the GPU, so that a test
that fails (or whose engine lives on until garbage collection) cannot starve the next one,
and the four workers of benchmarks/gpu_check.sh fit on one GPU side by side."""

from __future__ import annotations

from pathlib import Path

from tokenmill import LLM

#: gpu_memory_utilization of every engine in the suite: 4 workers x 2 engines fit in 80 GB
GPU_SHARE = 0.1


def cuda_llm(path: Path | str, **engine_args) -> LLM:
    engine_args.setdefault("gpu_memory_utilization", GPU_SHARE)
    return LLM(str(path), device="cuda", **engine_args)
