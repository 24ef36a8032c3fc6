"""The messages between scheduler, model runner and engine for one step.

Each is frozen and has one writer: the scheduler writes SchedulerOutput, the
model runner writes ModelRunnerOutput. Nothing downstream mutates them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from tokenmill.interfaces.outputs import PositionLogprobs
from tokenmill.interfaces.sampling_params import SamplingParams

#: in ``ScheduledRequest.new_token_ids`` under async scheduling: the token the request's step
#: still in flight samples, which the runner puts in place on the device
PLACEHOLDER_TOKEN = -1


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Sent once, the first time a request is scheduled: what the runner keeps for it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    #: seed of the request's own generator; None shares the engine's generator
    seed: Optional[int]
    adapter_name: Optional[str] = None


class ScheduledRequest(NamedTuple):
    """One request's work in a step: compute ``new_token_ids`` at positions from ``num_computed_tokens``
    (under async scheduling, positions after those its step in flight computes; its one new
    token then may be ``PLACEHOLDER_TOKEN``). Immutable as the other messages, but a named
    tuple: one is made per request per step, and a frozen dataclass's constructor costs twice
    as much."""

    request_id: str
    new_token_ids: tuple[int, ...]
    num_computed_tokens: int
    #: the request's whole block table (physical block ids, in order)
    block_ids: tuple[int, ...]
    #: True when this step reaches the end of the known tokens, so a token is sampled
    sample: bool
    #: draft tokens to verify: the tail of ``new_token_ids``, after the request's last token
    spec_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The queue after a schedule() call, for metrics and observers."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_preempted: int  # in this step
    num_scheduled_tokens: int
    kv_cache_usage: float


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the model runner needs for one forward pass."""

    scheduled: tuple[ScheduledRequest, ...]
    new_requests: tuple[NewRequestData, ...]
    #: requests the runner may forget (finished or aborted since the last step)
    finished_request_ids: frozenset[str]
    num_scheduled_tokens: int
    #: requests preempted by this schedule() call
    preempted_request_ids: tuple[str, ...] = ()
    #: (device block, host block) copies to make before the forward pass, outs first
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    stats: Optional["SchedulerStats"] = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What one forward pass produced, keyed by request id."""

    #: per sampled request, its new tokens in order: one, or with drafts the accepted ones
    #: and one of the target's
    sampled_token_ids: dict[str, list[int]]
    #: per sampled request: logprobs of each new token (+ top-k), when requested
    logprobs: dict[str, list[Optional[PositionLogprobs]]]
    #: per request with prompt_logprobs: the logprobs of the prompt tokens this chunk covered
    prompt_logprobs: dict[str, list[Optional[PositionLogprobs]]]
