"""Throughput with 0, 1 and 4 distinct LoRA adapters in the batch, against the base model.

Same model, prompts and output lengths for every row: the base engine
without LoRA, the LoRA engine serving base-only requests, then all requests
on one adapter, then requests spread round-robin over four adapters
(max_loras=4). Adapters are random rank-16 PEFT adapters on every linear layer.

    python benchmarks/lora.py --preset 52m --num-prompts 64 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tokenmill.bench.common import add_common_args, prepare, random_prompts, write_json
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.testing.tiny_adapters import make_lora_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()

    path = prepare(args)
    adapters = []
    for i in range(4):
        directory = Path(f"{path}-lora{i}")
        if not (directory / "adapter_model.safetensors").is_file():
            make_lora_adapter(path, directory, rank=args.rank, targets=TARGETS, seed=i)
        adapters.append(LoRARequest(f"a{i}", i + 1, str(directory)))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(args.num_prompts, args.input_len, path, seed=0)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    cases = {
        "base model, LoRA off": (dict(), None),
        "LoRA on, 0 adapters": (dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank), None),
        "1 adapter": (dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank), [adapters[0]] * len(prompts)),
        "4 adapters": (dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank),
                       [adapters[i % 4] for i in range(len(prompts))]),
    }
    results = {}
    for name, (engine_args, loras) in cases.items():
        llm = LLM(str(path), kv_cache_memory_bytes=512 * 2**20, **engine_args)
        llm.generate(prompts[:2], params, use_tqdm=False, lora_request=loras[:2] if loras else None)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        elapsed = time.perf_counter() - start
        results[name] = round(args.num_prompts * args.output_len / elapsed, 1)
        print(f"{name:<24} {results[name]:>8.1f} output tok/s  ({results[name] / results[next(iter(results))]:.2f}x base)",
              flush=True)
    write_json(args.json, {"config": {k: v for k, v in vars(args).items() if k != "json"}, "output_tok_s": results})


if __name__ == "__main__":
    main()
