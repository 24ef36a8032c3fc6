"""Shared benchmark setup: model presets made by tokenmill.testing, thread pinning, JSON output."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, TypeVar

import httpx
import torch

from tokenmill.core.config.engine_config import load_config
from tokenmill.core.config.model_config import load_model_config
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.core.plugin_host.platform_selection import select_platform
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.interfaces.platform import Platform
from tokenmill.testing.tiny_models import make_tiny_model

#: shapes of the issue tracker's reference workloads (random weights, Llama family)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(),
    # a forward that costs next to nothing (heads of 64, which vLLM's CPU attention takes): the
    # throughput is the engine's host work per token (scheduling, inputs, sampling, outputs)
    "host": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 intermediate_size=256, max_position_embeddings=2048),
    "52m": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
                intermediate_size=1408, vocab_size=32000, max_position_embeddings=2048,
                initializer_range=0.02),
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048,
                 initializer_range=0.02),
    "350m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048,
                 initializer_range=0.02, dtype=torch.bfloat16),
    # TinyLlama-1.1B's shapes: the GPU check's model
    "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
               intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048,
               initializer_range=0.02, dtype=torch.bfloat16),
    # Llama-3-8B's shapes (16 GB in bf16): the GPU speed issue's realistic size, made on the GPU
    # machine (`tokenmill make-model DIR --preset 8b --device cuda`)
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
               initializer_range=0.02, dtype=torch.bfloat16),
}


def process_rss_mib(pid: int | str = "self") -> float:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def add_common_args(parser: argparse.ArgumentParser, default_preset: str = "52m") -> None:
    parser.add_argument("--model", help="model directory (default: a preset made on first use)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=default_preset)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is stable on a shared box)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/tokenmill/bench-models"))
    parser.add_argument("--rounds", type=int, default=1,
                        help="timed passes per engine, engines taking turns; figures are medians over rounds")


def add_async_scheduling_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--async-scheduling", nargs="?", const="on", default="auto",
                        choices=["auto", "off", "on", "both"],
                        help="vLLM's engine flag: tokenmill launches each step before reading the last one's "
                             "tokens (auto: the engine's default, on for a GPU); both: one tokenmill engine "
                             "without it and one with it (tokenmill-async), timed side by side")


def add_kernel_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags for what the forward pass runs, passed to each tokenmill engine."""
    parser.add_argument("--enforce-eager", action="store_true", help="tokenmill without CUDA graphs")
    parser.add_argument("--compilation-config", default=None,
                        help='\'{"custom_ops": ["none"]}\': tokenmill without its platform kernels (plain PyTorch)')


def kernel_args(args: argparse.Namespace) -> dict[str, Any]:
    """``LLM`` keyword arguments from ``add_kernel_args``' flags."""
    given = {"compilation_config": args.compilation_config} if args.compilation_config else {}
    return {"enforce_eager": args.enforce_eager, **given}


def add_gpu_memory_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM's engine flag: each tokenmill engine's share of the GPU (default: 0.9 shared out "
                             "among the tokenmill engines this process builds, which all stay up while they take "
                             "turns)")


def engine_memory(args: argparse.Namespace, engines: int) -> dict[str, float]:
    """``LLM`` keyword arguments for each of ``engines`` tokenmill engines alive in one process:
    the GPU share asked for, or the platform's default 0.9 split between them (each engine
    counts only its own memory against its share, so two at 0.45 fit where two at 0.9 cannot;
    without a GPU the share is unused)."""
    if args.gpu_memory_utilization is not None:
        return {"gpu_memory_utilization": args.gpu_memory_utilization}
    return {"gpu_memory_utilization": round(0.9 / engines, 2)} if engines > 1 else {}


def tokenmill_engines(args: argparse.Namespace) -> dict[str, Optional[bool]]:
    """The tokenmill engines ``--async-scheduling`` asks for: name -> its async_scheduling."""
    return {"auto": {"tokenmill": None}, "off": {"tokenmill": False}, "on": {"tokenmill": True},
            "both": {"tokenmill": False, "tokenmill-async": True}}[args.async_scheduling]


def prepare(args: argparse.Namespace) -> Path:
    torch.set_num_threads(args.threads)
    if args.model:
        return Path(args.model)
    preset = PRESETS[args.preset]
    path = Path(args.cache_dir) / f"{args.preset}-{str(preset.get('dtype', torch.float32)).removeprefix('torch.')}"
    if not (path / "model.safetensors").is_file():
        make_tiny_model("llama", path, seed=0, **preset)
    return path


Result = TypeVar("Result")


def interleaved_rounds(passes: dict[str, Callable[[], Result]], rounds: int) -> dict[str, list[Result]]:
    """Each engine's timed pass once per round, the engines taking turns (the first engine
    rotating from round to round).

    Why: this shared host's speed drifts by tens of percent within minutes, so engines
    timed one after the other can land in different stretches of it. Taking turns puts
    every engine in every stretch; the medians over rounds, and the ratio of each round's
    pair, are what to quote.
    """
    names = list(passes)
    results: dict[str, list[Result]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(passes[name]())
    return results


def hf_device(device: str) -> str:
    """Where transformers runs beside the engine: the engine's ``--device`` (``auto``: a GPU if visible)."""
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def hf_dtype(name: str, model: Path) -> torch.dtype:
    """``--dtype`` for transformers' ``from_pretrained``: "auto" is what tokenmill's "auto"
    computes in (the checkpoint's dtype, or fp32 for bf16 where the CPU has no bf16
    arithmetic), so that both run the same arithmetic at the speed this CPU gives it."""
    return load_model_config(model, name, resolve_dtype=engine_platform(model, name).resolve_dtype).dtype


def engine_platform(model: Path, dtype: str = "auto") -> Platform:
    """The platform a tokenmill engine of ``model`` selects here (``--device auto``)."""
    config = load_config(model=str(model), dtype=dtype)
    return select_platform(collect_components(make_plugin_manager()).platforms, config)


def random_prompts(count: int, length: int, model: Path, seed: int) -> list[list[int]]:
    """Token-id prompts drawn uniformly from the model's vocabulary (ids below 10 are specials)."""
    vocab = load_model_config(model).vocab_size
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def write_json(path: str | None, results: dict[str, Any]) -> None:
    """Also records the machine's state: on a shared box the load average explains outliers."""
    if path:
        results = {**results, "machine": {"load_average": os.getloadavg(), "cpus": os.cpu_count(),
                                          "torch": torch.__version__}}
        Path(path).write_text(json.dumps(results, indent=2, default=str))


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM (the server drains and exits), then SIGKILL after 30 s."""
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(30)


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until ``url``/health answers 200; a server that exits first ends the benchmark."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            detail = process.stderr.read().decode()[-2000:] if process.stderr else f"exit code {process.returncode}"
            raise SystemExit(f"server exited: {detail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become ready")
