"""Turns per-step token updates into vLLM-shaped RequestOutputs.

Owns the per-request output state: detokenizers, logprobs, stop strings and
the fan-in of ``n > 1`` child sequences into one RequestOutput, shaped by the
request's ``output_kind``: everything so far, what is new, or one final output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from tokenmill.core.engine.detokenizer import IncrementalDetokenizer
from tokenmill.core.engine.request import Request
from tokenmill.interfaces.outputs import (CompletionOutput, FinishReason, Logprob, PositionLogprobs, RequestMetrics,
                                          RequestOutput)
from tokenmill.interfaces.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[PositionLogprobs]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    #: tokens added since the request's last output (``stream_interval``)
    unsent: int = 0
    #: what earlier DELTA outputs held: tokens, characters of text, and the finish
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finish: bool = False


@dataclass
class RequestState:
    """Everything reported for one user request (all its child sequences)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[str, _Sequence]
    metrics: RequestMetrics
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None
    num_cached_tokens: int = 0
    #: why processing this request failed, once it did
    error: Optional[str] = None
    #: an output went out already (DELTA sends the prompt's logprobs once)
    sent: bool = False
    #: sequences without a finish reason yet (``finished`` is asked per request per step)
    unfinished: int = 0

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    def end(self, seq: "_Sequence", reason: str) -> None:
        """Give ``seq`` (one of this request's) its finish reason."""
        if seq.finish_reason is None:
            self.unfinished -= 1
        seq.finish_reason = reason


@dataclass(slots=True)
class RequestProgress:
    """A user request that a step advanced, finished or failed, whatever its ``output_kind``
    let the step return: what metrics and logs count. Read-only by convention, not frozen: one
    is made per request per step, and a frozen dataclass's constructor costs three times as much."""

    request_id: str
    #: shared with the request's outputs: times, prompt and generated token counts
    metrics: RequestMetrics
    num_cached_tokens: int
    #: each sequence's finish reason, once every sequence finished (else None)
    finish_reasons: Optional[tuple[str, ...]]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}  # by user request id
        self._parent_of: dict[str, str] = {}  # child sequence id -> user request id

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
            params: SamplingParams, child_ids: list[str], arrival_time: float) -> None:
        sequences = {}
        for index, child in enumerate(child_ids):
            sequences[child] = _Sequence(
                index, IncrementalDetokenizer(self.tokenizer, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            self._parent_of[child] = request_id
        self.states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, sequences,
            RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids)),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            unfinished=len(sequences),
        )

    def parent_of(self, child_id: str) -> Optional[str]:
        return self._parent_of.get(child_id)

    def child_ids(self, request_id: str) -> list[str]:
        state = self.states.get(request_id)
        return list(state.sequences) if state else []

    def add_prompt_logprobs(self, child_id: str, entries: list[Optional[PositionLogprobs]]) -> None:
        state = self.states[self._parent_of[child_id]]
        if state.prompt_logprobs is not None and next(iter(state.sequences)) == child_id:
            self._decode_logprob_tokens(entries)
            state.prompt_logprobs.extend(entries)

    def add_token(self, request: Request, token: int, logprobs: Optional[PositionLogprobs]) -> Optional[str]:
        """Record a sampled token; returns a stop string it completed, if any."""
        state = self.states[self._parent_of[request.request_id]]
        seq = state.sequences[request.request_id]
        seq.token_ids.append(token)
        seq.unsent += 1
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = time.monotonic()
            state.metrics.first_scheduled_time = request.metrics.first_scheduled_time
            state.num_cached_tokens = request.num_cached_tokens
        state.metrics.num_generation_tokens += 1
        if logprobs is not None and seq.logprobs is not None:
            self._decode_logprob_tokens([logprobs])
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        return seq.detokenizer.update([token])

    def fail(self, request_id: str, error: str) -> None:
        """Finish a request's unfinished sequences as failed, with the reason."""
        state = self.states[request_id]
        state.error = error
        for seq in state.sequences.values():
            if seq.finish_reason is None:
                state.end(seq, str(FinishReason.ERROR))

    def finish(self, request: Request) -> None:
        state = self.states[self._parent_of[request.request_id]]
        seq = state.sequences[request.request_id]
        state.end(seq, str(request.finish_reason))
        seq.stop_reason = request.stop_reason
        state.metrics.num_preemptions += request.metrics.num_preemptions
        state.metrics.num_draft_tokens += request.metrics.num_draft_tokens
        state.metrics.num_accepted_tokens += request.metrics.num_accepted_tokens

    def collect(self, request_ids: Iterable[str]) -> tuple[list[RequestProgress], list[RequestOutput]]:
        """Each request's progress in a step, and the outputs their ``output_kind`` give now
        (forgetting the requests that finished). One pass, asked per request per step: a
        FINAL_ONLY request still running costs its progress and nothing more."""
        progress, outputs = [], []
        for request_id in request_ids:
            state = self.states[request_id]
            reasons = tuple(seq.finish_reason for seq in state.sequences.values()) if state.finished else None
            progress.append(RequestProgress(request_id, state.metrics, state.num_cached_tokens, reasons))
            if state.finished or state.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                output = self.output(request_id)
                if output is not None:
                    outputs.append(output)
        return progress, outputs

    def output(self, request_id: str) -> Optional[RequestOutput]:
        """The request's output as its ``output_kind`` shapes it, or None where that kind has
        nothing to say yet (FINAL_ONLY before the end); forgets the request once it finished."""
        state = self.states[request_id]
        finished = state.finished
        kind = state.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        interval = state.params.stream_interval
        if interval > 1 and not finished and state.sent and all(seq.unsent < interval
                                                                   for seq in state.sequences.values()):
            return None  # the first token went out; the next output waits for `interval` new ones
        for seq in state.sequences.values():
            seq.unsent = 0
        delta = kind is RequestOutputKind.DELTA
        outputs = [output for seq in state.sequences.values()
                   if (output := self._completion(seq, delta)) is not None]
        if finished:
            state.metrics.finished_time = time.monotonic()
            del self.states[request_id]
            for child in state.sequences:
                del self._parent_of[child]
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not (delta and state.sent):
            prompt_logprobs = list(state.prompt_logprobs)
        state.sent = True
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            error=state.error,
        )

    @staticmethod
    def _completion(seq: _Sequence, delta: bool) -> Optional[CompletionOutput]:
        """A sequence's CompletionOutput: all of it, or (``delta``) what is new since the last
        one, None where nothing is."""
        finished = seq.finish_reason is not None
        text = seq.detokenizer.visible_text(finished)
        tokens, logprobs = seq.token_ids, seq.logprobs
        if delta:
            if seq.sent_tokens == len(tokens) and seq.sent_text == len(text) and (seq.sent_finish or not finished):
                return None
            text, tokens = text[seq.sent_text:], tokens[seq.sent_tokens:]
            logprobs = logprobs[seq.sent_tokens:] if logprobs is not None else None
            seq.sent_tokens, seq.sent_text, seq.sent_finish = len(seq.token_ids), seq.sent_text + len(text), finished
        else:
            tokens, logprobs = list(tokens), list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=tokens,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _decode_logprob_tokens(self, entries: list[Optional[PositionLogprobs]]) -> None:
        for entry in entries:
            if entry is None:
                continue
            for token, logprob in list(entry.items()):
                entry[token] = Logprob(logprob.logprob, logprob.rank, self.tokenizer.decode([token]))
