"""Beam search as vLLM builds it: a search over ordinary one-token engine requests.

``LLM.beam_search`` runs each round's live beams as plain requests (``max_tokens=1``,
greedy, top-K logprobs), so they are batched like any other requests and, with prefix
caching, share the KV blocks of their common prefix. This module holds the public types
(vLLM's ``BeamSearchParams``, ``BeamSearchSequence``, ``BeamSearchOutput``) and
``BeamSearch``, a pure state machine (no torch, no engine) that picks the beams.

``BeamSearch`` reproduces Hugging Face transformers' ``_beam_search`` (v5,
``generate(num_beams=n, do_sample=False, length_penalty=lp, early_stopping=False)``)
step for step, including its float32 arithmetic:

* each step keeps ``K = max(2, 1 + number of EOS ids) * beam_width`` candidates, the
  best accumulated logprobs over all live beams (descending, as ``torch.topk``); the
  first step expands the prompt alone (HF starts the other beams at -1e9);
* a candidate "hits stopping" when its token is an EOS id (unless ``ignore_eos``) or
  when it reaches ``max_tokens``; only those among the best ``beam_width`` of the K join
  the finished set, scored ``cum_logprob / generated_len ** length_penalty`` where
  ``generated_len`` counts the new token (the EOS included); the finished set keeps the
  best ``beam_width``;
* the next live beams are the best ``beam_width`` candidates that did not hit stopping;
* once ``beam_width`` sequences are finished, the search stops improving when the best
  live beam's ``cum_logprob / generated_len ** length_penalty`` is not above the worst
  finished score (HF's heuristic for ``early_stopping=False``); from then on nothing is
  added, and the search ends; it also ends when every candidate hit stopping.

The score differs from vLLM's own ``get_beam_search_score``, which divides by
``(prompt + generated tokens, an ending EOS not counted) ** length_penalty``: here, as in
HF, the divisor is ``(generated tokens, an ending EOS counted) ** length_penalty``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.outputs import PositionLogprobs, RequestOutput
from tokenmill.interfaces.sampling_params import SamplingParams, is_finite, is_int


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters, validated at construction.

    Beams are scored by the model's raw logprobs, as HF does with ``do_sample=False`` and
    as vLLM's raw logprobs are: ``temperature`` is accepted (vLLM's field) but does not
    change the search. ``ignore_eos`` makes EOS an ordinary token (then ``K = 2 *
    beam_width``); ``include_stop_str_in_output`` keeps a final EOS in ``tokens``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequest(param, message)

        check(is_int(self.beam_width) and self.beam_width >= 1, "beam_width",
              f"must be an integer of at least 1, got {self.beam_width!r}")
        # the step requests ask for K >= 2 * beam_width logprobs (more with several EOS ids)
        check(2 * self.beam_width <= SamplingParams.MAX_LOGPROBS, "beam_width",
              f"at most {SamplingParams.MAX_LOGPROBS // 2}: each step asks for 2 * beam_width "
              f"logprobs and at most {SamplingParams.MAX_LOGPROBS} are served, got {self.beam_width}")
        check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
              f"must be an integer of at least 1, got {self.max_tokens!r}")
        check(is_finite(self.length_penalty), "length_penalty",
              f"must be a finite number, got {self.length_penalty!r}")
        check(is_finite(self.temperature) and self.temperature >= 0, "temperature",
              f"must be a finite non-negative number, got {self.temperature!r}")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        check(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output",
              "must be a boolean")
        object.__setattr__(self, "length_penalty", float(self.length_penalty))
        object.__setattr__(self, "temperature", float(self.temperature))


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's shape). ``tokens`` holds the prompt and the generated ids (a final
    EOS only with ``include_stop_str_in_output``); ``logprobs`` has one entry per
    generated token, the EOS included: the top-K ``{token: Logprob}`` of that position."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int] = None
    #: ``cum_logprob / generated_len ** length_penalty`` (HF's beam score)
    score: float = 0.0
    lora_request: Optional[Any] = None


@dataclass
class BeamSearchOutput:
    """A prompt's beam search result: ``beam_width`` sequences, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def num_candidates(beam_width: int, num_eos_ids: int) -> int:
    """HF's ``beams_to_keep``: enough candidates that ``beam_width`` remain after EOS."""
    return max(2, 1 + num_eos_ids) * beam_width


@dataclass
class _Beam:
    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float  # a float32 value, accumulated as HF does


class BeamSearch:
    """One prompt's search. Each round: score ``pending()`` (full token lists of the live
    beams) and hand the next position's top-K logprobs of each, in order, to ``advance``;
    stop when ``done``; ``result()`` gives the finished sequences, best first."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: Iterable[int] = ()) -> None:
        prompt = list(prompt_token_ids)
        if not prompt:
            raise InvalidRequest("prompt", "the prompt is empty")
        self.prompt_token_ids = prompt
        self.params = params
        self.eos_token_ids: frozenset[int] = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        #: candidates kept per step, and the logprobs each beam must report
        self.num_candidates = num_candidates(params.beam_width, len(self.eos_token_ids))
        if self.num_candidates > SamplingParams.MAX_LOGPROBS:
            raise InvalidRequest(
                "beam_width",
                f"beam_width={params.beam_width} with {len(self.eos_token_ids)} EOS ids needs "
                f"{self.num_candidates} logprobs per step (max(2, 1 + EOS ids) * beam_width); "
                f"at most {SamplingParams.MAX_LOGPROBS} are served")
        self._running = [_Beam(prompt, [], 0.0)]
        self._finished: list[BeamSearchSequence] = []  # best first, at most beam_width
        self._improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self._generated = 0  # tokens generated by the live beams
        self.done = False

    def pending(self) -> list[list[int]]:
        """The live beams' token lists (prompt + generated), best first; empty when done."""
        return [] if self.done else [list(beam.tokens) for beam in self._running]

    def advance(self, logprobs: Sequence[Optional[PositionLogprobs]]) -> None:
        """One step, given for each pending beam (in order) its next position's logprobs."""
        if self.done:
            raise RuntimeError("the beam search is done")
        if len(logprobs) != len(self._running):
            raise ValueError(f"got logprobs for {len(logprobs)} beams, {len(self._running)} are pending")
        width, k = self.params.beam_width, self.num_candidates
        candidates: list[tuple[float, int, int]] = []  # (accumulated logprob, beam, token)
        for index, (beam, entry) in enumerate(zip(self._running, logprobs)):
            if not entry:
                raise ValueError(f"beam {index} has no logprobs")
            # a beam's own top-K covers every candidate of the global top-K it can supply
            best = sorted(entry.items(), key=lambda item: (-item[1].logprob, item[0]))[:k]
            candidates.extend((_f32(beam.cum_logprob + lp.logprob), index, token) for token, lp in best)
        # torch.topk over [beam, token]: descending; exact ties (rare) in index order
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[:k]

        generated = self._generated + 1
        at_max = generated >= self.params.max_tokens
        hits = [at_max or token in self.eos_token_ids for _, _, token in candidates]

        if self._improvable:
            # only the best beam_width candidates may finish (the rest are spares for the beams)
            divisor = _length_divisor(generated, self.params.length_penalty)
            new = [self._finish(candidates[i], logprobs, _f32_div(candidates[i][0], divisor))
                   for i in range(min(width, len(candidates))) if hits[i]]
            if new:
                merged = self._finished + new  # HF concatenates old, then new, and takes topk
                merged.sort(key=lambda s: -s.score)
                self._finished = merged[:width]

        self._running = [
            _Beam(self._running[b].tokens + [token], self._running[b].logprobs + [logprobs[b]], total)
            for (total, b, token), hit in zip(candidates, hits) if not hit
        ][:width]
        self._generated = generated

        if self._improvable and len(self._finished) >= width and self._running:
            divisor = _length_divisor(generated, self.params.length_penalty)
            best_possible = _f32_div(self._running[0].cum_logprob, divisor)
            self._improvable = best_possible > self._finished[-1].score
        self.done = not self._improvable or all(hits) or not self._running

    def _finish(self, candidate: tuple[float, int, int], logprobs: Sequence[Optional[PositionLogprobs]],
                score: float) -> BeamSearchSequence:
        total, b, token = candidate
        beam = self._running[b]
        is_eos = token in self.eos_token_ids
        keep_token = not is_eos or self.params.include_stop_str_in_output
        return BeamSearchSequence(
            tokens=beam.tokens + [token] if keep_token else list(beam.tokens),
            logprobs=beam.logprobs + [logprobs[b]],
            cum_logprob=total,
            finish_reason="stop" if is_eos else "length",
            stop_reason=token if is_eos else None,
            score=score,
        )

    def result(self) -> list[BeamSearchSequence]:
        """The finished sequences, best score first (at most ``beam_width``)."""
        return list(self._finished)


def _f32(value: float) -> float:
    """``value`` rounded to float32, as torch computes HF's scores: a float32 +, / done in
    double and rounded once gives the float32 result exactly."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # past float32's range
        return math.copysign(math.inf, value)


def _f32_div(a: float, b: float) -> float:
    if b == 0:  # a length penalty so negative that the divisor underflowed, as float32 divides
        return math.copysign(math.inf, a) if a else math.nan
    return _f32(a / b)


def _length_divisor(generated: int, length_penalty: float) -> float:
    """``generated ** length_penalty`` as torch divides by it (cast to float32)."""
    try:
        return _f32(float(generated) ** length_penalty)
    except OverflowError:
        return math.inf


def advance_searches(searches: Sequence[BeamSearch], pending: Sequence[list[list[int]]],
                     outputs: Sequence[RequestOutput]) -> None:
    """Hand each search its beams' next-position logprobs from one round's outputs, which
    are the round's requests in ``pending`` order (one list of beams per search)."""
    if len(outputs) != sum(map(len, pending)):
        raise RuntimeError("a beam search round lost requests")
    position = 0
    for search, beams in zip(searches, pending):
        step = outputs[position:position + len(beams)]
        position += len(beams)
        for output in step:
            if output.error is not None or not output.outputs[0].logprobs:
                raise RuntimeError(f"a beam search step failed: {output.error or 'no logprobs'}")
        search.advance([output.outputs[0].logprobs[0] for output in step])


__all__ = ["advance_searches", "BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "num_candidates"]
