"""A request's mutable state, written only by the scheduler and the engine."""

from __future__ import annotations

import enum
from typing import Optional

from tokenmill.interfaces.outputs import FinishReason, RequestMetrics
from tokenmill.interfaces.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # KV dropped: recomputed when resumed
    SWAPPED = "swapped"  # KV in the host swap space: copied back when resumed
    FINISHED = "finished"


class Request:
    """One sequence to generate (a request with ``n > 1`` becomes ``n`` of these).

    ``num_computed_tokens`` counts tokens whose KV is in the cache; the
    scheduler closes the gap to ``num_tokens`` each step. That one rule covers
    prefill, chunked prefill, prefix-cache hits and recompute after preemption.
    Satisfies the read-only ``RequestView`` a scheduling policy sees.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        arrival_time: float,
        arrival_index: int,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        priority: int = 0,
        seed: Optional[int] = None,
        adapter_name: Optional[str] = None,
        adapter_key: Optional[str] = None,
        cache_salt: Optional[str] = None,
        user: Optional[str] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        self.arrival_index = arrival_index
        self.priority = priority
        self.seed = seed
        self.adapter_name = adapter_name
        #: what besides the tokens a prefix-cache block's hash commits to: the adapter's
        #: identity (name and path) and the request's cache_salt, so that neither an adapter's
        #: KV nor another tenant's prefix is ever shared
        self.cache_key = "\x00".join(part or "" for part in (adapter_key or adapter_name, cache_salt)) \
            if (adapter_key or adapter_name or cache_salt) else None
        self.user = user
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache, first admission
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: int | str | None = None
        #: chained prefix-cache hashes of this request's full blocks, in order
        self.block_hashes: list[bytes] = []
        #: whether its computed blocks may join the prefix cache: not once the weights changed
        #: under KV it had computed (a weight update while it ran)
        self.caches_prefix = True
        #: draft tokens for the next step to verify (speculative decoding)
        self.spec_token_ids: list[int] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time,
                                      num_prompt_tokens=len(prompt_token_ids))

    # --- RequestView -------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> Optional[int]:
        return self.sampling_params.max_tokens

    # --- state -------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Token-level stop conditions after a token was appended; sets finish_reason."""
        params = self.sampling_params
        tokens = self.all_token_ids
        last = tokens[-1]
        num_output = len(tokens) - len(self.prompt_token_ids)  # asked per request per step: counted once
        if num_output >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.finish_reason = FinishReason.STOP
                self.stop_reason = None
                return True
            if last in params.stop_token_ids:
                self.finish_reason = FinishReason.STOP
                self.stop_reason = last
                return True
        if (params.max_tokens is not None and num_output >= params.max_tokens) or len(tokens) >= self.max_model_len:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False
