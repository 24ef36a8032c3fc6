"""Pipeline stages: a model keeps the decoder layers of its stage and stands in the others.

Layer indices (and so checkpoint names) stay those of the whole model; the stand-ins have
no parameters, and ``stage_skips`` names the checkpoint tensors this stage does not load.
"""

from __future__ import annotations

from torch import nn

from tokenmill.interfaces.parallel import ParallelContext


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this layer belongs to another pipeline stage")


def stage_skips(parallel: ParallelContext, num_layers: int, layer_prefix: str) -> list[str]:
    """Checkpoint name fragments of the decoder layers outside this stage."""
    held = parallel.layer_range(num_layers)
    return [f"{layer_prefix}{i}." for i in range(num_layers) if i not in held]
