"""Linear layers whose storage and matmul belong to a LinearMethod (quantization)."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from tokenmill.core.layers.linear_shard import LinearShard
from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.quantization import LinearMethod, QuantizationMethod


class UnquantizedLinearMethod:
    """Plain ``[out, in]`` weights in the compute dtype."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_sizes: list[int], dtype: torch.dtype
    ) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype),
                              requires_grad=False)
        weight.weight_loader = shard_loader(output_sizes)  # type: ignore[attr-defined]
        weight.output_dim, weight.input_dim = 0, 1  # type: ignore[attr-defined]
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
    (q/k/v, gate/up), loaded shard by shard.

    With a ``shard`` (tensor parallelism), the layer holds and computes its rank's slice
    (linear_shard.py): ``input_size`` and ``output_sizes`` are then the rank's, and a
    row-parallel layer all-reduces its partial outputs. A quantization method takes part
    by saying how each parameter's checkpoint tensor maps onto outputs and inputs
    (``output_dim``/``input_dim`` and their packing units) and setting ``tensor_parallel``.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool,
        dtype: torch.dtype,
        quantization: Optional[QuantizationMethod] = None,
        prefix: str = "",
        shard: Optional[LinearShard] = None,
    ) -> None:
        super().__init__()
        #: this rank's slice under tensor parallelism; None holds the whole layer
        self.shard = shard if shard is not None and shard.parallel.tp_size > 1 else None
        if self.shard is not None:
            input_size, output_sizes = self.shard.input_size, list(self.shard.sizes)
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        #: the activations' dtype (the stored weight may be packed or quantized)
        self.dtype = dtype
        method = quantization.linear_method(prefix) if quantization is not None else None
        self.method: LinearMethod = method or UnquantizedLinearMethod()
        if self.shard is not None and method is not None and not getattr(method, "tensor_parallel", False):
            raise ConfigError("tensor_parallel_size", f"{prefix}: its quantization ({type(method).__name__}) "
                                                      "cannot be split over ranks")
        self.method.create_weights(self, input_size, self.output_sizes, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(sum(self.output_sizes), dtype=dtype), requires_grad=False)
            self.bias.weight_loader = shard_loader(self.output_sizes)  # type: ignore[attr-defined]
            self.bias.output_dim = 0  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        if self.shard is not None:
            for name, param in self.named_parameters(recurse=False):
                _load_rank_slice(param, self.shard, f"{prefix}.{name}")
        self.prefix = prefix
        #: adds a per-token delta to the output in place (adapters such as LoRA set it)
        self.output_delta: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduces = self.shard is not None and self.shard.reduces
        y = self.method.apply(self, x, None if reduces else self.bias)
        if self.output_delta is not None:
            self.output_delta(x, y)
        if reduces:
            y = self.shard.parallel.comm.all_reduce(y)
            if self.bias is not None:  # once, after the partial sums
                y = y + self.bias
        return y


def _load_rank_slice(param: nn.Parameter, shard: LinearShard, what: str) -> None:
    """Make ``param``'s loader take this rank's slice of each checkpoint tensor it is given."""
    inner = getattr(param, "weight_loader", None)

    def load(target: torch.Tensor, loaded: torch.Tensor, shard_id: Optional[int]) -> None:
        loaded = shard.narrow(loaded, shard_id, getattr(param, "output_dim", None), getattr(param, "input_dim", None),
                              getattr(param, "output_unit", 1), getattr(param, "input_unit", 1), what)
        if inner is not None:
            inner(target, loaded, shard_id)
        elif target.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(target.shape)}, checkpoint slice {tuple(loaded.shape)}")
        else:
            target.data.copy_(loaded)

    param.weight_loader = load  # type: ignore[attr-defined]
