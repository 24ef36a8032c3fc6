"""The LogitsProcessor contract: batch-wide edits of the logits before sampling.

Shaped after vLLM V1's (``vllm/v1/sample/logits_processor``). The model runner
keeps a persistent batch of sampling rows; a processor keeps per-row state and
is told only what changed between steps (rows removed, moved, added), so a
long-running request is set up once, not every step. ``apply`` then edits the
logits of the whole batch at once.

Built-ins (``min_tokens``, ``logit_bias``, ``allowed_token_ids``, ``bad_words``)
are processors on this contract. Third parties register theirs through the
``register_logits_processors`` hook and an engine selects them by name or class
path in ``logits_processors: [...]``; their per-request arguments arrive in
``SamplingParams.extra_args`` (``vllm_xargs`` on the wire).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch

from tokenmill.interfaces.sampling_params import SamplingParams

T = TypeVar("T")


def on_device(device: torch.device, values: Sequence | torch.Tensor, dtype: Optional[torch.dtype] = None
              ) -> torch.Tensor:
    """Host values (a list, or a host tensor) on ``device``, without waiting for it. A plain
    ``torch.tensor(..., device=)``, a ``.to(device)`` without ``non_blocking``, or a list used
    to index a device tensor is a blocking copy: on a GPU it waits for every kernel queued
    before it (the step's forward pass), and with async scheduling the host cannot prepare the
    next step meanwhile. Processors build their index and value tensors with this."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return tensor.to(device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class LogitsProcessorContext:
    """What a processor is built with: facts about the engine it serves."""

    vocab_size: int
    #: EOS ids of the model (a request's stop tokens are these, unless ignore_eos, plus stop_token_ids)
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int
    device: torch.device
    #: the model's tokenizer (Hugging Face), for processors whose arguments are text
    tokenizer: Any


@dataclass(frozen=True, slots=True)
class AddedRow:
    """A request that (re)joined the batch at ``index``."""

    index: int
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    #: the request's generated tokens: a live list that the runner extends after every step and
    #: that only grows while the row stays; read it, never change it
    output_token_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class BatchUpdate:
    """How this step's batch differs from the last one's.

    Apply in this order: drop ``removed`` (indices in the last batch), move ``moved``
    (last index -> new index), then add ``added`` (indices in the new batch). Rows not
    named keep their index. A request that leaves and comes back (preemption) is
    removed, then added again with its history.
    """

    batch_size: int
    removed: tuple[int, ...] = ()
    moved: tuple[tuple[int, int], ...] = ()
    added: tuple[AddedRow, ...] = ()

    def apply_to(self, rows: dict[int, T], make: Callable[[AddedRow], Optional[T]]) -> None:
        """Re-key a processor's ``{row index: state}`` in place; ``make`` gives an added row's
        state, or None when the processor has nothing to do for it."""
        for index in self.removed:
            rows.pop(index, None)
        moving = [(new, rows.pop(old)) for old, new in self.moved if old in rows]
        for _, new in self.moved:
            rows.pop(new, None)
        rows.update(moving)
        for row in self.added:
            state = make(row)
            if state is None:
                rows.pop(row.index, None)
            else:
                rows[row.index] = state


class LogitsProcessor(ABC):
    """Edits ``logits`` [batch, vocab] float32 before sampling.

    Logprobs are reported from the raw logits, before any processor. A processor
    that can change which token is the argmax runs before penalties and greedy
    sampling; one that cannot (``is_argmax_invariant``) runs only for sampled rows,
    after temperature, so a greedy batch never pays for it.
    """

    def __init__(self, context: LogitsProcessorContext) -> None:
        self.context = context

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Refuse a request's arguments at admission (raise ``InvalidRequest`` or ``ValueError``),
        so that a bad value is the caller's 400, not a failure at every step. Called for every
        request, so a request that does not use this processor (its argument absent) must pass."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """Whether ``apply`` never changes the largest logit of a row. Read once, when the
        sampler is built: the answer must not change."""

    def applies_to(self, params: SamplingParams) -> bool:
        """Whether a request with these parameters may get state here (its argument is set).
        While no row of a batch applies to any processor, and none did in the last batch they
        were told of, the processors are told nothing: a batch of plain requests, and the draft
        rows of a speculative verify step (new rows every step), cost no bookkeeping. True, the
        default, is always safe: the processor then hears of every row."""
        return True

    @abstractmethod
    def update_state(self, update: Optional[BatchUpdate]) -> None:
        """Follow the batch; ``None`` when it did not change since the last step."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The edited logits, same shape and dtype (in place or a new tensor)."""

    @abstractmethod
    def is_active(self) -> bool:
        """Whether any row of the current batch is affected; an inactive processor is not
        applied, and a greedy batch keeps the platform's argmax fast path. Abstract, because
        a processor that always said yes would cost every greedy batch that fast path."""
