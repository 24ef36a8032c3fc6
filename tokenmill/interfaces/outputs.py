"""What a request gives back, step by step and at its end: vLLM's output types, with its
names (``RequestOutput``, ``CompletionOutput``, ``Logprob``) and the pooling ones."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; the values are the OpenAI ``finish_reason`` strings."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the caller or a disconnect
    ERROR = "error"  # processing this request failed; the engine served on

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Logprob:
    """One candidate token's log-probability, its rank (1 = most likely) and text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


#: per position: token id -> Logprob (the sampled token, plus the top-k)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` sequences, as vLLM reports it."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[PositionLogprobs]]
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: cumulative text and tokens per sequence."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Optional["RequestMetrics"] = None
    #: set when processing this request failed (its finish_reason is "error"); not in vLLM
    error: Optional[str] = None

    def add(self, later: "RequestOutput", aggregate: bool) -> None:
        """Fold a later output of the same request into this one (vLLM's ``RequestOutput.add``):
        with ``aggregate`` (DELTA outputs) each sequence's new text, tokens and logprobs are
        appended to its own; otherwise (cumulative outputs) the later sequences replace these.
        A stream whose reader fell behind then sends one chunk where the engine made several."""
        position = {completion.index: i for i, completion in enumerate(self.outputs)}
        for completion in later.outputs:
            i = position.get(completion.index)
            if i is None:
                self.outputs.append(completion)
            elif aggregate:
                mine = self.outputs[i]
                logprobs = completion.logprobs if mine.logprobs is None else mine.logprobs + (completion.logprobs or [])
                self.outputs[i] = CompletionOutput(mine.index, mine.text + completion.text,
                                                   mine.token_ids + completion.token_ids,
                                                   completion.cumulative_logprob, logprobs, completion.finish_reason,
                                                   completion.stop_reason)
            else:
                self.outputs[i] = completion
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics or self.metrics
        self.error = later.error or self.error


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of a request's life, for TTFT/TPOT and logs."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    #: draft tokens proposed for the request, and how many of them the model accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


# --- pooling (vLLM's output types of LLM.encode / classify / score) -------------------------
@dataclass
class PoolingOutput:
    """A prompt's pooled vector: a sentence embedding, or a classifier's logits."""

    data: Any


@dataclass
class PoolingRequestOutput:
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    """A classifier's label probabilities (the softmax of its logits), in label order."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    """How alike two texts are: the cosine similarity of their embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
