"""The SchedulingPolicy contract: a policy decides order and victims, never mechanics.

The core scheduler owns the token budget, ``max_num_seqs``, chunked prefill,
block allocation and preemption itself. A policy only answers three questions,
about read-only views of requests. It must not keep references to the views
beyond the call (their fields change as the engine steps).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class RequestView(Protocol):
    """What a policy may read about a request. Read-only by contract."""

    @property
    def request_id(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def arrival_index(self) -> int:
        """Arrival order; breaks ties between equal arrival times."""
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> Optional[int]: ...
    @property
    def adapter_name(self) -> Optional[str]: ...
    @property
    def user(self) -> Optional[str]:
        """The OpenAI ``user`` field, a tenant tag for fair-share policies."""


@runtime_checkable
class SchedulingPolicy(Protocol):
    """Orders waiting requests and picks preemption victims.

    Called by the scheduler on its thread, every step: keep the methods cheap.
    A factory receives the engine's ``SchedulerConfig``; policy-specific
    options live in ``config.policy_config`` and are the policy's to validate.
    """

    #: whether per-request ``priority`` means anything to this policy (the engine
    #: warns once when requests carry a priority that the policy would ignore)
    uses_priority: bool

    def sort_key(self, request: RequestView) -> Any:
        """Key of a waiting request; the smallest is admitted first."""

    def may_preempt(self, waiting: RequestView, running: RequestView) -> bool:
        """Whether ``waiting`` may evict ``running`` to be admitted now, when the batch is
        full (by ``max_num_seqs`` or by KV blocks). Must be a strict order (never both
        ways for one pair), so that two requests cannot preempt each other in turn."""

    def choose_victim(self, running: Sequence[RequestView]) -> RequestView:
        """Which running request to preempt when KV blocks run out: one of ``running``.

        ``running`` holds the requests not yet scheduled in this step, in
        admission order; its first element is the one that needs blocks. It is
        never empty. Choosing that first element preempts the requester itself.
        """
