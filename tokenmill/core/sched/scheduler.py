"""Continuous batching: each step closes every request's gap between computed and
known tokens, within a token budget and ``max_num_seqs``.

There is no separate prefill phase. Running requests are served first (a
decode token, or the next prefill chunk), then waiting ones in the policy's
order. Preemption has two triggers: KV blocks running out for a running
request (the policy picks a victim), and a waiting request that the policy
ranks above running ones while the batch is full (by seats or blocks). A
victim is preempted by recompute (its blocks are dropped; its prefix usually
stays in the prefix cache) or by swap (its blocks are copied to the host swap
space and back when it resumes, falling back to recompute when that is full).

Under pipeline parallelism ``pipeline_depth`` batches are in flight at once: a batch takes
an even share of the requests, never one in flight in another batch (its next tokens are
not known yet), and a request in flight is never preempted.

Under async scheduling one batch is in flight while the next is scheduled, and its requests
go on: a prompt chunk's successor chunk follows it, and a decoding request's next token is
``PLACEHOLDER_TOKEN``, the one its step in flight samples (the runner fills it in on the
device). Not one whose sampling reads its output history on the host (penalties, a grammar,
a logits processor's state; they run every other step), nor one whose step in flight may
produce its last token by length. A request that stops on a token the host has not seen yet
runs one step too many, whose token is dropped. A request preempted while its step is in
flight loses that step's token (the runner drops it) and recomputes it when it resumes.

Speculative decoding: a decoding request's draft tokens ride after its last token, within
the token budget (drafts are cut, never preempted for); ``num_lookahead_slots`` more KV
slots are reserved for a proposer that writes KV of its own. The update keeps the verified
tokens only, one at a time with their stop checks, and rolls the rest back: computed
tokens, and blocks past what the request and its lookahead need. Only verified tokens are
ever hashed into the prefix cache (drafts never enter ``all_token_ids``).
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

from tokenmill.core.config.engine_config import SchedulerConfig
from tokenmill.core.engine.request import Request, RequestStatus
from tokenmill.core.sched.kv_cache_manager import KVCacheManager
from tokenmill.core.sched.spec_decode_stats import SpecDecodingStats
from tokenmill.core.sample.sampler import reads_output_history
from tokenmill.core.sched.swap_space import SwapSpace
from tokenmill.interfaces.batch import (
    PLACEHOLDER_TOKEN,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from tokenmill.interfaces.scheduling import SchedulingPolicy
from tokenmill.interfaces.outputs import FinishReason


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        policy: SchedulingPolicy,
        swap_space: Optional[SwapSpace] = None,
        max_adapters: Optional[int] = None,
        pipeline_depth: int = 1,
        num_lookahead_slots: int = 0,
        async_scheduling: bool = False,
    ) -> None:
        self.config = config
        #: batches in flight at once (pipeline parallelism): each takes its share of the
        #: requests, and never one that is in flight in another
        self.pipeline_depth = pipeline_depth
        #: the next batch is scheduled while the last one is in flight, with its requests
        self.async_scheduling = async_scheduling
        #: each request of a batch scheduled but not yet updated -> its work there (kept by the engine)
        self.in_flight: dict[str, ScheduledRequest] = {}
        #: KV slots reserved past a sampling step's tokens, for a proposer's own KV writes
        self.num_lookahead_slots = num_lookahead_slots
        self.spec_stats = SpecDecodingStats()
        #: distinct adapters allowed in the running batch (max_loras); None = no adapters
        self.max_adapters = max_adapters
        self.kv_cache = kv_cache
        self.policy = policy
        self.swap_space = swap_space if config.preemption_mode == "swap" else None
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._known_to_runner: set[str] = set()
        self._finished_since_schedule: set[str] = set()
        self.num_preemptions_total = 0
        self.num_swaps_total = 0

    # --- queue -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def invalidate_prefix_cache(self) -> None:
        """New weights: no KV computed under the old ones is a prefix-cache hit again."""
        self.kv_cache.invalidate([*self.running, *self.waiting])

    @property
    def num_swapped(self) -> int:
        """Asked twice a step (stats, metrics): counted by the swap space, not over the queue."""
        return self.swap_space.num_requests if self.swap_space is not None else 0

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
        step = _Step(self.config.max_num_batched_tokens)
        if self.pipeline_depth > 1:  # an even share, so that every stage has a batch to work on
            step.max_requests = -(-(len(self.running) + len(self.waiting)) // self.pipeline_depth)
        self.waiting.sort(key=self.policy.sort_key)
        self._preempt_for_waiting(step)
        self._schedule_running(step)
        # Admit waiting requests unless running ones just ran out of blocks
        # (admitting more would only preempt again).
        if not step.pressure_preempted:
            self._schedule_waiting(step)

        finished = frozenset(self._finished_since_schedule)
        self._finished_since_schedule.clear()
        num_tokens = self.config.max_num_batched_tokens - step.budget
        return SchedulerOutput(
            scheduled=tuple(step.scheduled),
            new_requests=tuple(step.new_requests),
            finished_request_ids=finished,
            num_scheduled_tokens=num_tokens,
            preempted_request_ids=tuple(step.preempted),
            blocks_to_swap_out=tuple(step.swap_out),
            blocks_to_swap_in=tuple(step.swap_in),
            stats=SchedulerStats(len(self.running), len(self.waiting), self.num_swapped, len(step.preempted),
                                 num_tokens, self.kv_cache.pool.usage()),
        )

    def _preempt_for_waiting(self, step: "_Step") -> None:
        """Let waiting requests the policy ranks higher take a full batch's seats or blocks."""
        if not self.waiting:
            return
        seats = self.config.max_num_seqs - len(self.running)
        # blocks left once the running requests have grown by this step's tokens, counted (over
        # every running request) only once a seat is free: a full batch rarely has a victim
        free_blocks: Optional[int] = None
        for index in range(len(self.waiting)):  # not a copy: victims join after the candidates
            candidate = self.waiting[index]
            need = self._blocks_to_admit(candidate, step.budget)
            while True:
                if seats >= 1:
                    if free_blocks is None:
                        free_blocks = self.kv_cache.pool.num_free_blocks - sum(map(self._blocks_to_grow,
                                                                                   self.running))
                    if free_blocks >= need:
                        break
                victims = [r for r in self.running if self._preemptible(r) and self.policy.may_preempt(candidate, r)]
                if not victims:
                    return  # the best waiting request cannot get in; nor can later ones
                victim = self.policy.choose_victim(victims)
                freed = self._blocks_to_grow(victim) + self._preempt(victim, step)
                if free_blocks is not None:
                    free_blocks += freed
                seats += 1
            seats -= 1
            free_blocks -= need

    def _schedule_running(self, step: "_Step") -> None:
        index = 0
        while index < len(self.running) and step.budget > 0 and len(step.scheduled) < step.max_requests:
            request = self.running[index]
            start, known = request.num_computed_tokens, request.num_tokens
            ahead = self.in_flight.get(request.request_id)
            if ahead is not None:
                if not self._goes_on(request, ahead):
                    index += 1
                    continue
                start = ahead.num_computed_tokens + len(ahead.new_token_ids)
                known += ahead.sample  # the token in flight, a placeholder here
            num_new = self._chunk(known - start, step.budget)
            ahead_tokens = start - request.num_computed_tokens  # slots its step in flight holds
            drafts: tuple[int, ...] = ()
            if request.spec_token_ids and start + num_new == known:
                drafts = tuple(request.spec_token_ids[:step.budget - num_new])
            lookahead = self._lookahead(request, num_new + len(drafts))
            if drafts and not self.kv_cache.allocate_slots(request, num_new + len(drafts) + lookahead):
                drafts = ()  # no room for them: decode without (rather than preempt for drafts)
            while not self.kv_cache.allocate_slots(request, ahead_tokens + num_new + lookahead):
                # never empty: ``request`` itself is preemptible (under pipelining it is not in flight)
                victim = self.policy.choose_victim([r for r in self.running[index:] if self._preemptible(r)])
                self._preempt(victim, step)
                step.pressure_preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted itself; the next request slid into `index`
            self._emit(request, num_new, step, drafts, start)
            index += 1

    def _schedule_waiting(self, step: "_Step") -> None:
        block_size = self.kv_cache.block_size
        if step.preempted:  # victims of this step joined the queue
            self.waiting.sort(key=self.policy.sort_key)
        if self._full(step):
            return  # before the queue is copied: a full batch takes nobody
        for request in list(self.waiting):
            if self._full(step):
                return
            if request.request_id in step.preempted:
                continue  # never re-admit a victim in the step that preempted it
            if request.adapter_name is not None and not self._adapter_fits(request.adapter_name):
                continue  # max_loras distinct adapters are running; a later request may fit
            swapped = request.status is RequestStatus.SWAPPED
            hits = [] if swapped else self.kv_cache.get_computed_blocks(request)
            num_computed = request.num_computed_tokens if swapped else len(hits) * block_size
            num_new = request.num_tokens - num_computed
            if num_new > step.budget and not self.config.chunked_prefill:
                return
            num_new = self._chunk(num_new, step.budget)
            # a waiting request that is not swapped has computed nothing yet: the hits
            # become its first computed tokens once the allocation succeeds
            if not self.kv_cache.allocate_slots(request, num_new + self._lookahead(request, num_new, num_computed),
                                                hits):
                return
            request.num_computed_tokens = num_computed
            if not swapped and self.kv_cache.enable_caching:
                self.kv_cache.record_lookup(request.num_tokens, len(hits))
            if swapped:
                host = self.swap_space.release(request.request_id)
                step.swap_in.extend(zip(self.kv_cache.block_ids(request.request_id), host))
            self.waiting.remove(request)
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._emit(request, num_new, step)

    def _full(self, step: "_Step") -> bool:
        """Whether the step can take no more requests."""
        return step.budget <= 0 or len(self.running) >= self.config.max_num_seqs \
            or len(step.scheduled) >= step.max_requests

    def _chunk(self, num_new: int, budget: int) -> int:
        """The tokens of ``num_new`` a request computes this step: what the budget leaves, and
        with chunked prefill at most ``long_prefill_token_threshold``."""
        threshold = self.config.long_prefill_token_threshold if self.config.chunked_prefill else 0
        return min(num_new, budget, threshold or num_new)

    def _adapter_fits(self, adapter: str) -> bool:
        running = {r.adapter_name for r in self.running if r.adapter_name is not None}
        return adapter in running or len(running) < (self.max_adapters or 0)

    def _blocks_to_grow(self, request: Request) -> int:
        """New blocks a running request needs for its next token or chunk."""
        tokens = min(request.num_tokens, request.num_computed_tokens + self.config.max_num_batched_tokens)
        return max(0, -(-tokens // self.kv_cache.block_size) - self.kv_cache.num_blocks_of(request.request_id))

    def _blocks_to_admit(self, request: Request, budget: int) -> int:
        """Blocks a waiting request needs for its first step (ignoring prefix hits)."""
        tokens = request.num_tokens if not self.config.chunked_prefill else min(
            request.num_tokens, request.num_computed_tokens + budget)
        return -(-tokens // self.kv_cache.block_size)

    def _lookahead(self, request: Request, num_new: int, start: Optional[int] = None) -> int:
        """Lookahead slots for a step of ``num_new`` tokens: none unless it samples, and
        none past max_model_len (no draft is proposed there)."""
        start = request.num_computed_tokens if start is None else start
        if not self.num_lookahead_slots or start + num_new < request.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_slots, request.max_model_len - start - num_new))

    def _emit(self, request: Request, num_new: int, step: "_Step", drafts: tuple[int, ...] = (),
              start: Optional[int] = None) -> None:
        """Schedule ``num_new`` tokens from position ``start`` (default: the computed ones'
        end); positions past the known tokens take the token in flight (a placeholder)."""
        if request.spec_token_ids:
            request.spec_token_ids = []
        start = request.num_computed_tokens if start is None else start
        if request.request_id not in self._known_to_runner:
            self._known_to_runner.add(request.request_id)
            step.new_requests.append(_new_request_data(request))
        tokens = tuple(request.all_token_ids[start:start + num_new])
        if len(tokens) < num_new:
            tokens += (PLACEHOLDER_TOKEN,) * (num_new - len(tokens))
        step.scheduled.append(ScheduledRequest(
            request_id=request.request_id,
            new_token_ids=tokens + drafts,
            num_computed_tokens=start,
            block_ids=self.kv_cache.block_ids(request.request_id),
            sample=start + num_new >= request.num_tokens,
            spec_token_ids=drafts,
        ))
        step.budget -= num_new + len(drafts)

    def _preemptible(self, request: Request) -> bool:
        """A request in flight in a pipeline stage is not; under async scheduling it is: the
        runner drops its step's result (``preempted_request_ids``), and it recomputes what it lost."""
        return self.async_scheduling or request.request_id not in self.in_flight

    def _goes_on(self, request: Request, ahead: ScheduledRequest) -> bool:
        """Whether a request whose step is in flight is scheduled again before that step's
        result is in (async scheduling; never under pipeline parallelism)."""
        if not self.async_scheduling:
            return False
        if not ahead.sample:
            return True  # a prompt chunk: the next one's tokens are known
        if ahead.spec_token_ids or reads_output_history(request.sampling_params):
            return False
        # the token in flight may be its last by length; one by a stop token costs a step
        max_tokens = request.sampling_params.max_tokens
        return (request.num_tokens + 1 < request.max_model_len
                and (max_tokens is None or request.num_output_tokens + 1 < max_tokens))

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[tuple[Request, int]]:
        """Advance computed tokens, append sampled tokens one at a time with their token-level
        stops, roll back rejected drafts.

        Returns (request, tokens appended) for each request that got tokens this step
        (finished ones included).
        """
        advanced = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # finished from outside while the step ran
            if not item.sample:
                request.num_computed_tokens += len(item.new_token_ids)
                self.kv_cache.cache_blocks(request)
                continue
            tokens = result.sampled_token_ids[item.request_id]
            if item.spec_token_ids:
                self.spec_stats.observe(len(item.spec_token_ids), len(tokens) - 1)
                request.metrics.num_draft_tokens += len(item.spec_token_ids)
                request.metrics.num_accepted_tokens += len(tokens) - 1
            stopped, appended = False, 0
            for token in tokens:
                request.append_token(token)
                appended += 1
                if request.check_stop():
                    stopped = True
                    break
            # the KV written for the last token and the accepted drafts is valid; that of the
            # drafts after the first rejection is not (its slots are overwritten later)
            num_real = len(item.new_token_ids) - len(item.spec_token_ids)
            request.num_computed_tokens = item.num_computed_tokens + num_real + appended - 1
            self.kv_cache.cache_blocks(request)
            advanced.append((request, appended))
            if stopped:
                self.running.remove(request)
                self._free(request)
            elif item.spec_token_ids:
                self.kv_cache.trim(request, request.num_tokens - 1 + self._lookahead(request, 1, request.num_tokens - 1))
        return advanced

    # --- internals ---------------------------------------------------------
    def _preempt(self, request: Request, step: "_Step") -> int:
        """Preempt a running request; returns the number of device blocks it freed."""
        self.running.remove(request)
        device_blocks = self.kv_cache.block_ids(request.request_id)
        host = None
        if self.swap_space is not None and request.num_computed_tokens > 0:
            host = self.swap_space.allocate(request.request_id, len(device_blocks))
        if host is not None:
            step.swap_out.extend(zip(device_blocks, host))
            request.status = RequestStatus.SWAPPED
            self.num_swaps_total += 1
        else:
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        free_before = self.kv_cache.pool.num_free_blocks
        self.kv_cache.free(request)
        request.metrics.num_preemptions += 1
        self.num_preemptions_total += 1
        step.preempted.append(request.request_id)
        self.waiting.append(request)
        return self.kv_cache.pool.num_free_blocks - free_before

    def _free(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.kv_cache.free(request)
        if self.swap_space is not None:
            self.swap_space.release(request.request_id)
        del self.requests[request.request_id]
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._finished_since_schedule.add(request.request_id)


class _Step:
    """What one schedule() call accumulates."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.scheduled: list[ScheduledRequest] = []
        self.new_requests: list[NewRequestData] = []
        self.preempted: list[str] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.pressure_preempted = False
        #: requests this batch may take (a share of them under pipelining)
        self.max_requests = float("inf")


def _new_request_data(request: Request) -> NewRequestData:
    return NewRequestData(
        request_id=request.request_id,
        prompt_token_ids=tuple(request.prompt_token_ids),
        sampling_params=request.sampling_params,
        seed=request.seed,
        adapter_name=request.adapter_name,
    )
