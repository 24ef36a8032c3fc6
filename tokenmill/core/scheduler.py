"""Continuous batching: each step closes every request's gap between computed and
known tokens, within a token budget and ``max_num_seqs``.

There is no separate prefill phase. Running requests are served first (a
decode token, or the next prefill chunk), then waiting ones in the policy's
order. When KV blocks run out, the policy picks a victim, which is preempted
by recompute: its blocks are freed and it waits to be computed again (its
prefix is usually still in the prefix cache).
"""

from __future__ import annotations

import time
from typing import Iterable

from tokenmill.core.config import SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.interfaces.batch import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenmill.interfaces.scheduling import SchedulingPolicy
from tokenmill.interfaces.types import FinishReason


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_cache: KVCacheManager, policy: SchedulingPolicy
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.policy = policy
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._known_to_runner: set[str] = set()
        self._finished_since_schedule: set[str] = set()
        self.num_preemptions_total = 0

    # --- queue -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_requests(
        self, request_ids: Iterable[str], reason: FinishReason, stop_reason: int | str | None = None
    ) -> list[Request]:
        """Finish requests from outside the step (abort, stop string); unknown ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.finish_reason, request.stop_reason = reason, stop_reason
            self._free(request)
            finished.append(request)
        return finished

    # --- one step ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        block_size = self.kv_cache.block_size
        scheduled: list[ScheduledRequest] = []
        new_requests: list[NewRequestData] = []
        preempted: list[str] = []

        def emit(request: Request, num_new: int) -> None:
            start = request.num_computed_tokens
            if request.request_id not in self._known_to_runner:
                self._known_to_runner.add(request.request_id)
                new_requests.append(_new_request_data(request))
            scheduled.append(ScheduledRequest(
                request_id=request.request_id,
                new_token_ids=tuple(request.all_token_ids[start:start + num_new]),
                num_computed_tokens=start,
                block_ids=self.kv_cache.block_ids(request.request_id),
                sample=start + num_new == request.num_tokens,
            ))

        # Running requests first, in admission order.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.policy.choose_victim(self.running[index:])
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted itself; the next request slid into `index`
            emit(request, num_new)
            budget -= num_new
            index += 1

        # Then waiting requests, in the policy's order, unless this step had to
        # preempt (admitting more would only preempt again).
        if not preempted:
            self.waiting.sort(key=self.policy.sort_key)
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                hits = self.kv_cache.get_computed_blocks(request)
                num_new = request.num_tokens - len(hits) * block_size
                if num_new > budget and not self.config.chunked_prefill:
                    break
                num_new = min(num_new, budget)
                if not self.kv_cache.allocate_slots(request, num_new, hits):
                    break
                self.waiting.pop(0)
                request.num_computed_tokens = len(hits) * block_size
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = time.monotonic()
                    request.num_cached_tokens = request.num_computed_tokens
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                emit(request, num_new)
                budget -= num_new

        finished = frozenset(self._finished_since_schedule)
        self._finished_since_schedule.clear()
        return SchedulerOutput(
            scheduled=tuple(scheduled),
            new_requests=tuple(new_requests),
            finished_request_ids=finished,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=tuple(preempted),
        )

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, apply token-level stops.

        Returns the requests that got a token this step (finished ones included).
        """
        advanced = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished from outside while the step ran
            request.num_computed_tokens += len(item.new_token_ids)
            self.kv_cache.cache_blocks(request)
            if not item.sample:
                continue
            request.append_token(result.sampled_token_ids[item.request_id])
            advanced.append(request)
            if request.check_stop():
                self.running.remove(request)
                self._free(request)
        return advanced

    # --- internals ---------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.append(request)

    def _free(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._finished_since_schedule.add(request.request_id)


def _new_request_data(request: Request) -> NewRequestData:
    return NewRequestData(
        request_id=request.request_id,
        prompt_token_ids=tuple(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        seed=request.seed,
        stop_token_ids=request.stop_token_ids,
        adapter_name=request.adapter_name,
    )
