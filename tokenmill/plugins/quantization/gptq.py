"""GPTQ checkpoints (AutoGPTQ / GPTQModel): 4- and 8-bit, sym/asym, act-order, v1 and v2 zeros.

Tensors per linear layer: ``qweight`` int32 ``[K / (32 / bits), N]`` (packed
along the input dim), ``qzeros`` int32 ``[G, N / (32 / bits)]`` (packed along
the output dim; the v1 format stores zero - 1), ``scales`` ``[G, N]`` and
``g_idx`` int32 ``[K]``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.plugins.quantization.group_quant import (
    GroupQuantizedLinear,
    ShardedGroupQuantizedLinear,
    TritonGroupQuantizedLinear,
    ignored,
    output_shard_loader,
    per_shard_loader,
)
from tokenmill.plugins.quantization.packing import unpack


class GPTQLinearMethod:
    #: splits over tensor-parallel ranks: outputs by columns; inputs by whole packs and
    #: groups, except that an act-order layer keeps every group's scales and zeros (its
    #: input channels do not come in group order)
    tensor_parallel = True

    def __init__(self, bits: int, group_size: int, zero_offset: int, act_order: bool) -> None:
        self.bits, self.group_size, self.zero_offset = bits, group_size, zero_offset
        self.act_order = act_order
        self.pack = 32 // bits

    def _groups_split(self, layer: nn.Module) -> bool:
        shard = getattr(layer, "shard", None)
        return shard is not None and shard.kind == "row" and self.group_size != -1 and not self.act_order

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        n = sum(output_sizes)
        shard = getattr(layer, "shard", None)
        rows = input_size if shard is None or self._groups_split(layer) else shard.full_input
        groups = 1 if self.group_size == -1 else rows // self.group_size
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        if input_size % self.pack or any(size % self.pack for size in output_sizes):
            raise ConfigError("quantization_config.bits", f"layer sizes {input_size}x{output_sizes} are not "
                                                          f"multiples of the packing factor {self.pack}")
        tensors = {
            "qweight": (torch.zeros(input_size // self.pack, n, dtype=torch.int32),
                        output_shard_loader(offsets, output_sizes, 1)),
            "qzeros": (torch.zeros(groups, n // self.pack, dtype=torch.int32),
                       output_shard_loader([o // self.pack for o in offsets],
                                           [s // self.pack for s in output_sizes], 1)),
            "scales": (torch.zeros(groups, n, dtype=torch.float16), output_shard_loader(offsets, output_sizes, 1)),
            # act-order: every part of a fused layer carries its own g_idx
            "g_idx": (torch.zeros(len(output_sizes), input_size, dtype=torch.int32),
                      per_shard_loader(len(output_sizes))),
        }
        group_dim = 0 if self._groups_split(layer) else None
        # how each checkpoint tensor maps onto (outputs, inputs), and the units packing makes
        dims = {"qweight": (1, 1, 0, self.pack), "qzeros": (1, self.pack, group_dim, self.group_size),
                "scales": (1, 1, group_dim, self.group_size), "g_idx": (None, 1, 0, 1)}
        for name, (tensor, loader) in tensors.items():
            param = nn.Parameter(tensor, requires_grad=False)
            param.weight_loader = loader  # type: ignore[attr-defined]
            param.output_dim, param.output_unit, param.input_dim, param.input_unit = dims[name]  # type: ignore
            layer.register_parameter(name, param)
        layer.quant_dtype = dtype
        layer.quant_output_sizes = output_sizes

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight = layer.qweight.data  # [K / pack, N]: the Triton GEMM's layout as it is
        zeros = unpack(layer.qzeros.data, self.bits, dim=1) + self.zero_offset  # [G, N]
        g_idx = layer.g_idx.data.long()
        if self._groups_split(layer):  # the checkpoint numbers the groups of the whole layer
            g_idx = g_idx - layer.shard.input_start // self.group_size
        scales = layer.scales.data.float()
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            delattr(layer, name)
        if qweight.device.type == "cuda":
            kernel, weights = TritonGroupQuantizedLinear, qweight
        else:
            kernel, weights = GroupQuantizedLinear, unpack(qweight, self.bits, dim=0)  # [K, N]
        if all(torch.equal(g_idx[0], row) for row in g_idx):
            layer.kernel = kernel(weights, zeros, scales, g_idx[0], self.bits, layer.quant_dtype, layer)
            return
        # parts quantized with different act orders (each module has its own g_idx)
        parts, start = [], 0
        for i, size in enumerate(layer.quant_output_sizes):
            cols = slice(start, start + size)
            parts.append(kernel(weights[:, cols], zeros[:, cols], scales[:, cols], g_idx[i], self.bits,
                                layer.quant_dtype, layer, prefix=f"part{i}_"))
            start += size
        layer.kernel = ShardedGroupQuantizedLinear(parts)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return layer.kernel.apply(layer, x, bias)


class GPTQMethod:
    name = "gptq"

    def __init__(self, config: dict[str, Any], options: Any = None) -> None:
        bits = config.get("bits")
        if bits not in (4, 8):
            raise ConfigError("quantization_config.bits", f"GPTQ with {bits} bits is not supported (4 or 8)")
        fmt = config.get("checkpoint_format") or config.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError("quantization_config.checkpoint_format", f"unknown GPTQ format {fmt!r} "
                                                                       "(gptq or gptq_v2)")
        if config.get("lm_head"):
            raise ConfigError("quantization_config.lm_head", "a quantized lm_head is not supported")
        group_size = int(config.get("group_size", 128))
        self.modules_to_not_convert = config.get("modules_to_not_convert")
        # v1 stores zero - 1 (an old AutoGPTQ quirk); v2 stores the zero itself
        self.method = GPTQLinearMethod(bits, group_size, 1 if fmt == "gptq" else 0, bool(config.get("desc_act")))

    def linear_method(self, prefix: str) -> Optional[GPTQLinearMethod]:
        return None if ignored(prefix, self.modules_to_not_convert) else self.method


@hookimpl
def register_quantization_methods(register):
    register("gptq", GPTQMethod)
