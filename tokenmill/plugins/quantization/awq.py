"""AWQ checkpoints in AutoAWQ's GEMM format (4-bit, zero points, nibble order 0,2,4,6,1,3,5,7).

Tensors per linear layer: ``qweight`` int32 ``[K, N / 8]`` and ``qzeros``
int32 ``[G, N / 8]``, both packed along the output dim, and ``scales [G, N]``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.plugins.quantization.group_quant import (
    GroupQuantizedLinear,
    TritonGroupQuantizedLinear,
    ignored,
    output_shard_loader,
)
from tokenmill.plugins.quantization.packing import awq_to_gptq, unpack_awq


class AWQLinearMethod:
    #: splits over tensor-parallel ranks: outputs by packs of 8 columns, inputs by groups
    tensor_parallel = True

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype) -> None:
        n, groups = sum(output_sizes), input_size // self.group_size
        if input_size % 8 or any(size % 8 for size in output_sizes):  # 8 nibbles a word, either way on a GPU
            raise ConfigError("quantization_config", f"layer sizes {input_size}x{output_sizes} are not multiples "
                                                     "of AWQ's packing factor 8")
        offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        packed = output_shard_loader([o // 8 for o in offsets], [s // 8 for s in output_sizes], 1)
        tensors = {
            "qweight": (torch.zeros(input_size, n // 8, dtype=torch.int32), packed),
            "qzeros": (torch.zeros(groups, n // 8, dtype=torch.int32), packed),
            "scales": (torch.zeros(groups, n, dtype=torch.float16), output_shard_loader(offsets, output_sizes, 1)),
        }
        # how each checkpoint tensor maps onto (outputs, inputs), and the units packing makes
        dims = {"qweight": (1, 8, 0, 1), "qzeros": (1, 8, 0, self.group_size), "scales": (1, 1, 0, self.group_size)}
        for name, (tensor, loader) in tensors.items():
            param = nn.Parameter(tensor, requires_grad=False)
            param.weight_loader = loader  # type: ignore[attr-defined]
            param.output_dim, param.output_unit, param.input_dim, param.input_unit = dims[name]  # type: ignore
            layer.register_parameter(name, param)
        layer.quant_dtype = dtype

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight = layer.qweight.data
        zeros = unpack_awq(layer.qzeros.data)  # [G, N]
        scales = layer.scales.data.float()
        g_idx = torch.arange(qweight.shape[0], device=qweight.device) // self.group_size
        for name in ("qweight", "qzeros", "scales"):
            delattr(layer, name)
        if qweight.device.type == "cuda":
            layer.kernel = TritonGroupQuantizedLinear(awq_to_gptq(qweight), zeros, scales, g_idx, 4,
                                                      layer.quant_dtype, layer)
        else:
            layer.kernel = GroupQuantizedLinear(unpack_awq(qweight), zeros, scales, g_idx, 4, layer.quant_dtype, layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return layer.kernel.apply(layer, x, bias)


class AWQMethod:
    name = "awq"

    def __init__(self, config: dict[str, Any], options: Any = None) -> None:
        if config.get("bits", config.get("w_bit", 4)) != 4:
            raise ConfigError("quantization_config.bits", "AWQ is supported with 4 bits only")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConfigError("quantization_config.version", f"AWQ version {version!r} is not supported (gemm)")
        if not config.get("zero_point", True):
            raise ConfigError("quantization_config.zero_point", "AWQ without zero points is not supported")
        self.modules_to_not_convert = config.get("modules_to_not_convert")
        self.method = AWQLinearMethod(int(config.get("group_size", config.get("q_group_size", 128))))

    def linear_method(self, prefix: str) -> Optional[AWQLinearMethod]:
        return None if ignored(prefix, self.modules_to_not_convert) else self.method


@hookimpl
def register_quantization_methods(register):
    register("awq", AWQMethod)
