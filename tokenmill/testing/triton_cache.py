"""Triton's kernel cache, filled on a CPU machine for the GPU that will read it.

On a lent GPU, every Triton kernel the engine launches compiles at its first use in each
process (ptxas, a fraction of a second to seconds per specialization), and the GPU check's
minutes went to compiling instead of measuring. Triton's on-disk cache is keyed by Triton's
own build (``triton_key()``: its sources and ``libtriton``, which differs between CPython
versions of the same release), the kernel's source (with its first line's number) and
specialization, the backend (ptxas's version, the arch), the options, and the environment
variables Triton lists as changing its output (``MLIR_ENABLE_DUMP``, ``TRITON_OVERRIDE_ARCH``,
...). So the same Triton release on a CPU, at the same commit and with the same environment,
compiles for sm_90 what a GPU would, and the GPU finds it, given:

- ``compile_only``: a Triton driver that names the target and launches nothing (every launch
  is Triton's own warm-up: compile, cache, return), and the GPU interpreter's ``triton_key``;
- the same absolute ``TRITON_CACHE_DIR`` on both machines: a kernel's group file names its
  members by absolute path;
- the specializations the GPU will ask for: ``dry_run`` builds and runs the GPU check's engines
  on the CUDA stand-in (``fake_cuda``), whose tensors give the same pointer alignments, integer
  specializations (equal to 1, divisible by 16) and tile choices as the GPU's; ``record`` (on
  the GPU, Triton's post-compile hook) appends every specialization a process uses to a file,
  and ``preload`` compiles those here the next time, so what the stand-in's batches missed is
  covered too. ``record`` also notes each compile's cache hit or miss, which ``summary`` counts.

Launchers (a small C module per kernel signature, built with the host's compiler against
libcuda, kept in the same cache directory) are not carried; they build on the GPU machine in
about a second each.

    python -m tokenmill.testing.triton_cache build /tmp/tokenmill-triton-cache --triton-key KEY [--records F]
    python -m tokenmill.testing.triton_cache summary RECORDS --carried DIR     # on the GPU, after a run
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

#: the GPU machines' compute capability (H100 and H200)
DEFAULT_ARCH = 90
#: what a kernel needs at run time: the cubin, its metadata, and the group file that lists them
#: (the IRs and PTX that compiling leaves beside them are for debugging)
KEPT_SUFFIXES = (".cubin", ".json")
#: beside the kernels in a built cache: what they were built from (Triton ignores files there)
PROVENANCE = "provenance.json"
#: the families of the GPU suite (tests/gpu)
FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3-moe", "phi3", "gemma", "gemma2", "gpt2")
#: prompt lengths spanning the suite's (3 to 150 tokens) and the benchmarks' (256)
PROMPT_LENGTHS = (3, 17, 64, 150, 256)
NEW_TOKENS = 6


@contextlib.contextmanager
def compile_only(arch: int = DEFAULT_ARCH, triton_key: str | None = None) -> Iterator[None]:
    """Triton on this process compiles for ``cuda`` sm_``arch`` and launches nothing.

    Must be entered before a kernel first runs (Triton binds a kernel's target at its first
    launch) and with ``TRITON_INTERPRET`` unset. ``triton_key`` replaces this build's (take
    it from the GPU's interpreter: ``python -c 'from triton.runtime.cache import triton_key;
    print(triton_key())'``), so that the entries are filed under the key the GPU looks up.
    """
    import torch
    import triton.runtime.cache as cache
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_only needs TRITON_INTERPRET unset: the interpreter compiles nothing")

    class CompileOnly(DriverBase):
        """The driver of a GPU that is not there: a target, device 0 and stream 0."""

        @classmethod
        def is_active(cls) -> bool:
            return True

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def _absent(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("compile_only: no GPU to query")

        map_python_to_cpp_type = get_benchmarker = get_device_interface = _absent
        get_empty_cache_for_benchmark = clear_cache = _absent

    run = JITFunction.run

    def warm_up(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    key, active = cache.triton_key, driver._active  # reset_active() would look for a real GPU's driver
    driver.set_active(CompileOnly())
    JITFunction.run = warm_up
    if triton_key is not None:
        cache.triton_key = lambda: triton_key
    try:
        yield
    finally:
        cache.triton_key = key
        JITFunction.run = run
        driver._active = active


def gpu_check_engines(checkpoints: Path | None = None) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, family or checkpoint path, engine arguments) of the engines the GPU check builds:
    the suite's (tests/gpu: each family in bf16 and fp16, graphed at 8 sequences, llama in
    fp32 for the features, the quantized checkpoints) and the benchmarks' (the 1b preset's
    shapes in bf16 at 256 sequences, step by step and with async scheduling; the 8b's)."""
    engines = []
    for arch in FAMILIES:
        engines += [(f"{arch} {dtype}", arch, {"dtype": dtype}) for dtype in ("bfloat16", "float16")
                    if (arch, dtype) != ("gemma2", "float16")]  # refused: its activations pass fp16's range
        engines.append((f"{arch} graphs", arch, {"dtype": "float32" if "moe" in arch or arch == "mixtral"
                                                 else "bfloat16", "max_num_seqs": 8}))
    engines += [("llama float32", "llama", {"dtype": "float32"}),
                ("llama float32 4 seqs", "llama", {"dtype": "float32", "max_num_seqs": 4}),
                ("llama bfloat16 16 seqs", "llama", {"dtype": "bfloat16", "max_num_seqs": 16,
                                                     "max_num_batched_tokens": 2048})]
    for name in ("fp8", "gptq", "awq") if checkpoints is not None else ():
        for path in sorted(checkpoints.glob(f"*{name}*")):
            engines += [(f"{path.name} {dtype}", str(path), {"dtype": dtype}) for dtype in ("float32", "bfloat16")]
    engines += [(f"1b {mode}", "1b", {"dtype": "bfloat16", "async_scheduling": mode == "async"})
                for mode in ("sync", "async")]
    # Llama-3-8B's layer: the 8b stage's kernels and the attention benchmark's heads (32 / 8 of 128);
    # 16 sequences, since its graphs at 256 take minutes here and launch the same kernels
    engines.append(("8b", "8b", {"dtype": "bfloat16", "async_scheduling": True, "max_num_seqs": 16}))
    return engines


def _model(arch: str, models: Path) -> str:
    """A checkpoint path as it is, else a tiny model of the family, or one layer of a preset's
    shapes: each layer launches the same kernels, and no Triton kernel reads the vocabulary's size."""
    from tokenmill.bench.common import PRESETS
    from tokenmill.testing.tiny_models import make_tiny_model

    if os.path.isdir(arch):
        return arch
    path = models / arch
    if not path.exists():
        if arch in PRESETS:
            make_tiny_model("llama", path, **{**PRESETS[arch], "num_hidden_layers": 1, "vocab_size": 32000})
        else:
            make_tiny_model(arch, path)
    return str(path)


def dry_run(engines: list[tuple[str, str, dict[str, Any]]],
            models: Path) -> Iterator[tuple[str, float, Exception | None]]:
    """Build and run each engine on the CUDA stand-in (inside ``compile_only``); yields each
    label, its seconds and its error: a failing engine hides none of the others' kernels."""
    from tokenmill import LLM, SamplingParams, hookimpl
    from tokenmill.core.config.engine_config import load_config
    from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
    from tokenmill.testing.fake_cuda import fake_cuda
    from tokenmill.testing.fake_cuda_platform import FakeCudaPlatform

    class StandIn:
        @hookimpl
        def register_platforms(self, register):
            register(FakeCudaPlatform.name, FakeCudaPlatform)

    plugins = make_plugin_manager()
    plugins.register(StandIn())
    prompts = [{"prompt_token_ids": [6 + (i * 7 + n) % 500 for i in range(n)]} for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for label, arch, args in engines:
        started, error = time.perf_counter(), None
        try:
            with fake_cuda():
                config = load_config(model=_model(arch, models), device=FakeCudaPlatform.name,
                                     attention_backend="triton", kv_cache_memory_bytes=2**26, **args)
                llm = LLM(config=config, plugin_manager=plugins)
                llm.generate(prompts, params, use_tqdm=False)
                del llm
        except Exception as failure:
            error = failure
        yield label, time.perf_counter() - started, error


def record(path: str | os.PathLike) -> None:
    """Append to ``path``, a line of JSON each, every Triton specialization this process uses
    (the kernel's module and name, and Triton's own serialization of the specialization, which
    ``preload`` compiles from) and every compile (the kernel's name, whether the disk cache had
    it, the milliseconds). Nothing here may fail a launch: a line that cannot be written is lost."""
    from triton import knobs

    def append(line: dict[str, Any]) -> None:
        try:
            with open(path, "a") as file:  # one write per line: processes append side by side
                file.write(json.dumps(line) + "\n")
        except OSError:
            pass

    def hook(*, fn: Any, compile: Any, **_: Any) -> None:
        data = compile.get("specialization_data") if isinstance(compile, dict) else None
        if data is not None:  # torch inductor's kernels (TORCHINDUCTOR_RUN_JIT_POST_COMPILE_HOOK) pass others
            append({"module": fn.module, "name": fn.name, "specialization": data})

    def listener(*, metadata: dict[str, Any], times: Any, cache_hit: bool, **_: Any) -> None:
        append({"compiled": metadata.get("name", "?"), "hit": cache_hit, "ms": round(times.total / 1000, 1)})

    knobs.runtime.jit_post_compile_hook = hook
    knobs.compilation.listener = listener


def preload(path: str | os.PathLike) -> tuple[int, list[str]]:
    """Compile each distinct specialization ``record`` wrote (inside ``compile_only``); returns
    how many, and the failures (a kernel renamed or changed since it was recorded, a cut line)."""
    done, failures = 0, []
    for line in sorted(set(Path(path).read_text().splitlines())):
        if '"specialization"' not in line:
            continue  # a compile's line
        try:
            entry = json.loads(line)
            data = json.loads(entry["specialization"])
            # libdevice at the GPU machine's path: without it, the options take this machine's copy
            # (its content, not its path, is in the cache key)
            libs = [lib for lib in data["options"].get("extern_libs") or [] if lib[0] != "libdevice"]
            data["options"]["extern_libs"] = libs or None
            getattr(importlib.import_module(entry["module"]), entry["name"]).preload(json.dumps(data))
            done += 1
        except Exception as error:
            failures.append(f"{line[:120]}: {type(error).__name__}: {error}")
    return done, failures


def prune(cache_dir: Path) -> tuple[int, int]:
    """Drop what a launch does not read; returns the kernels (cache directories) and bytes left."""
    kernels = size = 0
    for entry in filter(Path.is_dir, cache_dir.iterdir()):
        kernels += 1
        for file in entry.iterdir():
            if file.is_dir():  # a write another process left half done
                shutil.rmtree(file)
            elif file.suffix in KEPT_SUFFIXES:
                size += file.stat().st_size
            else:
                file.unlink()
    return kernels, size


def provenance() -> dict[str, Any]:
    """What, besides a kernel's own source, decides whether a cache built elsewhere is hit here:
    Triton's build (a digest of its key), the environment variables in the key, and the commit
    (a kernel's key holds its first line's number, so an edit above it moves it)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime import cache

    root = Path(__file__).resolve().parents[2]
    try:  # a checkout copied without its .git, or a machine without git, has no commit to tell
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"triton_key": hashlib.sha256(cache.triton_key().encode()).hexdigest()[:12],
            "env": get_cache_invalidating_env_vars(), "commit": commit or "unknown"}


def summary(records: Path, carried: Path) -> list[str]:
    """The GPU check's lines on its Triton compiles: the cache carried and what it was built
    from, against this machine's, and each compile the disk cache missed, by kernel."""
    built = json.loads((carried / PROVENANCE).read_text()) if (carried / PROVENANCE).exists() else {}
    origin = built or "an unknown build (no provenance.json)"
    lines = [f"triton cache: {kernel_count(carried)} kernels carried, built from {origin}; here {provenance()}"]
    compiles = [json.loads(line) for line in records.read_text().splitlines() if line.startswith('{"compiled"')] \
        if records.exists() else []
    misses = [c for c in compiles if not c["hit"]]
    lines.append(f"triton compiles: {len(compiles) - len(misses)} from the cache, {len(misses)} compiled here "
                 f"({sum(c['ms'] for c in misses) / 1000:.1f} s)")
    lines += [f"triton compiled here: {count} {name}"
              for name, count in collections.Counter(c["compiled"] for c in misses).most_common()]
    return lines


def kernel_count(cache_dir: Path) -> int:
    """The kernels in a cache: a directory each (files beside them are not Triton's)."""
    return sum(entry.is_dir() for entry in cache_dir.iterdir()) if cache_dir.is_dir() else 0


def build(args: argparse.Namespace) -> int:
    from tokenmill.server.logging import configure_logging  # here: sitecustomize imports this module everywhere

    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = str(args.cache_dir)
    os.environ["TRITON_STORE_BINARY_ONLY"] = "1"  # no IRs written (not in the cache key)
    os.environ["TQDM_DISABLE"] = "1"  # a line per engine, and the engines' warnings
    configure_logging("warning")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    before, failed = kernel_count(args.cache_dir), 0
    started = time.perf_counter()
    with compile_only(args.arch, args.triton_key), tempfile.TemporaryDirectory() as models:
        if args.records is not None:
            done, failures = preload(args.records)
            failed += len(failures)
            print(f"recorded specializations: {done} compiled, {len(failures)} failed", *failures, sep="\n  ")
        engines = [engine for engine in gpu_check_engines(args.checkpoints)
                   if not args.only or engine[0].startswith(tuple(args.only))]
        for label, seconds, error in dry_run(engines, Path(models)):
            failed += error is not None
            what = f"{type(error).__name__}: {error}" if error else f"{kernel_count(args.cache_dir)} kernels"
            print(f"{label}: {seconds:.1f} s, {what}", flush=True)
        built = provenance()  # under compile_only's triton_key
    kernels, size = prune(args.cache_dir)
    (args.cache_dir / PROVENANCE).write_text(json.dumps(built))
    print(f"{kernels} kernels ({kernels - before} new) for sm_{args.arch}, {size / 2**20:.1f} MiB, "
          f"{time.perf_counter() - started:.0f} s, {failed} failures; built from {built}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("build", help="compile the GPU check's kernels into a cache for a GPU")
    make.add_argument("cache_dir", type=Path, help="the TRITON_CACHE_DIR the GPU will use (absolute)")
    make.add_argument("--triton-key", help="the GPU interpreter's triton_key() (default: this one's)")
    make.add_argument("--arch", type=int, default=DEFAULT_ARCH, help="compute capability, as 90 for sm_90")
    make.add_argument("--records", type=Path, help="what a GPU recorded (record): its specializations compile first")
    make.add_argument("--checkpoints", type=Path, help="the quantized checkpoints the GPU suite reads")
    make.add_argument("--only", nargs="*", help="engines whose label starts with one of these")
    report = commands.add_parser("summary", help="on the GPU: the compiles a run recorded, hits and misses")
    report.add_argument("records", type=Path)
    report.add_argument("--carried", type=Path, required=True, help="the cache carried to this machine")
    args = parser.parse_args(argv)
    if args.command == "summary":
        print(*summary(args.records, args.carried), sep="\n")
        return 0
    if not args.cache_dir.is_absolute():
        parser.error("cache_dir must be absolute: the GPU finds a kernel's files by their absolute paths")
    return build(args)


if __name__ == "__main__":
    sys.exit(main())
