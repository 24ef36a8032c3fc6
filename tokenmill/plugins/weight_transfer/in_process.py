"""``in_process``: the trainer holds the ``LLM`` and hands it tensors.

``update_info={"weights": {name: tensor, ...}}`` (or a list of ``(name, tensor)`` pairs):
the driver (rank 0) has them in its own memory; it broadcasts each over the engine's own
group to the other ranks, which learn the names, dtypes and shapes from the control
message. No copy is made on a one-rank engine.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from tokenmill.interfaces.weight_transfer import WeightTransferBackend


class InProcessWeightTransfer(WeightTransferBackend):
    def init_transfer(self, init_info: dict[str, Any]) -> None:
        pass

    def receive_weights(self, update_info: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        comm = self.context.comm
        if self.context.rank == 0:
            for name, tensor in update_info["weights"]:
                tensor = tensor.detach().to(self.context.device).contiguous()
                if comm is not None:
                    comm.broadcast(tensor, 0)
                yield name, tensor
            return
        for name, dtype, shape in zip(update_info["names"], update_info["dtype_names"], update_info["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.context.device)
            comm.broadcast(tensor, 0)
            yield name, tensor
