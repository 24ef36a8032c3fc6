"""Verifying draft tokens: the target model's tokens, a step's worth at a time.

A request with drafts d_1..d_k has k + 1 logits rows: row j scores the position after
d_1..d_j, and its sampling row carries that history, so penalties, min_tokens and every
logits processor see position j exactly as if d_1..d_j had been generated one at a time.
Greedy rows accept drafts while they equal the argmax and end with the argmax. Sampling
rows use the rejection sampler of Leviathan et al. (2023) and Chen et al. (2023): accept
d_j with probability min(1, p(d_j) / q(d_j)); at the first rejection draw from the
residual max(p - q, 0), normalised; after k acceptances draw a bonus token from p. Every
emitted token then follows the target distribution p exactly, whatever the drafts were.
A draft without a distribution (prompt lookup, a greedy draft model) has q one-hot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tokenmill.core.sample.sampler import Sampler, SamplingRow, gather_logprobs
from tokenmill.interfaces.types import PositionLogprobs


@dataclass(frozen=True, slots=True)
class Verified:
    """What one request's rows yielded: the accepted drafts and one token of the target's."""

    token_ids: list[int]
    #: per emitted token, its logprobs (None: not requested)
    logprobs: list[Optional[PositionLogprobs]]


def accept_greedy(targets: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The target's tokens up to and including the first that differs from the draft."""
    for j, draft in enumerate(drafts):
        if targets[j] != draft:
            return list(targets[:j + 1])
    return list(targets[:len(drafts) + 1])


def row_starts(drafts: Sequence[Sequence[int]]) -> list[int]:
    """Each request's first row, and the end: a request with k drafts has k + 1 rows."""
    starts = [0]
    for request_drafts in drafts:
        starts.append(starts[-1] + len(request_drafts) + 1)
    return starts


def verify(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow],
           drafts: Sequence[Sequence[int]],
           draft_probs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> list[Verified]:
    """``logits``/``rows``: len(drafts[i]) + 1 consecutive rows per request i, in order.
    ``draft_probs[i]``: [len(drafts[i]), vocab], the distribution each draft was drawn
    from (None: one-hot at the draft)."""
    want_logprobs = any(row.params.logprobs is not None for row in rows)
    processed, greedy = sampler.process(logits, rows)
    reported = sampler.reported(logits, processed) if want_logprobs else None
    starts = row_starts(drafts)
    tokens: list[list[int]] = [[] for _ in drafts]
    sampled = [i for i in range(len(drafts)) if not greedy[starts[i]]]
    if len(sampled) < len(drafts):
        targets = processed.argmax(dim=-1).tolist()
        for i in range(len(drafts)):
            if greedy[starts[i]]:
                tokens[i] = accept_greedy(targets[starts[i]:starts[i + 1]], drafts[i])
    if sampled:
        _rejection_sample(sampler, processed, rows, drafts, draft_probs, starts, sampled, tokens)
    verified = []
    for i, request_tokens in enumerate(tokens):
        k = rows[starts[i]].params.logprobs
        logprobs: list[Optional[PositionLogprobs]] = [None] * len(request_tokens)
        if reported is not None and k is not None:
            logprobs = gather_logprobs(reported[starts[i]:starts[i] + len(request_tokens)],
                                       torch.tensor(request_tokens, dtype=torch.long, device=logits.device),
                                       [k] * len(request_tokens))
        verified.append(Verified(request_tokens, logprobs))
    return verified


def _rejection_sample(sampler: Sampler, processed: torch.Tensor, rows: Sequence[SamplingRow],
                      drafts: Sequence[Sequence[int]], draft_probs: Optional[Sequence[Optional[torch.Tensor]]],
                      starts: list[int], requests: list[int], tokens: list[list[int]]) -> None:
    """Fill ``tokens[i]`` for the sampling requests: the acceptance tests of all their drafts
    at once, then one draw each, from a residual or from the bonus row."""
    probs = processed.softmax(dim=-1)
    draft_rows = [starts[i] + j for i in requests for j in range(len(drafts[i]))]
    draft_tokens = [t for i in requests for t in drafts[i]]
    p_draft = probs[draft_rows, draft_tokens].tolist() if draft_rows else []
    # the uniforms: a seeded request's from its own generator, the others' in one draw
    generators = [rows[starts[i]].generator for i in requests]
    unseeded = sum(len(drafts[i]) for i, g in zip(requests, generators) if g is None)
    shared = iter(torch.rand(unseeded, generator=sampler.generator, dtype=torch.float64).tolist())
    final_rows, residual_of = [], []
    position = 0
    for i, generator in zip(requests, generators):
        k = len(drafts[i])
        uniforms = (torch.rand(k, generator=generator, dtype=torch.float64,
                               device=sampler.seeded_device(probs.device)).tolist() if generator and k else None)
        q = draft_probs[i] if draft_probs is not None else None
        q_draft = q[torch.arange(k), torch.tensor(list(drafts[i]))].tolist() if q is not None and k else [1.0] * k
        rejected = None
        for j in range(k):
            u = uniforms[j] if uniforms is not None else next(shared)
            if u * q_draft[j] < p_draft[position + j]:  # u < p / q, without dividing by q
                tokens[i].append(drafts[i][j])
            else:
                rejected = j
                break
        position += k
        final_rows.append(starts[i] + (k if rejected is None else rejected))
        residual_of.append(None if rejected is None else (i, rejected))
    final = probs[final_rows]
    for row, residual in enumerate(residual_of):
        if residual is None:
            continue
        i, j = residual
        q = draft_probs[i] if draft_probs is not None else None
        if q is None:
            final[row, drafts[i][j]] = 0.0
        else:
            final[row] = (final[row] - q[j]).clamp_min(0.0)
        if not final[row].sum() > 0:  # p <= q everywhere: p == q up to rounding
            final[row] = probs[final_rows[row]]
    final = final / final.sum(dim=-1, keepdim=True)
    for i, token in zip(requests, sampler.draw(final, generators).tolist()):
        tokens[i].append(token)
