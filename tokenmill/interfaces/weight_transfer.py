"""The weight-transfer contract: a trainer's new weights into a running engine, vLLM 0.32's
cycle (``init_weight_transfer_engine``, then per update ``start_weight_update``,
``update_weights`` as often as it likes, ``finish_weight_update``).

A backend moves the tensors; the engine places them. Every rank of the model builds the
configured backend (``register_weight_transfer_backends``; ``weight_transfer_config:
{backend: name}``) as ``cls(context)``. ``init_transfer(init_info)`` runs once on every rank
at the same time (a backend that joins a process group with the trainer does it there);
``receive_weights(update_info)`` yields the update's ``(name, tensor)`` pairs on every rank:
the full tensors under the checkpoint's (Hugging Face) names, which each rank's loader cuts
to its own shard. Tensors never cross the engine's control channel: a backend brings them
over torch.distributed or in-process.

``update_info`` is the backend's (vLLM's names where it has them): ``names``,
``dtype_names`` and ``shapes`` describe the update, in the order the tensors come; the
engine checks them against the model before any rank receives anything, so a wrong name,
shape or dtype is refused with the old weights intact.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator


@dataclass
class WeightTransferInitRequest:
    """vLLM's ``WeightTransferInitRequest``: the backend's init info."""

    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """vLLM's ``WeightTransferUpdateRequest``: the backend's update info."""

    update_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightTransferContext:
    """What a backend on one rank is built with."""

    #: this rank of the model, and the model's ranks
    rank: int
    world_size: int
    #: the engine's own collectives across its ranks (Communicator), None with one rank
    comm: Any
    #: the device this rank's weights live on ("cpu", "cuda")
    device: str


class WeightTransferBackend(ABC):
    def __init__(self, context: WeightTransferContext) -> None:
        self.context = context

    @abstractmethod
    def init_transfer(self, init_info: dict[str, Any]) -> None:
        """Get ready to receive (join the trainer's group...); runs on every rank at once."""

    @abstractmethod
    def receive_weights(self, update_info: dict[str, Any]) -> Iterator[tuple[str, Any]]:
        """The update's (name, full tensor) pairs, in ``update_info``'s order; every rank
        receives every tensor."""

    def shutdown(self) -> None:
        """Leave the trainer's group, if any."""
