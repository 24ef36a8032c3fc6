"""Integer weights quantized in groups along the input dimension: the common core of GPTQ and AWQ.

After loading, both formats become one canonical form: ``q [K, N]`` integers,
``zeros``/``scales [G, N]`` and ``g_idx [K]`` (the group of each input
channel; act-order checkpoints permute it), so ``W[n, k] = (q[k, n] -
zeros[g_idx[k], n]) * scales[g_idx[k], n]``. From there one kernel is chosen:

- CPU, 4-bit, uniform groups: repacked once into PyTorch's CPU int4 format
  (``_weight_int4pack_mm_for_cpu``); act-order becomes a permutation of the
  input channels, applied to activations.
- otherwise (8-bit, irregular groups): int8 storage, dequantized per call.
- CUDA (when the layer's tensors live on a GPU, as under the cuda platform, which
  loads weights straight to the device): ``TritonGroupQuantizedLinear``, the Triton
  dequant-GEMM in ``triton_gemm`` over GPTQ-packed weights. It takes the packed words
  rather than the canonical form: a GPTQ checkpoint's ``qweight`` as it is, an AWQ one
  repacked word by word (``packing.awq_to_gptq``), so loading never holds a layer's
  unpacked integers on the device. Tested on CPU by the kernel test under
  TRITON_INTERPRET=1, and compiled for sm_80/sm_90.

Weights stay quantized in memory in every case.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class GroupQuantizedLinear:
    """Kernel state for one layer off a GPU, built once from the canonical form."""

    def __init__(self, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 bits: int, dtype: torch.dtype, layer: nn.Module, prefix: str = "") -> None:
        self.in_features, self.out_features = q.shape
        self.prefix = prefix  # buffer-name prefix, so one layer can hold several kernels
        self.bits = bits
        self.dtype = dtype
        scales = scales.to(dtype)
        counts = torch.bincount(g_idx)
        group_size = int(counts[0]) if len(counts) else 0
        uniform = bool((counts == group_size).all()) and group_size > 0
        self.perm: Optional[torch.Tensor] = None
        self.kind = "dequant"
        if bits == 4 and uniform and self.in_features % group_size == 0:
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(order, torch.arange(self.in_features)):
                self.perm = order
            try:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[order].T.contiguous().to(torch.int32), 2)
                self.group_size = group_size
                layer.register_buffer(prefix + "int4_weight", packed, persistent=False)
                layer.register_buffer(prefix + "int4_scales_zeros",
                                      torch.stack([scales, (2 ** (bits - 1) - zeros.to(dtype)) * scales], -1),
                                      persistent=False)
                self.kind = "int4pack"
            except RuntimeError:
                self.perm = None  # the shape does not suit the CPU kernel: dequantize instead
        if self.kind == "dequant":
            layer.register_buffer(prefix + "q_weight", q.to(torch.uint8), persistent=False)  # [K, N]
            layer.register_buffer(prefix + "q_zeros", zeros.to(torch.uint8), persistent=False)
            layer.register_buffer(prefix + "q_scales", scales, persistent=False)
            layer.register_buffer(prefix + "q_g_idx", g_idx.to(torch.long), persistent=False)
        if self.perm is not None:
            layer.register_buffer(prefix + "input_perm", self.perm, persistent=False)

    def _get(self, layer: nn.Module, name: str) -> torch.Tensor:
        return getattr(layer, self.prefix + name)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The full-precision ``[N, K]`` weight (reference path and tests)."""
        g = self._get(layer, "q_g_idx")
        w = (self._get(layer, "q_weight").to(self.dtype) - self._get(layer, "q_zeros")[g].to(self.dtype)) * self._get(layer, "q_scales")[g]
        return w.T

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if self.kind == "int4pack":
            if self.perm is not None:
                x = x.index_select(1, self._get(layer, "input_perm"))
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(self.dtype), self._get(layer, "int4_weight"), self.group_size, self._get(layer, "int4_scales_zeros"))
        else:
            out = nn.functional.linear(x.to(self.dtype), self.dequantize(layer))
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], self.out_features)


class TritonGroupQuantizedLinear:
    """Kernel state for one layer on a GPU: GPTQ-packed ``qweight [K / (32 / bits), N]`` (a
    column slice of a fused layer's words is one too), unpacked ``zeros``, ``scales``, ``g_idx``."""

    kind = "triton"

    def __init__(self, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                 bits: int, dtype: torch.dtype, layer: nn.Module, prefix: str = "") -> None:
        self.in_features, self.out_features = qweight.shape[0] * (32 // bits), qweight.shape[1]
        self.prefix, self.bits, self.dtype = prefix, bits, dtype
        layer.register_buffer(prefix + "t_qweight", qweight, persistent=False)
        layer.register_buffer(prefix + "t_zeros", zeros.to(torch.int32), persistent=False)
        layer.register_buffer(prefix + "t_scales", scales.to(dtype), persistent=False)
        layer.register_buffer(prefix + "t_g_idx", g_idx.to(torch.int32), persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        from tokenmill.plugins.quantization.triton_gemm import dequant_gemm

        shape = x.shape
        tensors = (getattr(layer, f"{self.prefix}t_{name}") for name in ("qweight", "zeros", "scales", "g_idx"))
        out = dequant_gemm(x.reshape(-1, self.in_features).to(self.dtype), *tensors, self.bits)
        if bias is not None:
            out = out + bias
        return out.reshape(*shape[:-1], self.out_features)


class ShardedGroupQuantizedLinear:
    """A fused layer whose parts were quantized with different act orders: one kernel per part."""

    def __init__(self, parts: list[GroupQuantizedLinear] | list[TritonGroupQuantizedLinear]) -> None:
        self.parts = parts

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = torch.cat([part.apply(layer, x, None) for part in self.parts], dim=-1)
        return out if bias is None else out + bias


def output_shard_loader(offsets: list[int], sizes: list[int], dim: int):
    """A weight_loader that copies shard ``i`` of a fused layer into ``[offsets[i], +sizes[i])``
    along ``dim`` (the output dimension of that tensor's layout)."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Optional[int]) -> None:
        target = param.data if shard_id is None else param.data.narrow(dim, offsets[shard_id], sizes[shard_id])
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(target.shape)}, checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)

    return load


def per_shard_loader(num_shards: int):
    """For tensors every shard has its own copy of (GPTQ's g_idx): stacked along dim 0."""

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Optional[int]) -> None:
        rows = range(num_shards) if shard_id is None else [shard_id]
        for row in rows:
            param.data[row].copy_(loaded.reshape(param.shape[1:]))

    return load


def ignored(prefix: str, patterns: Optional[list[str]]) -> bool:
    """Whether a (possibly fused) layer is excluded from quantization.

    Checkpoint lists name unfused modules (``q_proj``); a fused layer is
    excluded when every one of its parts is, and a partly excluded fused layer
    is an error (it cannot be half quantized).
    """
    if not patterns:
        return False
    parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    head, _, leaf = prefix.rpartition(".")
    names = [f"{head}.{p}" for p in parts.get(leaf, [leaf])]

    def match(name: str) -> bool:
        return any(name == p or name.endswith("." + p) or p in name.split(".") for p in patterns)

    hits = [match(name) for name in names]
    if any(hits) and not all(hits):
        raise ValueError(f"{prefix}: only some of its fused parts are excluded from quantization")
    return all(hits)
