"""Linear layers whose storage and matmul belong to a LinearMethod (quantization)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from tokenmill.interfaces.quantization import LinearMethod, QuantizationMethod


class UnquantizedLinearMethod:
    """Plain ``[out, in]`` weights in the compute dtype."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype),
                              requires_grad=False)
        weight.weight_loader = shard_loader(output_sizes)  # type: ignore[attr-defined]
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return nn.functional.linear(x, layer.weight, bias)


def shard_loader(output_sizes: list[int]):
    """A weight_loader that copies shard ``i`` of a fused layer into its rows."""
    offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Optional[int]) -> None:
        if shard_id is None:
            target = param.data
        else:
            target = param.data.narrow(0, offsets[shard_id], output_sizes[shard_id])
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(target.shape)}, "
                             f"checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)

    return load


class Linear(nn.Module):
    """``y = x W^T + b`` where W may be several checkpoint tensors fused along outputs
    (q/k/v, gate/up), loaded shard by shard."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        quantization: Optional[QuantizationMethod] = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        #: the activations' dtype (the stored weight may be packed or quantized)
        self.dtype = dtype
        method = quantization.linear_method(prefix) if quantization is not None else None
        self.method: LinearMethod = method or UnquantizedLinearMethod()
        self.method.create_weights(self, input_size, self.output_sizes, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype), requires_grad=False)
            self.bias.weight_loader = shard_loader(self.output_sizes)  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.prefix = prefix
        #: adds a per-token delta to the output in place (adapters such as LoRA set it)
        self.output_delta: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias)
        if self.output_delta is not None:
            self.output_delta(x, y)
        return y
