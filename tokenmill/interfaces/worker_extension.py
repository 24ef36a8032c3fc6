"""The WorkerExtension contract: methods every rank of a model runs on request
(``LLM.collective_rpc``), as vLLM's ``worker_extension_cls`` adds them to its workers.

An extension is a class registered by name through the ``register_worker_extensions`` hook
(an installed package's entry point: every rank builds its plugins from entry points), and
built once per rank as ``cls(context)``. ``collective_rpc("method", args=..., kwargs=...)``
calls that public method on every rank's instance and returns the results in rank order;
``"name.method"`` picks one extension's where several define ``method``. Arguments and
results cross processes as JSON (msgspec): numbers, strings, lists, dicts; convert tensors
with ``.tolist()``. Nothing is ever unpickled.

A method that raises fails that call on the caller's side, naming the rank; the engine
serves on. A call must leave the model as a step expects it (shapes, devices, dtypes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerContext:
    """What an extension on one rank can reach."""

    #: this rank (0 is the driver, in the engine's process), and how many there are
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    #: this rank's part of the model (its tensor-parallel shard, its pipeline stage). A
    #: platform may keep a layer's weight only in its kernel's layout (the cpu platform's
    #: oneDNN-packed ``packed_weight``) unless the engine keeps plain weights (weight
    #: transfer, sleep mode)
    model: Any
    #: the torch.device its tensors live on
    device: Any
    #: the engine's configuration (EngineConfig)
    config: Any


class WorkerExtension:
    """Base class of extensions (subclassing it is optional: any class taking a
    WorkerContext works). Public methods (no leading underscore) are callable."""

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
