"""A conformance kit for attention backends: randomized paged-attention cases checked
against the ``torch`` reference backend.

Any backend package can use it::

    from tokenmill.testing.attention_conformance import conformance_cases, check_backend

    @pytest.mark.parametrize("case", conformance_cases(200), ids=str)
    def test_my_backend(case):
        check_backend(MyBackend(), case)

Cases mix prefill chunks on top of cached prefixes with single-token decodes,
GQA/MQA, sliding windows and soft-capping, and include the edge cases: only
decodes, only prefills, one-token prompts and lengths on block boundaries.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.interfaces.attention import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from tokenmill.plugins.attention.torch_ref import TorchReferenceAttention

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


@dataclass(frozen=True)
class AttentionCase:
    seed: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    #: per request: (tokens already cached, new tokens this step)
    requests: tuple[tuple[int, int], ...]
    sliding_window: Optional[int] = None
    soft_cap: Optional[float] = None
    #: what K/V are stored in (cache.kv_cache_dtype); None: dtype
    cache_dtype: Optional[torch.dtype] = None

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.cache_dtype or self.dtype

    def __str__(self) -> str:
        kind = str(self.dtype).removeprefix("torch.")
        if self.cache_dtype is not None:
            kind += "-kv" + str(self.cache_dtype).removeprefix("torch.")
        extra = (f"-w{self.sliding_window}" if self.sliding_window else "") + (f"-cap{self.soft_cap}" if self.soft_cap else "")
        return f"s{self.seed}-h{self.num_heads}kv{self.num_kv_heads}d{self.head_dim}-b{self.block_size}-{kind}{extra}"


def conformance_cases(count: int = 200, seed: int = 0, dtypes=(torch.float32, torch.bfloat16),
                      scale: float = 1.0) -> list[AttentionCase]:
    """``count`` cases; ``scale`` < 1 shrinks lengths and head counts (for interpreted kernels).
    fp32 and fp16 cases at index % 4 == 2 keep their cache in bf16 (cache.kv_cache_dtype; the
    reference reads the same bf16 values, so the query dtype's tolerance still holds)."""
    rng = random.Random(seed)
    cases = []

    def length(high: int) -> int:
        return rng.randint(1, max(2, int(high * scale)))

    for index in range(count):
        heads, kv = rng.choice([(4, 4), (4, 2), (8, 2), (4, 1), (2, 1)] if scale >= 1 else [(2, 2), (2, 1), (4, 2)])
        block = rng.choice([4, 8, 16])
        kind = index % 6
        requests = []
        for _ in range(rng.randint(1, 5 if scale >= 1 else 3)):
            if kind == 0:  # only decodes
                requests.append((length(70), 1))
            elif kind == 1:  # only fresh prefills
                requests.append((0, length(40)))
            elif kind == 2:  # one-token prompts and block-boundary lengths
                requests.append(rng.choice([(0, 1), (block, 1), (block - 1, 1), (0, block), (block, block), (2 * block - 1, 1)]))
            else:  # mixed: chunks on cached prefixes and decodes
                requests.append((length(50) - 1, rng.choice([1, 1, length(30)])))
        cases.append(AttentionCase(
            seed=seed * 100_000 + index, num_heads=heads, num_kv_heads=kv,
            head_dim=rng.choice([16, 32, 64] if scale >= 1 else [16, 24]),
            block_size=block, dtype=dtypes[index % len(dtypes)], requests=tuple(requests),
            sliding_window=rng.choice([None, None, rng.randint(1, 24)]),
            soft_cap=rng.choice([None, None, None, 20.0]),
            cache_dtype=torch.bfloat16 if dtypes[index % len(dtypes)] in (torch.float32, torch.float16)
            and index % 4 == 2 else None,
        ))
    return cases


def supports(backend: AttentionBackend, case: AttentionCase) -> bool:
    caps = backend.capabilities
    return (case.dtype in caps.dtypes
            and (case.cache_dtype in (None, case.dtype) or case.cache_dtype in caps.kv_cache_dtypes)
            and (caps.head_sizes is None or case.head_dim in caps.head_sizes)
            and (caps.block_sizes is None or case.block_size in caps.block_sizes)
            and (case.sliding_window is None or caps.sliding_window)
            and (case.soft_cap is None or caps.logits_soft_cap))


def build_inputs(case: AttentionCase, shape_of: AttentionBackend, device: str = "cpu"):
    """(spec, query, key, value, kv_cache, metadata) with the cached prefixes already in the cache."""
    g = torch.Generator().manual_seed(case.seed)
    spec = AttentionLayerSpec(case.num_heads, case.num_kv_heads, case.head_dim, case.head_dim**-0.5,
                              case.sliding_window, case.soft_cap)
    bs = case.block_size
    needs = [-(-(cached + new) // bs) for cached, new in case.requests]
    num_blocks = sum(needs) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, cursor = [], 0
    for count in needs:
        tables.append(order[cursor:cursor + count])
        cursor += count
    cache = torch.randn(shape_of.kv_cache_shape(num_blocks, bs, case.num_kv_heads, case.head_dim),
                        generator=g).to(case.kv_dtype)
    total = sum(new for _, new in case.requests)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(case.dtype)

    query, key, value = rand(total, case.num_heads, case.head_dim), rand(total, case.num_kv_heads, case.head_dim), \
        rand(total, case.num_kv_heads, case.head_dim)
    starts, seq_lens, slots = [0], [], []
    for (cached, new), table in zip(case.requests, tables):
        starts.append(starts[-1] + new)
        seq_lens.append(cached + new)
        slots += [table[p // bs] * bs + p % bs for p in range(cached, cached + new)]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(new for _, new in case.requests),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=tuple(starts),
        seq_lens_cpu=tuple(seq_lens),
        block_size=bs,
    )
    return spec, query, key, value, cache, metadata


#: elements a 32-bit offset reaches; a GPU's per-layer cache holds more for a model of few layers
INT32_OFFSETS = 2**31


def check_backend(backend: AttentionBackend, case: AttentionCase, device: str = "cpu",
                  past_int32: bool = False) -> None:
    """Assert ``backend`` matches the reference on ``case`` (output and written cache).

    ``past_int32``: the case's blocks sit at the top of a cache whose K half alone holds more
    than 2**31 elements (80 GB of an H100 over a few layers), where a kernel that computes a
    block's offset in 32 bits reads and writes elsewhere (on a GPU: an illegal address). That
    cache is ``torch.empty`` in the reference layout: on the CPU only the pages of the case's
    blocks are ever committed."""
    reference = TorchReferenceAttention()
    if not supports(backend, case):
        return
    spec, q, k, v, cache, metadata = build_inputs(case, reference)
    expected_cache = cache.clone()
    expected = reference.forward(spec, q, k, v, expected_cache, metadata)
    _, _, _, _, _, device_metadata = build_inputs(case, reference, device)
    first = 0
    if past_int32:
        if getattr(backend, "from_reference_layout", None) is not None:
            raise ValueError("past_int32 checks backends that keep the reference cache layout")
        used = cache.shape[1]
        first = INT32_OFFSETS // cache[0, 0].numel() + 1
        got_cache = torch.empty(reference.kv_cache_shape(first + used, *cache.shape[2:]), dtype=cache.dtype,
                                device=device)
        got_cache[:, first:] = cache.to(device)
        device_metadata = dataclasses.replace(device_metadata, block_table=device_metadata.block_table + first,
                                              slot_mapping=device_metadata.slot_mapping + first * case.block_size)
    else:  # the backend may lay its cache out differently: rebuild the same contents in its layout
        got_cache = to_layout(cache, backend, case).to(device)
    build_metadata = getattr(backend, "build_metadata", None)  # once per step, as the model runner does
    if build_metadata is not None:
        device_metadata = build_metadata(device_metadata)
    got = backend.forward(spec, q.to(device), k.to(device), v.to(device), got_cache, device_metadata).cpu()
    tolerance = TOLERANCES[case.dtype]
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    written = got_cache[:, first:].cpu() if past_int32 else from_layout(got_cache.cpu(), backend, case)
    torch.testing.assert_close(written, expected_cache, atol=0, rtol=0)


def to_layout(reference_cache: torch.Tensor, backend: AttentionBackend, case: AttentionCase) -> torch.Tensor:
    """The reference layout [2, blocks, block_size, kv_heads, head_dim] -> the backend's."""
    convert = getattr(backend, "from_reference_layout", None)
    return convert(reference_cache) if convert else reference_cache.clone()


def from_layout(cache: torch.Tensor, backend: AttentionBackend, case: AttentionCase) -> torch.Tensor:
    convert = getattr(backend, "to_reference_layout", None)
    return convert(cache) if convert else cache
