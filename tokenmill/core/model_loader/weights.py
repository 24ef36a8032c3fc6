"""Streaming checkpoint tensors into a model's (possibly fused) parameters, strictly.

A checkpoint loads only when every tensor is taken by a parameter (or is a
deliberate skip) and every parameter is filled: a dropped tensor or a
parameter left as ``torch.empty`` would give a model that runs and is wrong.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from tokenmill.interfaces.errors import ConfigError

#: (fused parameter fragment, checkpoint fragment, shard index)
StackedMapping = Sequence[tuple[str, str, int]]

#: a load error lists this many names, then how many more there are
LISTED_NAMES = 10


def name_list(names: Sequence[str]) -> str:
    """The first LISTED_NAMES names, then "and N more": a renamed layer can be thousands."""
    listed = ", ".join(names[:LISTED_NAMES])
    return listed + (f" and {len(names) - LISTED_NAMES} more" if len(names) > LISTED_NAMES else "")


class UnexpectedWeights(ConfigError):
    """Checkpoint tensors no parameter took, raised once the whole checkpoint has been read.

    ``loaded`` holds every parameter filled by then, so that the caller can name
    the missing parameters in the same error: a checkpoint whose tensor is
    misnamed has one of each.
    """

    def __init__(self, names: list[str], loaded: set[str]) -> None:
        super().__init__("model", f"checkpoint tensors with no matching parameter: {name_list(names)}")
        self.names, self.loaded = names, loaded


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedMapping = (),
    skip: Sequence[str] = (),
    loaded: Optional[set[str]] = None,
) -> set[str]:
    """Copy each checkpoint tensor into its parameter; returns the names of the parameters filled.

    Fused layers load shard by shard, and a fused parameter counts as filled
    once all of its shards (or one tensor for the whole of it) have arrived.
    Tensors whose name contains a ``skip`` fragment are ignored on purpose
    (rotary caches, a tied head's copy). ``loaded`` holds parameters the caller
    fills itself from tensors it takes out of ``weights`` before they get here
    (MoE experts); they are part of the result.

    A tensor that does not fit its parameter fails at once, naming it; tensors
    with no parameter are collected and raised together as UnexpectedWeights
    after the last tensor.
    """
    params = dict(model.named_parameters())
    loaded = set() if loaded is None else loaded
    shards: dict[str, set[int]] = {}
    unexpected: list[str] = []
    for name, tensor in weights:
        if any(fragment in name for fragment in skip):
            continue
        target, shard, fused = name, None, None
        for fused_part, part, index in stacked:
            if f".{part}." in name:
                target, shard, fused = name.replace(f".{part}.", f".{fused_part}."), index, fused_part
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        copy_tensor(name, param, tensor, shard)
        if shard is None:
            loaded.add(target)
            continue
        shards.setdefault(target, set()).add(shard)
        if shards[target] == {index for fused_part, _, index in stacked if fused_part == fused}:
            loaded.add(target)
    if unexpected:
        raise UnexpectedWeights(unexpected, loaded)
    return loaded


def load_strictly(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """``model.load_weights`` over a whole checkpoint; fails naming both the tensors no
    parameter took and the parameters no tensor filled."""
    try:
        loaded, unexpected = model.load_weights(weights), []
    except UnexpectedWeights as error:
        loaded, unexpected = error.loaded, sorted(error.names)
    missing = sorted(set(name for name, _ in model.named_parameters()) - loaded)
    problems = []
    if unexpected:
        problems.append(f"tensors with no matching parameter: {name_list(unexpected)}")
    if missing:
        problems.append(f"no weights for parameters: {name_list(missing)}")
    if problems:
        raise ConfigError("model", f"checkpoint {source} does not match the model; " + "; ".join(problems))


def copy_tensor(name: str, param: torch.Tensor, tensor: torch.Tensor, shard: Optional[int] = None) -> None:
    """Copy checkpoint tensor ``name`` into ``param`` (through its ``weight_loader`` if it has
    one, with ``shard``); a tensor of another shape or kind of dtype fails naming it."""
    if _kind(tensor.dtype) != _kind(param.dtype):
        raise ConfigError("model", f"checkpoint tensor {name!r} is {tensor.dtype}, its parameter {param.dtype}")
    tensor = tensor.to(param.dtype)
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        if param.shape != tensor.shape:
            raise ConfigError("model", f"checkpoint tensor {name!r}: parameter {tuple(param.shape)}, "
                                       f"checkpoint {tuple(tensor.shape)}")
        param.data.copy_(tensor)
        return
    try:
        loader(param, tensor, shard)
    except (ValueError, RuntimeError) as error:  # the loaders' shape checks, or a copy that cannot broadcast
        raise ConfigError("model", f"checkpoint tensor {name!r}: {error}") from error


def _kind(dtype: torch.dtype) -> str:
    """Floats load in any float compute dtype (the ``dtype`` option); packed integers and
    FP8 codes keep theirs: a cast would change what their values mean."""
    if dtype.is_floating_point:
        return "fp8" if dtype.itemsize == 1 else "float"
    return "integer"
