"""The QuantizationMethod contract: how a linear layer stores and applies its weights."""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class LinearMethod(Protocol):
    """Creates a linear layer's parameters and computes ``x @ W.T (+ bias)``.

    ``create_weights`` registers on ``layer`` exactly the tensors a checkpoint
    holds (names, shapes, dtypes), each with a ``weight_loader`` attribute
    ``(param, loaded_tensor, shard_id)`` for fused layers; ``shard_id`` is an
    index into ``output_sizes``. ``process_weights_after_loading`` runs once,
    after all weights are loaded (repacking, transposes).
    """

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size: int,
        output_sizes: list[int],
        dtype: torch.dtype,
    ) -> None: ...

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None: ...

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]
    ) -> torch.Tensor: ...


@runtime_checkable
class QuantizationMethod(Protocol):
    """Built from a checkpoint's ``quantization_config``; picks a LinearMethod per layer."""

    name: str

    def linear_method(self, prefix: str) -> Optional[LinearMethod]:
        """The method for the layer at ``prefix`` (e.g. ``model.layers.0.mlp.down_proj``);
        None leaves that layer unquantized."""
