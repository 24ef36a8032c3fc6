"""Triton's kernel cache, filled on a CPU machine for the GPU that will read it.

On a lent GPU, every Triton kernel the engine launches compiles at its first use in each
process (ptxas, a fraction of a second to seconds per specialization), and the GPU check's
minutes went to compiling instead of measuring. Triton's on-disk cache is keyed by content
alone: Triton's own build (``triton_key()``: its sources and ``libtriton``, which differs
between CPython versions of the same release), the kernel's source and specialization, the
backend (the bundled ptxas's version, the arch) and the options. So the same Triton release on
a CPU compiles for sm_90 what a GPU would, and the GPU finds it, given:

- ``compile_only``: a Triton driver that names the target and launches nothing (every launch
  is Triton's own warm-up: compile, cache, return), and the GPU interpreter's ``triton_key``;
- the same absolute ``TRITON_CACHE_DIR`` on both machines: a kernel's group file names its
  members by absolute path;
- the specializations the GPU will ask for: ``dry_run`` builds and runs the GPU check's engines
  on the CUDA stand-in (``fake_cuda``), whose tensors give the same pointer alignments, integer
  specializations (equal to 1, divisible by 16) and tile choices as the GPU's; ``record`` (on
  the GPU, Triton's post-compile hook) appends every specialization a process uses to a file,
  and ``preload`` compiles those here the next time, so what the stand-in's batches missed is
  covered too.

Launchers (a small C module per kernel signature, built with the host's compiler against
libcuda) are not in this cache; they build on the GPU machine in about a second each.

    python -m tokenmill.testing.triton_cache /tmp/tokenmill-triton-cache --triton-key KEY [--records F]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
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
    fp32 for the features, the quantized checkpoints) and the benchmarks' (the 1b model's
    shapes in bf16 at 256 sequences, step by step and with async scheduling)."""
    engines = []
    for arch in FAMILIES:
        engines += [(f"{arch} {dtype}", arch, {"dtype": dtype}) for dtype in ("bfloat16", "float16")]
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
    return engines


def _model(arch: str, models: Path) -> str:
    """A checkpoint path as it is, else a tiny model of the family (the 1b preset: one layer of it,
    the kernels being the same for each layer)."""
    from tokenmill.bench.common import PRESETS
    from tokenmill.testing.tiny_models import make_tiny_model

    if os.path.isdir(arch):
        return arch
    path = models / arch
    if not path.exists():
        if arch in PRESETS:
            make_tiny_model("llama", path, **{**PRESETS[arch], "num_hidden_layers": 1})
        else:
            make_tiny_model(arch, path)
    return str(path)


def dry_run(engines: list[tuple[str, str, dict[str, Any]]], models: Path) -> Iterator[tuple[str, float]]:
    """Build and run each engine on the CUDA stand-in (inside ``compile_only``); yields each
    label and its seconds. A failing engine is reported and the next one runs."""
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
        started = time.perf_counter()
        try:
            with fake_cuda():
                config = load_config(model=_model(arch, models), device=FakeCudaPlatform.name,
                                     attention_backend="triton", kv_cache_memory_bytes=2**26, **args)
                llm = LLM(config=config, plugin_manager=plugins)
                llm.generate(prompts, params, use_tqdm=False)
                del llm
        except Exception as error:  # one engine's failure hides none of the others' kernels
            print(f"{label}: {type(error).__name__}: {error}", file=sys.stderr)
        yield label, time.perf_counter() - started


def record(path: str | os.PathLike) -> None:
    """Append every Triton specialization this process uses (compiled or read from the cache)
    to ``path``, a line of JSON each: the kernel's module and name, and Triton's own
    serialization of its specialization, which ``preload`` compiles from."""
    from triton import knobs

    def hook(*, fn: Any, compile: dict[str, Any], **_: Any) -> None:
        data = compile.get("specialization_data") if isinstance(compile, dict) else None
        if data is None:  # torch inductor's kernels (TORCHINDUCTOR_RUN_JIT_POST_COMPILE_HOOK) pass other shapes
            return
        line = json.dumps({"module": fn.module, "name": fn.name, "specialization": data})
        with open(path, "a") as file:  # one write per line: processes append side by side
            file.write(line + "\n")

    knobs.runtime.jit_post_compile_hook = hook


def preload(path: str | os.PathLike) -> tuple[int, list[str]]:
    """Compile each distinct specialization ``record`` wrote (inside ``compile_only``); returns
    how many, and the failures (a kernel renamed or changed since it was recorded)."""
    done, failures = 0, []
    for line in sorted(set(Path(path).read_text().splitlines())):
        entry = json.loads(line)
        data = json.loads(entry["specialization"])
        # libdevice at the GPU machine's path: without it, the options take this machine's copy
        # (its content, not its path, is in the cache key)
        libs = [lib for lib in data["options"].get("extern_libs") or [] if lib[0] != "libdevice"]
        data["options"]["extern_libs"] = libs or None
        try:
            fn = getattr(importlib.import_module(entry["module"]), entry["name"])
            fn.preload(json.dumps(data))
            done += 1
        except Exception as error:
            failures.append(f"{entry['module']}.{entry['name']}: {type(error).__name__}: {error}")
    return done, failures


def prune(cache_dir: Path) -> tuple[int, int]:
    """Drop what a launch does not read; returns the kernels (cache directories) and bytes left."""
    kernels = size = 0
    for entry in cache_dir.iterdir():
        kernels += 1
        for file in entry.iterdir():
            if file.suffix in KEPT_SUFFIXES:
                size += file.stat().st_size
            else:
                file.unlink()
    return kernels, size


def kernel_names(cache_dir: Path) -> dict[str, str]:
    """Cache directory -> the kernel compiled in it."""
    return {entry.name: next((f.stem for f in entry.glob("*.cubin")), "?") for entry in cache_dir.iterdir()
            if entry.is_dir()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_dir", type=Path, help="the TRITON_CACHE_DIR the GPU will use (absolute)")
    parser.add_argument("--triton-key", help="the GPU interpreter's triton_key() (default: this one's)")
    parser.add_argument("--arch", type=int, default=DEFAULT_ARCH, help="compute capability, as 90 for sm_90")
    parser.add_argument("--records", type=Path, help="specializations a GPU recorded (record), compiled first")
    parser.add_argument("--checkpoints", type=Path, help="the quantized checkpoints the GPU suite reads")
    parser.add_argument("--only", nargs="*", help="engines whose label starts with one of these")
    args = parser.parse_args(argv)
    from tokenmill.server.logging import configure_logging  # here: sitecustomize imports this module everywhere

    if not args.cache_dir.is_absolute():
        parser.error("cache_dir must be absolute: the GPU finds a kernel's files by their absolute paths")
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = str(args.cache_dir)
    os.environ["TQDM_DISABLE"] = "1"  # a line per engine, and the engines' warnings
    configure_logging("warning")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    before = len(kernel_names(args.cache_dir))
    started = time.perf_counter()
    with compile_only(args.arch, args.triton_key), tempfile.TemporaryDirectory() as models:
        if args.records is not None:
            done, failures = preload(args.records)
            print(f"recorded specializations: {done} compiled, {len(failures)} failed", *failures, sep="\n  ")
        engines = [engine for engine in gpu_check_engines(args.checkpoints)
                   if not args.only or engine[0].startswith(tuple(args.only))]
        for label, seconds in dry_run(engines, Path(models)):
            print(f"{label}: {seconds:.1f} s, {len(kernel_names(args.cache_dir))} kernels in the cache", flush=True)
    kernels, size = prune(args.cache_dir)
    print(f"{kernels} kernels ({kernels - before} new) for sm_{args.arch}, {size / 2**20:.1f} MiB, "
          f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
