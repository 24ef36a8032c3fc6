"""Between steps: which requests get drafts, how many, and what to do with a proposer's answer.

A request is offered drafts when it is decoding (its next step computes one token), is not
in flight in a pipelined batch, and has room left: drafts never reach past ``max_tokens`` or
the context. A structured-output request gets none (its matcher checks every draft row's
history, and a draft outside the grammar would be a constraint error rather than a
rejection). Above ``disable_by_batch_size`` requests, nothing is proposed. A proposer's
answer is cut at its first token outside the vocabulary, and a proposer that raises costs
the step its drafts, never a request.
"""

from __future__ import annotations

from typing import Iterable

import structlog

from tokenmill.core.engine.request import Request
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.interfaces.speculative import DraftRequest, SpeculativeProposer

log = structlog.get_logger("tokenmill.speculative")


class Speculator:
    def __init__(self, proposer: SpeculativeProposer, num_speculative_tokens: int, vocab_size: int,
                 disable_by_batch_size: int | None = None) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.disable_by_batch_size = disable_by_batch_size

    def forget(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids:
            self.proposer.forget(ids)

    def propose(self, scheduler: Scheduler) -> None:
        """Set ``spec_token_ids`` of the running requests that can take drafts."""
        if self.disable_by_batch_size is not None and \
                len(scheduler.running) + len(scheduler.waiting) > self.disable_by_batch_size:
            return
        candidates = [(request, limit) for request in scheduler.running
                      if not request.spec_token_ids and request.request_id not in scheduler.in_flight
                      and request.num_computed_tokens == request.num_tokens - 1
                      and request.sampling_params.structured_outputs is None
                      and (limit := self._limit(request)) > 0]
        if not candidates:
            return
        kv = scheduler.kv_cache
        try:
            drafts = self.proposer.propose([
                DraftRequest(request.request_id, request.all_token_ids, kv.block_ids(request.request_id), limit)
                for request, limit in candidates])
        except Exception:  # the proposer's state for these requests is unknown now
            log.exception("the speculative proposer failed: this step goes without drafts",
                          proposer=type(self.proposer).__name__)
            self.proposer.forget([request.request_id for request, _ in candidates])
            return
        for (request, limit), tokens in zip(candidates, drafts):
            request.spec_token_ids = self._valid(tokens, limit)

    def _limit(self, request: Request) -> int:
        """Drafts a request can use: the step yields up to drafts + 1 tokens, none past
        max_tokens or max_model_len."""
        room = request.max_model_len - request.num_tokens
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens)
        return min(self.num_speculative_tokens, room - 1)

    def _valid(self, tokens: list[int], limit: int) -> list[int]:
        valid = []
        for token in list(tokens)[:limit]:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self.vocab_size:
                break
            valid.append(token)
        return valid
