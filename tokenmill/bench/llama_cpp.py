"""llama.cpp as a peer in the benchmarks: same random-weight checkpoint, converted to GGUF.

llama.cpp is not a tokenmill dependency: point ``--llama-cpp`` at a llama.cpp
source tree built with CMake (``cmake -B build -DGGML_NATIVE=ON && cmake --build
build --target llama-batched-bench llama-server``); its ``convert_hf_to_gguf.py``
writes the GGUF once, next to the checkpoint, in the checkpoint's dtype (so
llama.cpp runs the same fp32 or bf16 weights, not a quantized copy). The
offline and batch-1 rows come from ``llama-batched-bench`` (all sequences'
prompts, then all decode steps, per-sequence KV), the serving row from
``llama-server`` with one slot per concurrent request.

Checked here: the 52m GGUF gives llama.cpp the same greedy tokens as tokenmill.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tokenmill.core.config.model_config import load_model_config

#: runs the converter with two adjustments for tokenmill's test checkpoints: their locally
#: trained byte-level BPE tokenizer has no sentencepiece model (the Llama converter tries that
#: first) and a pre-tokenizer hash the converter does not know
_CONVERT = """
import sys
sys.path.insert(0, {source!r})
import convert_hf_to_gguf
from conversion import base, llama
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", {outtype!r}]
convert_hf_to_gguf.main()
"""


def add_llama_cpp_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--llama-cpp", type=Path,
                        help="a built llama.cpp source tree: adds llama.cpp (same weights, GGUF) as a peer")


def _binary(source: Path, name: str) -> str:
    path = source / "build" / "bin" / name
    if not path.is_file():
        raise SystemExit(f"{path} not found: build llama.cpp with CMake first (see tokenmill/bench/llama_cpp.py)")
    return str(path)


def _run(command: list[str], what: str) -> str:
    """stdout of ``command``; on failure, exits with the tail of its stderr."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def gguf_for(model: Path, source: Path) -> Path:
    """The checkpoint as GGUF in its own dtype, converted on first use."""
    stored = str(load_model_config(model).hf_config.get("dtype") or "float32").removeprefix("torch.")
    outtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[stored]
    out = model / f"model-{outtype}.gguf"
    if not out.is_file():
        code = _CONVERT.format(source=str(source), model=str(model), out=str(out), outtype=outtype)
        try:
            _run([sys.executable, "-c", code], "GGUF conversion")
        except SystemExit:
            out.unlink(missing_ok=True)
            raise
    return out


def batched_bench(model: Path, source: Path, prompt_len: int, output_len: int, sequences: int,
                  threads: int) -> dict:
    """One ``llama-batched-bench`` run: t_pp (all prompts), t_tg (all decode steps), t (both), seconds."""
    command = [_binary(source, "llama-batched-bench"), "-m", str(gguf_for(model, source)),
               "-c", str(sequences * (prompt_len + output_len)), "-b", "2048", "-ub", "512",
               "-npp", str(prompt_len), "-ntg", str(output_len), "-npl", str(sequences),
               "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    out = _run(command, "llama-batched-bench")
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def server_command(model: Path, source: Path, port: int, threads: int, slots: int, context_per_slot: int) -> list[str]:
    """``llama-server`` with ``slots`` parallel sequences (continuous batching is on by default)."""
    return [_binary(source, "llama-server"), "-m", str(gguf_for(model, source)), "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * context_per_slot),
            "--alias", "bench", "--log-disable"]
