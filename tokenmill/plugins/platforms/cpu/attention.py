"""The cpu platform's attention backend: decode rows in one C++ kernel call over the paged
cache, prompt chunks in another.

Decode tokens (one query row per sequence) go to ``paged_decode.cpp``
(kernels/), which reads each sequence's blocks in place: no
gather, one call for the whole batch (64 sequences x 290 tokens, 8 kv heads x
64, fp32: 5.7 ms per layer with the per-sequence path below, ~2 ms with the
kernel). Prompt chunks go to ``paged_prefill.cpp`` (fp32 and bf16, head_dim a
multiple of 32: about 2x faster than SDPA here at 64-1024 tokens). Other head
sizes keep the per-sequence path, which is also the fallback where the kernels
cannot be built: the fused SDPA kernel over gathers into buffers that persist
across calls (fresh large tensors cost page faults here, which made a naive
gather 8x slower). Neither path has logit soft-capping, so models that use it
are left to the reference backend ("auto" does that).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.interfaces.attention import AttentionCapabilities, AttentionLayerSpec, AttentionMetadata
from tokenmill.plugins.attention.torch_ref import TorchReferenceAttention
from tokenmill.plugins.platforms.cpu.kernels import MIXED_CACHE_DTYPES, cpu_kernels


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What every layer of a step shares."""

    #: sequences of the per-sequence SDPA path: prompt chunks, where the decode kernel runs
    others: tuple[int, ...]
    #: the same as an int64 tensor, for the prompt-chunk kernel
    others_index: torch.Tensor
    #: (block table, seq lens, query rows) of the decode rows for the C++ kernel, or None
    decode: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    #: KV slots of the new tokens that have one, and which tokens those are (None: all)
    slots: torch.Tensor
    kept: Optional[torch.Tensor]


@dataclass(frozen=True, slots=True)
class CpuAttentionMetadata(AttentionMetadata):
    """The common metadata, and a cell for the step's plan: worked out by the first layer that
    attends, so a step run entirely by a fused decoder never pays for it."""

    plan_cell: list[StepPlan] = field(default_factory=list)


_COMMON_FIELDS = tuple(f.name for f in fields(AttentionMetadata))


class CpuAttention(TorchReferenceAttention):
    name = "cpu"
    capabilities = AttentionCapabilities(
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        sliding_window=True,
        logits_soft_cap=False,
        kv_cache_dtypes=(torch.bfloat16,),
    )

    def __init__(self, use_kernels: bool = True) -> None:
        self._buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._kernels = cpu_kernels() if use_kernels else None
        self.capabilities = replace(self.capabilities, fused_decode=self._kernels is not None)
        #: the dtypes the prompt-chunk kernel was built for on this CPU
        built = self._kernels.prefill_dtypes() if self._kernels is not None else ()
        self._prefill_dtypes = {getattr(torch, name) for name in built}

    def build_metadata(self, common: AttentionMetadata) -> CpuAttentionMetadata:
        """Called once per step by the model runner (vLLM's metadata builder)."""
        return CpuAttentionMetadata(*(getattr(common, name) for name in _COMMON_FIELDS))

    def _plan(self, common: AttentionMetadata) -> StepPlan:
        starts = common.query_start_loc_cpu
        num_seqs = len(starts) - 1
        keep = common.slot_mapping >= 0
        kept = None if bool(keep.all()) else keep.nonzero().flatten()
        slots = common.slot_mapping if kept is None else common.slot_mapping[kept]
        decode = [i for i in range(num_seqs) if starts[i + 1] - starts[i] == 1]
        others = tuple(i for i in range(num_seqs) if starts[i + 1] - starts[i] != 1)
        batch = None
        if decode and self._kernels is not None:
            index = torch.tensor(decode)
            whole = len(decode) == num_seqs
            batch = (
                common.block_table if whole else common.block_table[index].contiguous(),
                common.seq_lens if whole else common.seq_lens[index],
                torch.tensor([starts[i] for i in decode], dtype=torch.long),
            )
        else:
            others = tuple(range(num_seqs))
        return StepPlan(others, torch.tensor(others, dtype=torch.long), batch, slots, kept)

    def _kernels_take(self, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
        return self._kernels is not None and (cache_dtype == dtype or (dtype, cache_dtype) in MIXED_CACHE_DTYPES)

    def prefill_kernel_takes(self, layer: AttentionLayerSpec, dtype: torch.dtype) -> bool:
        """Whether prompt chunks go to the kernel (paged_prefill.cpp: ~2x SDPA's speed here,
        and no gathers) rather than to per-sequence SDPA; the decode stack's verify steps, too."""
        return (dtype in self._prefill_dtypes
                and layer.head_dim % 32 == 0 and layer.head_dim <= 256
                and layer.num_heads // layer.num_kv_heads <= 8)

    def _scratch(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._buffers.get(dtype, (torch.empty(0, dtype=dtype), torch.empty(0, dtype=dtype)))
        if keys.numel() < numel:
            keys, values = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
            self._buffers[dtype] = (keys, values)
        return keys, values

    def forward(
        self,
        layer: AttentionLayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        kernels = self._kernels_take(query.dtype, key_cache.dtype)
        if isinstance(metadata, CpuAttentionMetadata):
            if not metadata.plan_cell:
                metadata.plan_cell.append(self._plan(metadata))
            plan = metadata.plan_cell[0]
        else:  # called without the runner (a conformance kit that skips build_metadata)
            plan = self._plan(metadata)
        if plan.kept is not None:
            key, value = key[plan.kept], value[plan.kept]
        key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, plan.slots, key.to(key_cache.dtype))
        value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, plan.slots, value.to(value_cache.dtype))
        block_shape = key_cache.shape[1:]  # [block_size, num_kv_heads, head_dim]
        block_numel = key_cache[0].numel()
        output = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        block_size = metadata.block_size
        others = plan.others if kernels else range(metadata.num_reqs)
        if plan.decode is not None and kernels:
            block_table, seq_lens, rows = plan.decode
            self._kernels.paged_decode_attention(
                output, query.contiguous(), key_cache, value_cache, block_table, seq_lens, rows,
                layer.scale, layer.sliding_window or 0, 0.0)
        if plan.others and kernels and self.prefill_kernel_takes(layer, query.dtype):
            self._kernels.paged_prefill_attention(
                output, query.contiguous(), key_cache, value_cache, metadata.block_table, metadata.seq_lens,
                metadata.query_start_loc, plan.others_index, layer.scale, layer.sliding_window or 0)
            return output
        for i in others:
            seq_len = metadata.seq_lens_cpu[i]
            num_blocks = -(-seq_len // block_size)
            key_buf, value_buf = self._scratch(num_blocks * block_numel, key_cache.dtype)
            blocks = metadata.block_table[i, :num_blocks].long()
            k = torch.index_select(key_cache, 0, blocks, out=key_buf[: num_blocks * block_numel].view(
                num_blocks, *block_shape)).flatten(0, 1)[:seq_len]
            v = torch.index_select(value_cache, 0, blocks, out=value_buf[: num_blocks * block_numel].view(
                num_blocks, *block_shape)).flatten(0, 1)[:seq_len]
            q = query[starts[i]:starts[i + 1]]  # [q_len, heads, head_dim]
            q_len = q.shape[0]
            mask = None
            causal = False
            if layer.sliding_window is not None and seq_len > 1:
                q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
                k_pos = torch.arange(seq_len)[None, :]
                mask = (k_pos <= q_pos) & (q_pos - k_pos < layer.sliding_window)
            elif q_len == seq_len:
                causal = q_len > 1
            elif q_len > 1:  # a chunk on top of a cached prefix
                mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
            k, v = k.to(q.dtype), v.to(q.dtype)  # a narrower cache.kv_cache_dtype, widened
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=causal, scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads,
            )
            output[starts[i]:starts[i + 1]] = out.squeeze(0).transpose(0, 1)
        return output
