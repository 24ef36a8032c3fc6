"""Weight-transfer backends: ``in_process`` (a trainer that holds the ``LLM``) and ``gloo`` /
``nccl`` (a trainer process that joins a torch.distributed group with the engine's ranks)."""

from __future__ import annotations

from tokenmill.interfaces.hookspecs import hookimpl


@hookimpl
def register_weight_transfer_backends(register):
    register("in_process", "tokenmill.plugins.weight_transfer.in_process:InProcessWeightTransfer")
    register("gloo", "tokenmill.plugins.weight_transfer.torch_distributed:GlooWeightTransfer")
    register("nccl", "tokenmill.plugins.weight_transfer.torch_distributed:NcclWeightTransfer")
