"""Prefill and decode throughput, and weight memory, per weight format on one model.

The same random-weight model (``--preset 125m``) is quantized by
``tokenmill.testing.quantize`` (round-to-nearest, the shared checkpoints'
layouts) to GPTQ-4bit, AWQ-4bit and FP8, and run beside its fp32 and bf16
versions: prefill tokens/s for a batch of prompts, decode tokens/s at batch 1
and batch 16, and the weight memory the loader reports.

    python benchmarks/quantization.py --preset 125m
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from tokenmill.bench.common import add_common_args, prepare, write_json
from tokenmill import LLM, SamplingParams
from tokenmill.testing.quantize import quantize_model


def weight_mib(llm: LLM) -> float:
    model = llm.llm_engine.runner.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**20


def timed_generate(llm: LLM, prompts, max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.set_defaults(preset="125m")
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--formats", default="fp32,bf16,gptq4,awq4,fp8")
    args = parser.parse_args()

    base = prepare(args)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 30000) for _ in range(args.prompt_len)] for _ in range(16)]
    variants = {
        "fp32": (base, "float32"),
        "bf16": (base, "bfloat16"),
        "gptq4": (Path(f"{base}-gptq4"), "bfloat16"),
        "awq4": (Path(f"{base}-awq4"), "bfloat16"),
        "fp8": (Path(f"{base}-fp8"), "bfloat16"),
    }
    for name, method in (("gptq4", "gptq"), ("awq4", "awq"), ("fp8", "fp8")):
        if name in args.formats and not (variants[name][0] / "model.safetensors").is_file():
            quantize_model(base, variants[name][0], method, bits=4 if method != "fp8" else 8, group_size=128)

    results = {}
    for name in args.formats.split(","):
        path, dtype = variants[name]
        llm = LLM(str(path), dtype=dtype, max_num_batched_tokens=4096, kv_cache_memory_bytes=512 * 2**20)
        timed_generate(llm, prompts[:1], 2)  # warm-up
        prefill = timed_generate(llm, prompts[: args.prefill_batch], 1)
        batch1 = timed_generate(llm, prompts[:1], args.decode_tokens + 1) - timed_generate(llm, prompts[:1], 1)
        batch16 = timed_generate(llm, prompts[:16], args.decode_tokens + 1) - timed_generate(llm, prompts[:16], 1)
        results[name] = {
            "compute_dtype": dtype,
            "weight_mib": round(weight_mib(llm), 1),
            "prefill_tok_s": round(args.prefill_batch * args.prompt_len / prefill, 1),
            "decode_b1_tok_s": round(args.decode_tokens / batch1, 1),
            "decode_b16_tok_s": round(16 * args.decode_tokens / batch16, 1),
        }
        print(f"{name:<6} {dtype:<9} weights {results[name]['weight_mib']:>8.1f} MiB  "
              f"prefill {results[name]['prefill_tok_s']:>8.1f} tok/s  "
              f"decode b1 {results[name]['decode_b1_tok_s']:>6.1f} tok/s  b16 {results[name]['decode_b16_tok_s']:>7.1f} tok/s",
              flush=True)
        del llm
    write_json(args.json, {"config": {k: v for k, v in vars(args).items() if k != "json"},
                           "torch_threads": torch.get_num_threads(), "results": results})


if __name__ == "__main__":
    main()
