"""First come, first served: the default policy."""

from __future__ import annotations

from typing import Any, Sequence

from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.scheduling import RequestView


class FifoPolicy:
    """Admit in arrival order; when blocks run out, preempt the most recently admitted.
    Per-request priorities are ignored (the engine logs that once)."""

    uses_priority = False

    def __init__(self, config: Any = None) -> None:
        pass

    def sort_key(self, request: RequestView) -> Any:
        return (request.arrival_time, request.arrival_index)

    def may_preempt(self, waiting: RequestView, running: RequestView) -> bool:
        return False

    def choose_victim(self, running: Sequence[RequestView]) -> RequestView:
        return running[-1]


@hookimpl
def register_scheduling_policies(register):
    register("fifo", FifoPolicy)
