"""Priority scheduling: lower ``priority`` value first (vLLM's convention), ties by arrival.

A waiting request with a better priority preempts worse running ones when the
batch is full. Optional aging (``scheduler.policy_config.aging_seconds``)
improves a waiting request's priority by one level per that many seconds
waited, so low priorities cannot starve forever.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenmill.interfaces.errors import ConfigError
from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.scheduling import RequestView


class PriorityOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: seconds of waiting that improve priority by one level; None disables aging
    aging_seconds: Optional[float] = Field(None, gt=0)


class PriorityPolicy:
    uses_priority = True

    def __init__(self, config: Any, clock: Callable[[], float] = time.monotonic) -> None:
        try:
            options = PriorityOptions.model_validate(getattr(config, "policy_config", None) or {})
        except ValidationError as exc:
            first = exc.errors()[0]
            key = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"scheduler.policy_config.{key}", first["msg"]) from None
        self.aging_seconds = options.aging_seconds
        self.clock = clock

    def effective_priority(self, request: RequestView) -> float:
        if self.aging_seconds is None:
            return request.priority
        waited = max(0.0, self.clock() - request.arrival_time)
        return request.priority - math.floor(waited / self.aging_seconds)

    def sort_key(self, request: RequestView) -> Any:
        return (self.effective_priority(request), request.arrival_time, request.arrival_index)

    def may_preempt(self, waiting: RequestView, running: RequestView) -> bool:
        # Strictly better only: equal priorities never preempt each other. Both sides
        # age alike (aging counts from arrival), so two requests cannot swap places
        # back and forth.
        return self.effective_priority(waiting) < self.effective_priority(running)

    def choose_victim(self, running: Sequence[RequestView]) -> RequestView:
        """The worst priority; among equals the latest arrival (least work lost)."""
        return max(running, key=lambda r: (self.effective_priority(r), r.arrival_time, r.arrival_index))


@hookimpl
def register_scheduling_policies(register):
    register("priority", PriorityPolicy)
