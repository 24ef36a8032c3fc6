"""Sampler invariants: every filter keeps its promise, seeds are per request, penalties are exact."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import sampler_for
from tokenmill.core.sample.sampler import Sampler, SamplingRow
from tokenmill.interfaces.errors import InvalidRequest
from tokenmill.interfaces.sampling_params import SamplingParams

VOCAB = 50


def row(params: SamplingParams, output=(), prompt=(1,), generator=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator)


def logits_from(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, VOCAB))
def test_top_k_samples_stay_in_the_top_k(seed, k):
    """A top-k sample is always among the k largest logits."""
    logits = logits_from(seed)
    tokens, _ = Sampler(seed)(logits, [row(SamplingParams(temperature=1.5, top_k=k))])
    assert tokens[0] in logits[0].topk(k).indices.tolist()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), p=st.floats(0.05, 1.0))
def test_top_p_samples_stay_in_the_nucleus(seed, p):
    """A top-p sample is in the smallest prefix of sorted tokens whose mass reaches p."""
    logits = logits_from(seed)
    tokens, _ = Sampler(seed)(logits, [row(SamplingParams(temperature=1.0, top_p=p))])
    probs, order = logits[0].softmax(-1).sort(descending=True)
    cumulative = probs.cumsum(0)
    nucleus_size = int((cumulative < p - 1e-6).sum()) + 1
    assert tokens[0] in order[:nucleus_size].tolist()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), min_p=st.floats(0.0, 1.0))
def test_min_p_samples_are_likely_enough(seed, min_p):
    """A min-p sample has probability at least min_p times the top token's."""
    logits = logits_from(seed)
    tokens, _ = Sampler(seed)(logits, [row(SamplingParams(temperature=1.0, min_p=min_p))])
    probs = logits[0].softmax(-1)
    assert probs[tokens[0]] >= min_p * probs.max() - 1e-6


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_greedy_is_argmax_and_logprobs_are_raw(seed):
    """temperature=0 picks the argmax; logprobs are the raw log-softmax with correct ranks."""
    logits = logits_from(seed, rows=3)
    tokens, logprobs = Sampler(0)(logits, [row(SamplingParams(temperature=0, logprobs=3))] * 3)
    assert tokens == logits.argmax(-1).tolist()
    reference = logits.log_softmax(-1)
    for i, entry in enumerate(logprobs):
        assert entry[tokens[i]].rank == 1
        top = reference[i].topk(3)
        for rank, (value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            assert entry[token].rank == rank
            assert math.isclose(entry[token].logprob, value, abs_tol=1e-6)


def test_seeded_rows_do_not_depend_on_the_batch():
    """The same seed gives the same draws whether its row is alone or among others."""
    logits = logits_from(1, rows=4)
    params = SamplingParams(temperature=1.0, seed=7)

    def draws(batch_rows, index):
        generator = torch.Generator().manual_seed(7)
        out = []
        for _ in range(5):
            rows = [row(SamplingParams(temperature=1.0)) for _ in range(batch_rows)]
            rows[index] = row(params, generator=generator)
            tokens, _ = Sampler(123)(logits[:batch_rows], rows)
            out.append(tokens[index])
        return out

    alone = draws(1, 0)
    assert draws(4, 0) == alone
    assert len(set(alone)) > 1  # really sampling, not greedy


def test_repetition_presence_and_frequency_penalties_are_exact():
    """Penalties follow vLLM/HF: divide positive / multiply negative seen logits; subtract counts."""
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    sampler = Sampler(0)
    penalised = sampler._apply_penalties(
        logits, [row(SamplingParams(repetition_penalty=2.0), output=[1], prompt=[0])])
    assert penalised.tolist() == [[1.0, -4.0, 1.0, 0.5, 3.0]]
    penalised = sampler._apply_penalties(
        logits, [row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), output=[4, 4, 2])])
    assert penalised.tolist() == [[2.0, -2.0, 0.25, 0.5, 2.0]]


def test_penalties_batched_equal_penalties_row_by_row():
    """The batched penalties give each row what it gets alone, whatever else is in the batch."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g)
    rows = [row(SamplingParams(repetition_penalty=1.7), output=[3, 3, 9], prompt=[1, 2, 3]),
            row(SamplingParams(), output=[5]),
            row(SamplingParams(presence_penalty=0.4, frequency_penalty=-0.3), output=[7, 7, 7, 8], prompt=[8]),
            row(SamplingParams(repetition_penalty=0.6, frequency_penalty=1.1), output=[], prompt=[0, 39]),
            row(SamplingParams(presence_penalty=2.0), output=[39, 0, 39]),
            row(SamplingParams(repetition_penalty=1.2, presence_penalty=0.1), output=[10], prompt=[10, 11])]
    sampler = Sampler(0)  # one sampler: the prompts it keeps on the device from one call serve the next
    batched = sampler._apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        assert torch.equal(batched[i], sampler._apply_penalties(logits[i:i + 1], [r])[0])
    assert torch.equal(batched[1], logits[1])  # no penalty: untouched
    assert not torch.equal(batched[0], logits[0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 11), max_size=5), st.booleans()),
                min_size=1, max_size=30))
def test_kept_token_ids_follow_growing_lists_and_drafted_histories(steps):
    """The device ids kept under each list are the list's, call after call, as
    lists grow (by any number of ids), start over (a new list, or one cut in place), skip a
    call, or come with drafts appended (a verify step's rows)."""
    from tokenmill.core.sample.drafted_history import DraftedHistory
    from tokenmill.core.sample.device_tokens import DeviceTokens

    kept, lists = DeviceTokens(), [[], [], [], []]
    for which, grown, drafted in steps:
        lists[which].extend(grown)
        if not grown and drafted:
            lists[which] = list(lists[which])  # the same ids under a new list
        elif not grown:
            del lists[which][len(lists[which]) // 2:]  # cut in place (no request's output is)
        rows = [DraftedHistory(tokens, [which, 11]) if drafted else tokens for tokens in lists[:which + 1]]
        row_of, ids = kept.ids(rows, torch.device("cpu"))
        assert [ids[row_of == i].tolist() for i in range(len(rows))] == [list(tokens) for tokens in rows]


def test_logit_bias_is_added_before_sampling_and_logprobs_stay_raw():
    """OpenAI's logit_bias: +100 makes a token certain, -100 rules it out; reported logprobs are
    those of the raw logits, as vLLM reports them."""
    logits = logits_from(3)
    raw = logits.log_softmax(-1)
    best = int(logits.argmax())
    forced = [row(SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=0))]
    tokens, logprobs = sampler_for(forced)(logits, forced)
    assert tokens == [7] and logprobs[0][7].logprob == pytest.approx(float(raw[0, 7]))
    banned = [row(SamplingParams(temperature=0, logit_bias={best: -100.0}))]
    tokens, _ = sampler_for(banned)(logits, banned)
    assert tokens == [int(logits[0].clone().index_fill_(0, torch.tensor([best]), -1e9).argmax())]
    sampled = [row(SamplingParams(temperature=1.0, logit_bias={11: 100.0}, seed=1),
                   generator=torch.Generator().manual_seed(1))]
    assert sampler_for(sampled)(logits, sampled)[0] == [11]
    assert not sampler_for(banned).argmax_only(banned)
    assert sampler_for([row(SamplingParams(temperature=0))]).argmax_only([row(SamplingParams(temperature=0))])


def test_temperatures_below_epsilon_are_greedy():
    """vLLM's rule: a temperature under 1e-5 is greedy (dividing by it overflows to inf / NaN)."""
    for temperature in (1e-6, 1e-40, 5e-324):
        assert SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(temperature=2).temperature == 2.0 and isinstance(SamplingParams(temperature=2).temperature,
                                                                           float)


def test_min_tokens_masks_stop_tokens_until_reached():
    """Before min_tokens outputs exist, EOS and stop tokens cannot be sampled."""
    logits = torch.tensor([[0.0, 10.0, 1.0]])
    rows = [row(SamplingParams(temperature=0, min_tokens=2), output=[2])]
    sampler = sampler_for(rows, eos=(1,))
    assert sampler(logits, rows)[0] == [2]
    rows[0].output_token_ids.append(2)  # the runner extends the live history after each step
    assert sampler(logits, rows)[0] == [1]


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("min_p", 1.5),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("max_tokens", 0), ("n", 0), ("logprobs", 21), ("prompt_logprobs", -1), ("min_tokens", -1),
    ("stop", [""]), ("stop_token_ids", [-3]), ("seed", 1.5), ("n", True),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("temperature", float("nan")), ("top_p", float("inf")),
    ("repetition_penalty", float("inf")), ("temperature", 10**400), ("logit_bias", {3: 100.5}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {3: float("nan")}), ("spaces_between_special_tokens", False),
    ("temperature", 1e39), ("repetition_penalty", 1e-46), ("top_p", 5e-324 * -1),
    ("stop", [f"s{i}" for i in range(65)]), ("stop", ["x" * 1025]), ("stop_token_ids", list(range(1025))),
])
def test_out_of_range_parameters_name_the_parameter(field, value):
    """Every bad sampling parameter fails at construction with its name in the error."""
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_stop_lists_at_their_bounds_are_accepted():
    params = SamplingParams(stop=["x" * 1024] + [f"s{i}" for i in range(63)], stop_token_ids=list(range(1024)))
    assert len(params.stop) == SamplingParams.MAX_STOP_STRINGS


def test_min_tokens_above_max_tokens_is_rejected():
    """min_tokens > max_tokens can never be satisfied."""
    with pytest.raises(InvalidRequest, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_unseeded_noise_comes_from_the_noise_generator_and_seeded_rows_from_their_own():
    """Unseeded rows draw from the platform's noise generator (the device's), not the host
    generator the engine seed also seeds; a seeded row's draws do not depend on either."""
    logits = logits_from(2, rows=4)
    params = SamplingParams(temperature=1.0)

    def tokens(host_seed, noise_seed, request_seed):
        sampler = Sampler(host_seed, noise_generator=torch.Generator().manual_seed(noise_seed))
        rows = [row(params), row(params, generator=torch.Generator().manual_seed(request_seed)), row(params),
                row(params)]
        return [sampler(logits, rows)[0] for _ in range(6)]

    first = tokens(0, 5, 9)
    assert tokens(1, 5, 9) == first  # the host generator draws none of it
    other_noise = tokens(0, 6, 9)
    assert [t[1] for t in other_noise] == [t[1] for t in first]  # the seeded row: its own generator
    assert [t[0] for t in other_noise] != [t[0] for t in first]


def test_sampling_noise_is_drawn_on_the_logits_device():
    """Under the CUDA stand-in (where a host tensor in device arithmetic raises, and so does a
    host generator drawing into a device tensor, as on a GPU), a batch of unseeded and seeded
    rows samples on the device what the host computes with generators seeded alike."""
    from tokenmill.testing.fake_cuda import device_generator, fake_cuda

    logits = logits_from(3, rows=4)
    params = SamplingParams(temperature=1.0)

    def sample(device):
        generator = device_generator if device == "cuda" else lambda seed: torch.Generator().manual_seed(seed)
        sampler = Sampler(0, noise_generator=generator(4))
        rows = [row(params), row(params, generator=generator(8)), row(params), row(params)]
        return [sampler(logits.to(device), rows)[0] for _ in range(3)]

    expected = sample("cpu")
    with fake_cuda():
        assert sample("cuda") == expected
