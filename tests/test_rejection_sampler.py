"""The rejection sampler's outputs follow the target distribution whatever the drafts are.

Each case draws 20,000 verifications of the same position in one batch and compares the
emitted tokens' frequencies with the target distribution by a chi-square statistic. The
bound is the 0.999 quantile of chi-square with (support - 1) degrees of freedom, so a
correct sampler fails a case about once in a thousand runs (the seeds are fixed, so the
test itself is deterministic); a sampler off by 2% of mass in one cell exceeds it.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.core.sample.rejection_sampler import accept_greedy, verify
from tokenmill.core.sample.sampler import Sampler, SamplingRow

DRAWS = 20_000
#: 0.999 quantiles of chi-square by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def chi_square(samples: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the cells the target gives mass; a sample
    outside the target's support fails at once."""
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled tokens the target never gives: {counts}"
    expected = probs[support].double() * len(samples)
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def run(target_rows: torch.Tensor, drafts: list[int] | None, q: torch.Tensor | None, draws: int = DRAWS,
        seed: int = 0):
    """``draws`` requests verifying drafts against the same target rows: ``drafts`` for every
    request, or (None) one draft each, drawn from ``q`` as a draft model would."""
    params = SamplingParams(temperature=1.0)
    if drafts is None:
        sampled = torch.multinomial(q[0], draws, replacement=True, generator=torch.Generator().manual_seed(seed + 1))
        per_request = [[t] for t in sampled.tolist()]
    else:
        per_request = [drafts] * draws
    rows = [SamplingRow(params, (), (), None)] * (draws * len(target_rows))
    logits = target_rows.log().repeat(draws, 1)
    return per_request, verify(Sampler(seed), logits, rows, per_request, None if q is None else [q] * draws)


P0 = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1, 0.0])
P1 = torch.tensor([0.3, 0.0, 0.1, 0.1, 0.5, 0.0])


def test_draft_equal_to_target_is_always_accepted():
    """q = p: every draft is accepted (u * q < p for every u < 1), and the drafts, drawn from
    q, follow p; the bonus token follows the next row."""
    drafts, results = run(torch.stack([P0, P1]), None, P0.unsqueeze(0))
    assert all(len(v.token_ids) == 2 and v.token_ids[0] == d[0] for d, v in zip(drafts, results))
    statistic, dof = chi_square([v.token_ids[0] for v in results], P0)
    assert statistic < CHI2_999[dof]
    statistic, dof = chi_square([v.token_ids[1] for v in results], P1)
    assert statistic < CHI2_999[dof]


@pytest.mark.parametrize("case", ["one-hot draft", "disjoint supports", "near-zero target mass",
                                  "q above p on the draft"])
def test_emitted_tokens_follow_the_target(case):
    """The first emitted token follows p at position 0; when the draft was accepted, the next
    one follows p at position 1 (the bonus row)."""
    target = torch.stack([P0, P1])
    if case == "one-hot draft":  # prompt lookup: q is a point mass at the draft
        draft, q = 2, None
    elif case == "disjoint supports":  # q only where p is 0: never accepted
        draft, q = 5, torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    elif case == "near-zero target mass":
        target = torch.stack([torch.tensor([1e-6, 0.5, 0.3, 0.2 - 1e-6, 0.0, 0.0]), P1])
        draft, q = 0, None
    else:  # a draft model's q, drawn from: more mass than p on token 1, less on 2 and 3
        draft, q = None, torch.tensor([[0.0, 0.8, 0.1, 0.1, 0.0, 0.0]])
    drafts, results = run(target, None if draft is None else [draft], q)
    first = [v.token_ids[0] for v in results]
    statistic, dof = chi_square(first, target[0])
    assert statistic < CHI2_999[dof], (case, statistic)
    accepted = [v.token_ids[1] for v in results if len(v.token_ids) == 2]
    if case == "disjoint supports":
        assert not accepted
    elif accepted:
        assert all(v.token_ids[0] == d[0] for d, v in zip(drafts, results) if len(v.token_ids) == 2)
        if len(accepted) > 1000:
            statistic, dof = chi_square(accepted, target[1])
            assert statistic < CHI2_999[dof], (case, statistic)


def test_two_drafts_emit_the_sequential_distribution():
    """With two drafts, the emitted sequence is distributed as if sampled one token at a time:
    position 0 follows row 0, position 1 (given the first draft was accepted) row 1."""
    p2 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2, 0.0])
    _, results = run(torch.stack([P0, P1, p2]), [1, 4], None)
    statistic, dof = chi_square([v.token_ids[0] for v in results], P0)
    assert statistic < CHI2_999[dof]
    second = [v.token_ids[1] for v in results if len(v.token_ids) > 1]
    statistic, dof = chi_square(second, P1)
    assert statistic < CHI2_999[dof]
    third = [v.token_ids[2] for v in results if len(v.token_ids) > 2]
    statistic, dof = chi_square(third, p2)
    assert statistic < CHI2_999[dof]
    # acceptance of the first draft is p0(1) = 0.4; of the second, given the first, p1(4) = 0.5
    assert abs(len(second) / DRAWS - 0.4) < 0.02 and abs(len(third) / len(second) - 0.5) < 0.03


def test_seeded_rows_are_reproducible_whatever_else_is_batched():
    params = SamplingParams(temperature=0.8, seed=7)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def once(extra_rows: int):
        generator = torch.Generator().manual_seed(7)
        rows = [SamplingRow(params, (), (), generator)] * 3
        rows += [SamplingRow(SamplingParams(temperature=1.0), (), (), None)] * extra_rows
        batch_logits = torch.cat([logits, torch.randn(extra_rows, 50)])
        drafts = [[3, 9]] + [[]] * extra_rows
        return verify(Sampler(extra_rows), batch_logits, rows, drafts)[0].token_ids

    assert once(0) == once(5) == once(2)


def test_greedy_rows_accept_the_matching_prefix_and_end_with_the_target():
    assert accept_greedy([4, 7, 2, 9], [4, 7, 2]) == [4, 7, 2, 9]
    assert accept_greedy([4, 7, 2, 9], [4, 8, 2]) == [4, 7]
    assert accept_greedy([5], []) == [5]
    sampler = Sampler(0)
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0.0, logprobs=1)
    rows = [SamplingRow(greedy, (), (), None)] * 3
    (result,) = verify(sampler, logits, rows, [[1, 2]])
    assert result.token_ids == [1, 0]  # the second draft (2) is not row 1's argmax (0)
    assert [sorted(entry) for entry in result.logprobs] == [[1], [0]]
    assert result.logprobs[1][0].logprob == pytest.approx(float(logits[1].log_softmax(0)[0]))
