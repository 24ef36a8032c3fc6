"""Streaming checkpoint tensors into a model's (possibly fused) parameters."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

#: (fused parameter fragment, checkpoint fragment, shard index)
StackedMapping = Sequence[tuple[str, str, int]]


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedMapping = (),
    skip: Sequence[str] = (),
) -> set[str]:
    """Copy each checkpoint tensor into its parameter; fused layers load shard by shard.

    Tensors whose name contains a ``skip`` fragment are ignored (e.g. rotary
    caches some checkpoints carry). An unexpected name is an error: silently
    dropping weights would produce a wrong model.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(fragment in name for fragment in skip):
            continue
        target, shard = name, None
        for fused, part, index in stacked:
            if f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{fused}."), index
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
        loader = getattr(param, "weight_loader", None)
        tensor = tensor.to(param.dtype)
        if loader is not None:
            loader(param, tensor, shard)
        else:
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: parameter {tuple(param.shape)}, checkpoint {tuple(tensor.shape)}")
            param.data.copy_(tensor)
        loaded.add(target)
    return loaded
