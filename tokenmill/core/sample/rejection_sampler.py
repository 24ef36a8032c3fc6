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

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tokenmill.core.sample.sampler import LogprobValues, Sampler, SamplingRow
from tokenmill.interfaces.logits_processor import on_device
from tokenmill.interfaces.outputs import PositionLogprobs


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
    from (None: one-hot at the draft). The host reads the device a fixed number of times
    whatever the batch (on a GPU each read waits for every kernel queued before it)."""
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
    if reported is None:
        return [Verified(request_tokens, [None] * len(request_tokens)) for request_tokens in tokens]
    logprobs = _emitted_logprobs(reported, rows, starts, tokens)
    return [Verified(request_tokens, request_logprobs) for request_tokens, request_logprobs in zip(tokens, logprobs)]


def _emitted_logprobs(reported: torch.Tensor, rows: Sequence[SamplingRow], starts: list[int],
                      tokens: list[list[int]]) -> list[list[Optional[PositionLogprobs]]]:
    """Each request's logprobs of its emitted tokens (None where it asked for none), the
    requests' rows gathered into one batch: one read back for all of them."""
    wanted = [rows[starts[i]].params.logprobs for i in range(len(tokens))]
    row_index = [starts[i] + j for i, k in enumerate(wanted) if k is not None for j in range(len(tokens[i]))]
    token_ids = [t for i, k in enumerate(wanted) if k is not None for t in tokens[i]]
    ks = [k for i, k in enumerate(wanted) if k is not None for _ in tokens[i]]
    device = reported.device
    entries = iter(LogprobValues.of(reported[on_device(device, row_index, torch.long)],
                                    on_device(device, token_ids, torch.long), ks).entries(token_ids, ks)
                   if row_index else ())
    return [[next(entries) for _ in request_tokens] if k is not None else [None] * len(request_tokens)
            for request_tokens, k in zip(tokens, wanted)]


def _rejection_sample(sampler: Sampler, processed: torch.Tensor, rows: Sequence[SamplingRow],
                      drafts: Sequence[Sequence[int]], draft_probs: Optional[Sequence[Optional[torch.Tensor]]],
                      starts: list[int], requests: list[int], tokens: list[list[int]]) -> None:
    """Fill ``tokens[i]`` for the sampling requests: the acceptance tests of all their drafts
    at once (p and q of every draft, and the seeded requests' uniforms, read back together),
    then one draw each, from a residual or from the bonus row."""
    probs = processed.softmax(dim=-1)
    device = probs.device
    lengths = [len(drafts[i]) for i in requests]
    total = sum(lengths)
    generators = [rows[starts[i]].generator for i in requests]
    q_of = [None if draft_probs is None else draft_probs[i] for i in requests]
    # what the tests read: p(d_j), q(d_j) (1 where the draft is one-hot), the seeded uniforms
    draft_rows = [starts[i] + j for i in requests for j in range(len(drafts[i]))]
    draft_tokens = [t for i in requests for t in drafts[i]]
    p_draft = probs[on_device(device, draft_rows, torch.long), on_device(device, draft_tokens, torch.long)]
    q_draft = torch.ones(total, dtype=probs.dtype, device=device)
    with_q = [(offset, q, i) for offset, q, i in zip(itertools.accumulate([0] + lengths), q_of, requests)
              if q is not None and drafts[i]]
    if with_q:
        positions = [offset + j for offset, _, i in with_q for j in range(len(drafts[i]))]
        q_rows = torch.cat([q for _, q, _ in with_q])
        q_tokens = on_device(device, [t for _, _, i in with_q for t in drafts[i]], torch.long)
        q_draft[on_device(device, positions, torch.long)] = q_rows[torch.arange(len(positions), device=device),
                                                                    q_tokens].to(probs.dtype)
    seeded_device = sampler.seeded_device(device)
    uniforms = [torch.rand(k, generator=g, dtype=torch.float64, device=seeded_device).to(device, non_blocking=True)
                for k, g in zip(lengths, generators) if g is not None and k]
    read = torch.cat([p_draft.double(), q_draft.double(), *uniforms]).tolist()
    p_values, q_values, seeded = read[:total], read[total:2 * total], iter(read[2 * total:])
    # the others' uniforms in one draw of the engine's generator
    unseeded = sum(k for k, g in zip(lengths, generators) if g is None)
    shared = iter(torch.rand(unseeded, generator=sampler.generator, dtype=torch.float64).tolist())
    final_rows, one_hot, residual_q = [], [], []
    position = 0
    for n, (i, k, generator, q) in enumerate(zip(requests, lengths, generators, q_of)):
        rejected = None
        for j in range(k):
            u = next(seeded) if generator is not None else next(shared)
            if u * q_values[position + j] < p_values[position + j]:  # u < p / q, without dividing by q
                tokens[i].append(drafts[i][j])
            else:
                rejected = j
                break
        position += k
        final_rows.append(starts[i] + (k if rejected is None else rejected))
        if rejected is not None and q is None:
            one_hot.append((n, drafts[i][rejected]))
        elif rejected is not None:
            residual_q.append((n, q[rejected]))
    target = probs[on_device(device, final_rows, torch.long)]
    final = target.clone()
    # a rejection draws from the residual max(p - q, 0): p without the draft where q is one-hot
    if one_hot:
        final[on_device(device, [n for n, _ in one_hot], torch.long),
              on_device(device, [t for _, t in one_hot], torch.long)] = 0.0
    if residual_q:
        index = on_device(device, [n for n, _ in residual_q], torch.long)
        final[index] = (final[index] - torch.stack([q for _, q in residual_q]).to(final.dtype)).clamp_min(0.0)
    # p <= q everywhere (p == q up to rounding): the row's p itself
    final = torch.where(final.sum(dim=-1, keepdim=True) > 0, final, target)
    final = final / final.sum(dim=-1, keepdim=True)
    for i, token in zip(requests, sampler.draw(final, generators).tolist()):
        tokens[i].append(token)
