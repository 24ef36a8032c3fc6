"""The driver's side of the engine's control calls: each runs on every rank, rank 0 (this
process) beside the workers, and answers in rank order.

The workers get the ``Control`` message first, so that an operation whose ranks meet in a
collective (a weight broadcast) finds them all there; rank 0 then runs its part; the
workers' results are collected even when rank 0's part failed, so the control channel
stays in step.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from tokenmill.core.distributed.driver import WorkerGroup
from tokenmill.core.distributed.messages import Control
from tokenmill.core.worker.worker_control import WorkerControl
from tokenmill.interfaces.errors import RankCallFailed


class ControlPlane:
    def __init__(self, local: WorkerControl, group: Optional[WorkerGroup], timeout_s: float) -> None:
        self.local = local
        self.group = group
        self.timeout_s = timeout_s

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else self.group.world_size

    def run(self, op: str, payload: dict[str, Any], local_payload: Optional[dict[str, Any]] = None,
            timeout_s: Optional[float] = None) -> list[Any]:
        """``op`` on every rank; their values in rank order. ``local_payload``: rank 0's own
        arguments where they hold what cannot cross the channel (tensors)."""
        if self.group is not None:
            self.group.send(Control(op, msgspec.json.encode(payload)))
        try:
            values, failure = [self.local.handle(op, payload if local_payload is None else local_payload)], None
        except Exception as exc:
            values, failure = [None], exc
        results = [] if self.group is None else self.group.results(op, timeout_s or self.timeout_s)
        if failure is not None:
            raise RankCallFailed(0, f"{type(failure).__name__}: {failure}") from failure
        for rank, result in enumerate(results, start=1):
            if result.error is not None:
                raise RankCallFailed(rank, result.error)
            values.append(msgspec.json.decode(result.value))
        return values
