"""Decode-step attention time per backend, against context length and batch size.

One decode token per sequence over a paged cache (8 query / 8 KV heads of 64,
blocks of 16, random block tables), each CPU-runnable registered backend in
the same process; median of 5 runs, milliseconds per layer call. A backend's per-step
metadata (``build_metadata``) is built once, outside the timing, as the engine shares it
across layers; the cache is one, sized for the largest case, as an engine's is (a compiled
backend such as flex would compile again for every cache size).

    python benchmarks/attention.py --contexts 128,512,1024,4096 --batches 1,8,64
"""

from __future__ import annotations

import argparse
import time

import torch

from tokenmill.bench.common import write_json
from tokenmill.core.plugin_host.components import collect_components
from tokenmill.core.plugin_host.plugin_manager import make_plugin_manager
from tokenmill.interfaces.attention import AttentionLayerSpec, AttentionMetadata
from tokenmill.plugins.platforms.cpu.attention import CpuAttention


def decode_inputs(batch: int, context: int, cache: torch.Tensor, heads: int = 8):
    """A decode step of ``batch`` sequences of ``context`` tokens on ``cache`` [2, blocks, block, kv heads, dim]."""
    num_blocks, block, kv_heads, head_dim = cache.shape[1:]
    blocks_per_seq = -(-context // block)
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_seq].view(batch, blocks_per_seq).int()
    positions = [context - 1] * batch
    slots = torch.tensor([int(table[i, p // block]) * block + p % block for i, p in enumerate(positions)])
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_table=table, slot_mapping=slots, max_query_len=1, max_seq_len=context,
        query_start_loc_cpu=tuple(range(batch + 1)), seq_lens_cpu=(context,) * batch, block_size=block)
    q = torch.randn(batch, heads, head_dim, generator=g)
    k = torch.randn(batch, kv_heads, head_dim, generator=g)
    return AttentionLayerSpec(heads, kv_heads, head_dim, head_dim**-0.5), q, k, k.clone(), metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="128,512,1024,4096")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backends", help="comma-separated registered names (default: all CPU-runnable); "
                                           "'cpu-sdpa' is the cpu backend without its C++ decode kernel")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    registry = collect_components(make_plugin_manager()).attention_backends
    names = args.backends.split(",") if args.backends else [n for n in registry.names() if n != "triton"]
    backends = {name: CpuAttention(use_kernels=False) if name == "cpu-sdpa" else registry.get(name)()
                for name in names}
    batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    cache = torch.randn(2, max(batches) * -(-max(contexts) // 16) + 1, 16, 8, 64,
                        generator=torch.Generator().manual_seed(0))
    results = []
    print(f"{'batch':>5} {'context':>7} " + " ".join(f"{name:>10}" for name in backends) + "   (ms per call)")
    for batch in batches:
        for context in contexts:
            spec, q, k, v, common = decode_inputs(batch, context, cache)
            row = {"batch": batch, "context": context}
            for name, backend in backends.items():
                build = getattr(backend, "build_metadata", None)
                metadata = build(common) if build is not None else common
                backend.forward(spec, q, k, v, cache, metadata)
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    backend.forward(spec, q, k, v, cache, metadata)
                    times.append(time.perf_counter() - start)
                row[name] = round(1000 * sorted(times)[2], 3)
            results.append(row)
            print(f"{batch:>5} {context:>7} " + " ".join(f"{row[name]:>10.2f}" for name in backends), flush=True)
    write_json(args.json, {"threads": args.threads, "results": results})


if __name__ == "__main__":
    main()
