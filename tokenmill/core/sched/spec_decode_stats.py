"""Counters of speculative decoding, as vLLM reports them: drafts proposed, draft tokens,
tokens accepted, and acceptances by position (how far into a draft the target agrees)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class SpecDecodingStats:
    #: verifications of a request's drafts (vLLM: spec_decode_num_drafts)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    #: [j]: drafts whose token j was accepted (vLLM: spec_decode_num_accepted_tokens_per_pos)
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def snapshot(self) -> "SpecDecodingStats":
        return replace(self, accepted_per_position=list(self.accepted_per_position))

    def since(self, earlier: "SpecDecodingStats") -> "SpecDecodingStats":
        """What was counted after ``earlier`` (a snapshot of these counters)."""
        before = earlier.accepted_per_position + [0] * len(self.accepted_per_position)
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts,
                                 self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens,
                                 [count - before[j] for j, count in enumerate(self.accepted_per_position)])

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
