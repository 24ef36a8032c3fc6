"""The speculative proposer contract: cheap guesses of a request's next tokens.

After each step the engine asks the configured proposer for up to
``max_draft_tokens`` tokens per decoding request. The next step feeds them to the
target model after the request's last token and scores every position in the same
forward pass; the runner keeps the longest prefix the target agrees with (the
rejection sampler, for sampled requests) plus one token of the target's own. A
proposer therefore cannot change what a request generates, only how many tokens a
step yields: a bad guess costs one wasted position, never a wrong token.

Proposers are registered with ``register_speculative_proposers(register)`` and
selected by ``speculative: {method: name}``; built as ``cls(context)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """One decoding request, as a proposer sees it."""

    request_id: str
    #: prompt and generated tokens so far (read-only; the last one has no KV yet)
    token_ids: Sequence[int]
    #: the request's KV blocks: a draft model writes its own cache at the same blocks
    block_ids: Sequence[int]
    #: at most this many drafts (num_speculative_tokens, fewer near max_tokens or max_model_len)
    max_draft_tokens: int


@dataclass(frozen=True, slots=True)
class ForwardRow:
    """One request's tokens for a forward pass of a proposer's model."""

    token_ids: Sequence[int]
    #: tokens before these whose KV is already in the cache
    num_computed_tokens: int
    block_ids: Sequence[int]


class ProposerModel(Protocol):
    """A model loaded by the engine for a proposer: the engine's platform, dtype and
    attention backend, with its own KV cache over the engine's block layout."""

    vocab_size: int

    def greedy_decode(self, rows: Sequence[ForwardRow], num_tokens: Sequence[int]) -> list[list[int]]:
        """Run ``rows`` (writing their KV), then decode greedily from each: ``num_tokens[i]``
        tokens for row ``i`` (at least 1: its argmax next token first), each fed back at the
        position after the last. The passes chain on the model's device and the tokens are
        read back once, at the end: the host builds each pass while the one before it runs."""


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer is built with."""

    num_speculative_tokens: int
    #: the whole ``speculative`` section (method-specific keys such as prompt_lookup_max,
    #: and ``proposer_config`` for a plugin's own options)
    options: Mapping[str, Any]
    vocab_size: int
    max_model_len: int
    #: loads a checkpoint directory as a ProposerModel (the draft_model proposer's draft)
    load_model: Callable[[str], ProposerModel]
    #: tokens per KV block
    block_size: int = 16


class SpeculativeProposer(ABC):
    """Proposes draft tokens. Runs on the engine's process, between steps."""

    def __init__(self, context: ProposerContext) -> None:
        self.context = context

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots the scheduler reserves past a request's tokens, for a proposer that writes
        KV of its own for its drafts (a draft model); 0 for one that only reads tokens."""
        return 0

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Drafts for each request (at most its ``max_draft_tokens``; empty: none this step)."""

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests finished, or were preempted (their KV is gone): drop their state."""

    def describe(self) -> Optional[dict[str, Any]]:
        """What to log at startup about this proposer."""
        return None
