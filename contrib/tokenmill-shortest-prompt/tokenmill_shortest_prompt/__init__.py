"""Shortest prompt first: admit short prompts before long ones.

Short jobs first lowers the mean time to first token when prompt lengths vary
widely. This package uses only tokenmill's public contracts
(``tokenmill.interfaces``), which is the point: tokenmill's core has never
heard of it. Select it with ``scheduler: {policy: shortest-prompt}``.
"""

from __future__ import annotations

from typing import Any, Sequence

from tokenmill.interfaces.hookspecs import hookimpl
from tokenmill.interfaces.scheduling import RequestView


class ShortestPromptFirst:
    def __init__(self, config: Any) -> None:
        pass

    def sort_key(self, request: RequestView) -> Any:
        return (request.num_prompt_tokens, request.arrival_time, request.arrival_index)

    def may_preempt(self, waiting: RequestView, running: RequestView) -> bool:
        return False

    def choose_victim(self, running: Sequence[RequestView]) -> RequestView:
        # evict the request with the longest prompt: the most blocks freed per preemption
        return max(running, key=lambda r: (r.num_prompt_tokens, r.arrival_index))


@hookimpl
def register_scheduling_policies(register):
    register("shortest-prompt", ShortestPromptFirst)
