"""GreedyHead: greedy tokens from an int8 screen and an fp32 recheck are the fp32 logits' argmax,
in the kernel (random and planted near-ties) and in the engine against HF."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import NEW_TOKENS, PLAIN, PROMPTS, make_llm, sampler_for
from tokenmill import SamplingParams
from tokenmill.plugins.platforms.cpu.greedy_head import GreedyHead, quantize_rows
from tokenmill.plugins.platforms.cpu.kernels import cpu_kernels
from tokenmill.core.sample.sampler import SamplingRow
from tokenmill.testing.hf_reference import assert_matches_reference

TIE = 1e-5  # the project's tie rule: a divergence is allowed where the top-2 are this close

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.screened_argmax_available(),
                                reason="no C++ kernels or neither AVX512-VNNI nor AVX2 here")


def _assert_argmax(tokens: list[int], x: torch.Tensor, weight: torch.Tensor) -> None:
    """Each token is the row's argmax in fp64, or within TIE of it."""
    exact = x.double() @ weight.double().T
    best = exact.max(dim=1).values
    for m, token in enumerate(tokens):
        assert exact[m, token] >= best[m] - TIE, (
            f"row {m}: token {token} at {exact[m, token]:.8f}, argmax {int(exact[m].argmax())} at {best[m]:.8f}")


def _int8_screen(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's screened logits, in fp64: per-row int8 x times per-row int8 weight."""
    values, scales, _ = quantize_rows(weight)
    x_values, x_scales, _ = quantize_rows(x)
    return (x_scales.double()[:, None] * scales.double()[None, :]) * (x_values.double() @ values.double().T)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.sampled_from([1, 2, 3, 5, 7, 9, 12, 17]),
       hidden=st.sampled_from([8, 30, 64, 100, 512]), vocab=st.sampled_from([1, 15, 300, 4099]),
       scale=st.sampled_from([1e-3, 1.0, 40.0]), ties=st.integers(0, 12))
def test_screened_tokens_are_the_fp32_argmax(seed, rows, hidden, vocab, scale, ties):
    """Random projections (sizes not multiples of the kernel's 16 outputs, 4 inputs or 8 rows
    included), with ``ties`` rows planted as copies of row 0's best token moved by 1e-4 to
    1e-2 of each value in random directions: the screen's rounding (up to 1/254 of a row's
    largest value) reorders them often, so only a sound bound keeps the argmax."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * scale / hidden ** 0.5
    x = torch.randn(rows, hidden, generator=gen)
    best = int((x[0] @ weight.T).argmax())
    for i in range(min(ties, vocab - 1)):
        spread = 10.0 ** -float(torch.randint(2, 5, (1,), generator=gen))
        noise = torch.randn(hidden, generator=gen) * spread
        weight[(best + 1 + i) % vocab] = weight[best] * (1 + noise)
    tokens = GreedyHead(weight, kernels).tokens(x)
    assert tokens is not None and len(tokens) == rows
    _assert_argmax(tokens, x, weight)


def test_tokens_the_screen_ranks_below_others_are_still_found():
    """4096 near copies of one row (each value moved by ~3e-3): the int8 screen often ranks
    the true argmax below another token, yet the tokens are the fp32 argmax; a screen
    without its bound fails here."""
    misranked = 0
    for seed in range(12):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(1, 512, generator=gen)
        weight = torch.randn(512, generator=gen) * 0.05 * (1 + torch.randn(4096, 512, generator=gen) * 3e-3)
        exact = (x.double() @ weight.double().T)[0]
        best = int(exact.argmax())
        screen = _int8_screen(x, weight)[0]
        misranked += bool(screen[best] < screen.max())
        top2 = exact.topk(2).values
        assert top2[0] - top2[1] > TIE  # no ties: the token is determined
        assert GreedyHead(weight, kernels).tokens(x) == [best]
    assert misranked >= 6


def test_screened_tokens_equal_the_argmax_of_the_fp32_logits():
    """At the benchmark model's head shape, the very tokens of the fp32 GEMM's argmax
    (random rows have no ties at fp32 precision), with a handful of candidates per row (VNNI's
    127-level x: ~15; AVX2's 63-level x: 40-60, of 32000)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32000, 512, generator=gen) * 0.02
    head = GreedyHead(weight, kernels)
    for rows in (1, 2, 64):
        x = torch.randn(rows, 512, generator=gen)
        tokens, candidates = head.screen(x)
        assert tokens.tolist() == (x @ weight.T).argmax(dim=1).tolist()
        assert 1 <= candidates.min() and candidates.float().mean() < 100


def test_a_zero_row_takes_the_first_token():
    """All logits 0: every token is a candidate and the lowest index wins, as torch.argmax."""
    weight = torch.randn(100, 64)
    x = torch.zeros(2, 64)
    x[1] = torch.randn(64)
    assert GreedyHead(weight, kernels).tokens(x) == [0, int((x[1] @ weight.T).argmax())]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_that_is_not_finite_gives_no_tokens(bad):
    weight = torch.randn(100, 64)
    x = torch.randn(3, 64)
    x[1, 5] = bad
    assert GreedyHead(weight, kernels).tokens(x) is None


def _row(**params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [7], [8], None)


def test_argmax_only_rows():
    rows = [_row(temperature=0), _row(temperature=0, max_tokens=3)]
    assert sampler_for(rows, eos=(2,)).argmax_only(rows)
    for other in ({"temperature": 0.7}, {"temperature": 0, "logprobs": 0}, {"temperature": 0, "repetition_penalty": 1.2},
                  {"temperature": 0, "presence_penalty": 0.5}, {"temperature": 0, "min_tokens": 5},
                  {"temperature": 0, "allowed_token_ids": [3]}, {"temperature": 0, "logit_bias": {3: 1.0}}):
        rows = [_row(temperature=0), _row(**other)]
        assert not sampler_for(rows, eos=(2,)).argmax_only(rows), other


def _count_head_calls(llm, monkeypatch) -> list[int]:
    head = llm.llm_engine.runner.greedy_head
    assert head is not None
    calls = [0]
    tokens = GreedyHead.tokens

    def counted(self, hidden):
        calls[0] += 1
        return tokens(self, hidden)

    monkeypatch.setattr(GreedyHead, "tokens", counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2-tied", "gpt2", "gpt2-untied", "gemma", "mixtral-mqa-tied"])
def test_engine_greedy_tokens_come_from_the_head_and_match_hf(arch, model_dir, hf_reference, monkeypatch):
    """Greedy rows without logprobs take every token from the head (prompts and decode
    steps alike); the tokens are HF's. With logprobs the same tokens come from all logits."""
    llm = make_llm(model_dir(arch))
    calls = _count_head_calls(llm, monkeypatch)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    assert calls[0] >= NEW_TOKENS
    assert_matches_reference(hf_reference(arch), tokens)
    before = calls[0]
    with_logprobs = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, with_logprobs, use_tqdm=False)
    assert calls[0] == before
    assert [o.outputs[0].token_ids for o in outputs] == tokens


def test_a_batch_with_one_sampled_row_takes_all_logits(model_dir, monkeypatch):
    llm = make_llm(model_dir("llama"))
    calls = _count_head_calls(llm, monkeypatch)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], [greedy, sampled], use_tqdm=False)
    assert calls[0] == 0


@pytest.mark.parametrize("arch, engine_args", [
    ("llama", PLAIN),                       # every fast path off
    ("llama", {"dtype": "bfloat16"}),       # the head is bf16 already
    ("gemma2", {}),                         # a logit soft cap can round large logits to ties
    ("llama", {"small_batch_gemv": False}),  # no plain fp32 head weight kept
])
def test_no_head_where_it_would_not_apply(arch, engine_args, model_dir):
    assert make_llm(model_dir(arch), **engine_args).llm_engine.runner.greedy_head is None
