"""The Triton attention backend against torch SDPA's FlashAttention on one GPU, one layer call.

Decode (one query token per sequence over a paged cache, random block tables) and causal
prefill, bf16, 32 query heads / 8 KV heads of 128, blocks of 16: the shapes of the GPU speed
issue. The Triton side is the backend's own ``forward`` (metadata built outside the timing;
the call writes the step's K/V too, as the engine's does); SDPA flash reads contiguous K/V of
the same lengths with ``enable_gqa`` and no paging. Each case checks the two agree before it
is timed (``triton.testing.do_bench``, medians). The HBM fraction is the K/V bytes a decode
must read over the time, against this GPU's copy bandwidth measured here (bytes read plus
written); prefill reports TFLOP/s (causal: half of 4 S^2 D per head).

With ``--flex`` the flex backend (torch's FlexAttention, compiled; the first call of each shape
compiles, outside the timing) is timed beside them, its agreement checked the same way; a
case it fails on says why in its row and the others still run.

With ``--sweep`` it times the kernels' tile choices instead, at decode 64 x 4096 and 1 x 4096
and prefill 1 x 4096: decode positions per tile and warps, prefill query tile (the backend's
``block_m``), context step and warps; each against the default, fastest first. Prefill is
swept at 128-wide heads and at the ``1b`` preset's (TinyLlama's 32 / 4 heads of 64, whose
tensor-core tile steps 16 positions so that Triton 3.6 does not spill).

    python benchmarks/gpu_attention.py
    python benchmarks/gpu_attention.py --sweep
    python benchmarks/gpu_attention.py --flex
    TRITON_INTERPRET=1 python benchmarks/gpu_attention.py --device cpu --small   # a dry run of the code paths
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from tokenmill.interfaces.attention import AttentionLayerSpec, AttentionMetadata
from tokenmill.plugins.attention.flex.backend import FlexAttentionBackend
from tokenmill.plugins.attention.triton_paged import kernels
from tokenmill.plugins.attention.triton_paged.backend import TritonPagedAttention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DECODE = [(1, 4096), (16, 2048), (64, 4096), (256, 1024)]  # (batch, context)
PREFILL = [(1, 4096), (8, 1024)]  # (sequences, length)
#: the sweep: decode (TILE_N, warps); prefill (block_m, BLOCK_N, warps)
DECODE_TILES = [(n, w) for n in (16, 32, 64, 128) for w in (4, 8)]
PREFILL_TILES = [(m, n, w) for m in (32, 64, 128) for n in (32, 64) for w in (4, 8)]
#: the prefill sweep's head layouts: (query heads, KV heads, head size, tiles)
PREFILL_SWEEP = [(HEADS, KV_HEADS, HEAD_DIM, PREFILL_TILES),
                 (32, 4, 64, [(m, n, w) for m in (32, 64) for n in (16, 32) for w in (4, 8)])]


def paged(lengths: list[int], new: list[int], device: str, dtype: torch.dtype, generator: torch.Generator,
          kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM):
    """A cache holding each sequence's first ``length - new`` tokens (shuffled blocks), the
    step's metadata (``new`` query tokens each), and the contiguous K/V of the whole lengths."""
    blocks = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(blocks) + 1
    order = torch.randperm(num_blocks, generator=generator)[:sum(blocks)]
    table = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    k = torch.randn(sum(lengths), kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(sum(lengths), kv_heads, head_dim, generator=generator).to(dtype)
    cache = torch.zeros(2, num_blocks, BLOCK, kv_heads, head_dim, dtype=dtype)
    slots, first, used, starts = [], 0, 0, [0]
    for i, (n, q) in enumerate(zip(lengths, new)):
        table[i, :blocks[i]] = order[used:used + blocks[i]]
        used += blocks[i]
        positions = torch.arange(n)
        at = table[i, positions // BLOCK].long(), positions % BLOCK
        cached = n - q
        cache[0, at[0][:cached], at[1][:cached]] = k[first:first + cached]
        cache[1, at[0][:cached], at[1][:cached]] = v[first:first + cached]
        slots.append(at[0][cached:] * BLOCK + at[1][cached:])
        first += n
        starts.append(starts[-1] + q)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device), block_table=table.to(device),
        slot_mapping=torch.cat(slots).to(device), max_query_len=max(new), max_seq_len=max(lengths),
        query_start_loc_cpu=tuple(starts), seq_lens_cpu=tuple(lengths), block_size=BLOCK)
    picks = torch.cat([torch.arange(s + n - q, s + n) for s, n, q in
                       zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths, new)])
    return cache.to(device), metadata, k.to(device), v.to(device), picks.to(device)


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA over [batch, heads, tokens, dim] inputs, FlashAttention only where there is CUDA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION] if q.is_cuda else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def timed(fn, device: str) -> float:
    if device == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    return float("nan")


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=100, return_mode="median")
    return 2 * src.numel() / (ms / 1e3)


def sweep(device: str, small: bool, generator: torch.Generator) -> list[dict]:
    """Each tile choice of the two kernels, timed (and checked against the default's output)."""
    dtype, spec = torch.bfloat16, AttentionLayerSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    rows = []
    for batch, context in ([(2, 40)] if small else [(64, 4096), (1, 4096)]):
        cache, common, _, _, _ = paged([context] * batch, [1] * batch, device, dtype, generator)
        meta = TritonPagedAttention().build_metadata(common)
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)

        def decode(tiles):
            return kernels.paged_attention(q, cache, meta.block_table, meta.decode_req, meta.decode_pos,
                                           spec.scale, None, None, meta.num_splits, tiles=tiles)

        expected = decode(None)
        for tiles in DECODE_TILES[:2] if small else DECODE_TILES:
            error = ((decode(tiles).float() - expected.float()).norm() / expected.float().norm()).item()
            rows.append({"case": f"decode {batch} x {context}", "tiles": f"TILE_N={tiles[0]} warps={tiles[1]}",
                         "ms": timed(lambda: decode(tiles), device), "rel_error": error})
    length = 40 if small else 4096
    for heads, kv_heads, head_dim, tiles in PREFILL_SWEEP:
        cache, common, k_all, v_all, picks = paged([length], [length], device, dtype, generator, kv_heads, head_dim)
        kernels.write_kv(cache, k_all[picks], v_all[picks], common.slot_mapping)  # the prompt's own K/V
        q = torch.randn(length, heads, head_dim, generator=generator).to(dtype).to(device)
        expected = None
        for block_m, block_n, warps in tiles[:2] if small else tiles:
            meta = TritonPagedAttention(block_m=block_m).build_metadata(common)
            out = torch.empty_like(q)

            def prefill():
                kernels.prefill_attention(q, cache, meta.block_table, out, meta.tile_req, meta.tile_start,
                                          meta.query_start_loc, meta.seq_lens, head_dim**-0.5, None, None, block_m,
                                          step=(block_n, warps))

            prefill()
            expected = out.clone() if expected is None else expected
            error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
            rows.append({"case": f"prefill 1 x {length}, {heads}/{kv_heads} x {head_dim}",
                         "tiles": f"block_m={block_m} BLOCK_N={block_n} warps={warps}",
                         "ms": timed(prefill, device), "rel_error": error})
    return rows


def flex_timing(flex: FlexAttentionBackend, spec: AttentionLayerSpec, q, k, v, cache, common, reference,
                device: str) -> dict:
    """The flex backend on the same step: its time and error against SDPA's output, or why it failed."""
    try:
        metadata = flex.build_metadata(common)
        out = flex.forward(spec, q, k, v, cache, metadata)  # compiles for this shape, outside the timing
        error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
        return {"flex_ms": timed(lambda: flex.forward(spec, q, k, v, cache, metadata), device),
                "flex_rel_error": error}
    except Exception as failure:  # one case's failure must not hide the other cases' figures
        return {"flex_failed": f"{type(failure).__name__}: {str(failure).splitlines()[0][:160]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="shapes an interpreter can run (a dry run)")
    parser.add_argument("--sweep", action="store_true", help="time the kernels' tile choices instead")
    parser.add_argument("--flex", action="store_true", help="time the flex backend (FlexAttention) beside them")
    parser.add_argument("--json")
    args = parser.parse_args()
    device, dtype = args.device, torch.bfloat16
    if args.sweep:
        rows = sweep(device, args.small, torch.Generator().manual_seed(0))
        print(f"{'case':<34} {'tiles':<34} {'ms':>8} {'rel err':>8}")
        for row in sorted(rows, key=lambda r: (r["case"], r["ms"])):
            print(f"{row['case']:<34} {row['tiles']:<34} {row['ms']:>8.3f} {row['rel_error']:>8.1e}")
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"rows": rows}, out, indent=1)
        return
    decode, prefill = (DECODE, PREFILL) if not args.small else ([(2, 40)], [(1, 40)])
    generator = torch.Generator().manual_seed(0)
    backend = TritonPagedAttention()
    flex = FlexAttentionBackend(compile=device == "cuda") if args.flex else None
    spec = AttentionLayerSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    bandwidth = copy_bandwidth() if device == "cuda" else float("nan")
    rows = []
    for kind, cases in (("decode", decode), ("prefill", prefill)):
        for batch, length in cases:
            new = 1 if kind == "decode" else length
            cache, common, k_all, v_all, picks = paged([length] * batch, [new] * batch, device, dtype, generator)
            q = torch.randn(batch * new, HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
            metadata = backend.build_metadata(common)
            step_k, step_v = k_all[picks], v_all[picks]
            ours = backend.forward(spec, q, step_k, step_v, cache, metadata)
            # SDPA: [batch, heads, tokens, dim], the queries at the ends of their sequences
            sq = q.view(batch, new, HEADS, HEAD_DIM).transpose(1, 2)
            sk = k_all.view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
            sv = v_all.view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
            causal = kind == "prefill"
            reference = flash(sq, sk, sv, causal).transpose(1, 2).reshape(batch * new, HEADS, HEAD_DIM)
            error = ((ours.float() - reference.float()).norm() / reference.float().norm()).item()
            ours_ms = timed(lambda: backend.forward(spec, q, step_k, step_v, cache, metadata), device)
            flash_ms = timed(lambda: flash(sq, sk, sv, causal), device)
            row = {"case": f"{kind} {batch} x {length}", "triton_ms": ours_ms, "flash_ms": flash_ms,
                   "ratio": ours_ms / flash_ms, "rel_error": error}
            if flex is not None:
                row.update(flex_timing(flex, spec, q, step_k, step_v, cache, common, reference, device))
            timed_ms = {name: row[f"{name}_ms"] for name in ("triton", "flash", "flex") if f"{name}_ms" in row}
            if kind == "decode":
                kv_bytes = 2 * batch * length * KV_HEADS * HEAD_DIM * dtype.itemsize
                row.update({f"{name}_hbm": kv_bytes / (ms / 1e3) / bandwidth for name, ms in timed_ms.items()})
            else:
                flops = 2 * batch * HEADS * length * length * HEAD_DIM  # 4 S^2 D per head, halved by the mask
                row.update({f"{name}_tflops": flops / (ms / 1e3) / 1e12 for name, ms in timed_ms.items()})
            rows.append(row)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"{name}, bf16, {HEADS} q / {KV_HEADS} kv heads of {HEAD_DIM}, blocks of {BLOCK}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print(f"{'case':<22} {'triton ms':>10} {'flash ms':>9} {'ratio':>7} {'triton':>14} {'flash':>14} {'rel err':>8}")
    for row in rows:
        if "triton_hbm" in row:
            ours, theirs = f"{row['triton_hbm']:.0%} HBM", f"{row['flash_hbm']:.0%} HBM"
        else:
            ours, theirs = f"{row['triton_tflops']:.0f} TFLOP/s", f"{row['flash_tflops']:.0f} TFLOP/s"
        print(f"{row['case']:<22} {row['triton_ms']:>10.3f} {row['flash_ms']:>9.3f} {row['ratio']:>6.2f}x "
              f"{ours:>14} {theirs:>14} {row['rel_error']:>8.1e}")
        if "flex_ms" in row:
            share = f"{row['flex_hbm']:.0%} HBM" if "flex_hbm" in row else f"{row['flex_tflops']:.0f} TFLOP/s"
            print(f"{'  flex':<22} {row['flex_ms']:>10.3f} {'':>9} {row['flex_ms'] / row['flash_ms']:>6.2f}x "
                  f"{share:>14} {'':>14} {row['flex_rel_error']:>8.1e}")
        elif "flex_failed" in row:
            print(f"{'  flex':<22} failed: {row['flex_failed']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": name, "copy_bandwidth": bandwidth, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
