"""``gloo`` (CPU) and ``nccl`` (CUDA): a separate trainer process broadcasts each tensor to
every rank of the engine over a torch.distributed group of its own, vLLM's layout.

The trainer is rank 0 of the group; the engine's rank ``r`` is ``rank_offset + r``
(``init_info``: ``master_address``, ``master_port``, ``rank_offset``, ``world_size``, as
vLLM's). The trainer's side (``trainer_init``, ``trainer_send_weights``) hosts the group's
TCP store. The store itself has no authentication, as the engine's own rendezvous store:
give both sides the same ``authkey`` (hex) in their init info and the group's keys live
under a prefix derived from it, which a peer without the key cannot find; and keep
``master_address`` on a private network. The groups are built without
``init_process_group``, so a trainer that uses torch.distributed for itself keeps its own
default group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import structlog
import torch
import torch.distributed as dist

from tokenmill.core.distributed.communicator import new_group
from tokenmill.interfaces.errors import WorkerFailed
from tokenmill.interfaces.weight_transfer import WeightTransferBackend

log = structlog.get_logger("tokenmill.weight_transfer")

#: how long joining the group and each broadcast may take
TIMEOUT_S = 300.0


def _prefix(init_info: dict[str, Any]) -> str:
    key = init_info.get("authkey")
    if key is None:
        return "tokenmill-weight-transfer"
    return "tokenmill-weight-transfer-" + hashlib.sha256(bytes.fromhex(key)).hexdigest()[:32]


class TrainerGroup:
    """The trainer's end of the group (what ``trainer_init`` returns)."""

    def __init__(self, group: dist.ProcessGroup, store: dist.Store, backend: str) -> None:
        self.group, self._store, self.backend = group, store, backend

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.group.broadcast(tensor, src).wait()


def _join(init_info: dict[str, Any], rank: int, backend: str) -> tuple[dist.ProcessGroup, dist.Store]:
    store = dist.TCPStore(init_info["master_address"], int(init_info["master_port"]), int(init_info["world_size"]),
                          is_master=rank == 0, timeout=timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    group = new_group(store, _prefix(init_info), rank, int(init_info["world_size"]), backend,
                      timedelta(seconds=TIMEOUT_S))
    return group, store


class _TorchDistributedWeightTransfer(WeightTransferBackend):
    backend = "gloo"

    def __init__(self, context) -> None:
        super().__init__(context)
        self._group: Optional[dist.ProcessGroup] = None
        self._store: Optional[dist.Store] = None

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        missing = [key for key in ("master_address", "master_port", "world_size") if key not in init_info]
        if missing:
            raise ValueError(f"init_info needs {', '.join(missing)}")
        rank = int(init_info.get("rank_offset", 1)) + self.context.rank
        if not 0 < rank < int(init_info["world_size"]):
            raise ValueError(f"rank_offset {init_info.get('rank_offset', 1)} puts rank {self.context.rank} at "
                             f"{rank}, outside the group of {init_info['world_size']} (the trainer is rank 0)")
        if init_info.get("authkey") is None:
            log.warning("weight transfer group without an authkey: anyone who reaches master_address can join it",
                        master_address=init_info["master_address"])
        self.shutdown()
        self._group, self._store = _join(init_info, rank, self.backend)

    def receive_weights(self, update_info: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        if self._group is None:
            raise RuntimeError("call init_weight_transfer_engine first")
        device = self.context.device if self.backend == "nccl" else "cpu"
        for name, dtype, shape in zip(update_info["names"], update_info["dtype_names"], update_info["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            try:
                self._group.broadcast(tensor, 0).wait()
            except RuntimeError as exc:
                raise WorkerFailed(f"receiving {name} from the trainer failed: {exc}") from exc
            yield name, tensor

    def shutdown(self) -> None:
        self._group = self._store = None

    # --- the trainer's side (vLLM's static methods) ---------------------------
    @classmethod
    def trainer_init(cls, init_info: Any) -> TrainerGroup:
        """Host the group's store and join it as rank 0; returns once every engine rank
        has joined (call it while the engine runs ``init_weight_transfer_engine``)."""
        info = init_info if isinstance(init_info, dict) else vars(init_info)
        group, store = _join(info, 0, cls.backend)
        return TrainerGroup(group, store, cls.backend)

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """Broadcast each ``(name, tensor)`` of ``iterator`` to the engine's ranks, in order
        (the engine's ``update_weights`` names them in the same order)."""
        args = trainer_args if isinstance(trainer_args, TrainerSendWeightsArgs) else \
            TrainerSendWeightsArgs(**trainer_args)
        post = args.post_iter_func or (lambda item: item[1])
        for item in iterator:
            tensor = post(item).detach()
            if args.group.backend == "gloo" and tensor.device.type != "cpu":
                tensor = tensor.cpu()
            args.group.broadcast(tensor.contiguous(), args.src)


class GlooWeightTransfer(_TorchDistributedWeightTransfer):
    backend = "gloo"


class NcclWeightTransfer(_TorchDistributedWeightTransfer):
    """Written as the gloo one, over NCCL; not yet run (it needs two GPUs)."""

    backend = "nccl"


@dataclass
class TrainerSendWeightsArgs:
    """vLLM's ``GLOOTrainerSendWeightsArgs`` / ``NCCLTrainerSendWeightsArgs``."""

    group: TrainerGroup
    src: int = 0
    post_iter_func: Optional[Callable[[tuple[str, torch.Tensor]], torch.Tensor]] = None
