"""``probe``: a worker extension that reports what each rank holds (see README.md)."""

from __future__ import annotations

import os
import time
from typing import Optional

import torch

from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.worker_extension import WorkerExtension


class WeightProbe(WorkerExtension):
    def rank_info(self) -> dict:
        c = self.context
        return {"rank": c.rank, "world_size": c.world_size, "tp_rank": c.tp_rank, "tp_size": c.tp_size,
                "pid": os.getpid(), "torch_threads": torch.get_num_threads()}

    def parameter_sum(self, name: str) -> float:
        """The sum of this rank's values of ``name``; a CPU layer that holds only oneDNN's
        packed copy of its weight (``packed_weight``) is summed from that."""
        model = self.context.model
        with torch.no_grad():
            tensor = dict(model.named_parameters()).get(name)
            if tensor is None:
                module, _, attribute = name.rpartition(".")
                packed = getattr(model.get_submodule(module), f"packed_{attribute}", None)
                if packed is None:
                    raise KeyError(name)
                tensor = packed.to_dense()
            return float(tensor.double().sum())

    def fail_on_rank(self, rank: int, message: str) -> int:
        if self.context.rank == rank:
            raise RuntimeError(message)
        return self.context.rank

    def first_parameter(self) -> torch.Tensor:
        return next(self.context.model.parameters())

    def sleep_for(self, seconds: float, rank: Optional[int] = None) -> int:
        if rank is None or rank == self.context.rank:
            time.sleep(seconds)
        return self.context.rank


@hookimpl
def register_worker_extensions(register):
    register("probe", "tokenmill_worker_probe:WeightProbe")
