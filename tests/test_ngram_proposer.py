"""Prompt lookup's drafts, against the definition written out by brute force: the longest n in
[prompt_lookup_min, prompt_lookup_max] whose last-n-token pattern occurred earlier, its earliest
occurrence, and the k tokens after it; across steps of a growing request, as the engine calls it.
Prompts of 64 tokens and more are indexed as arrays unless a vocabulary of 2**40 makes patterns
too wide for int64; then token by token, which must index the same."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.interfaces.speculative import DraftRequest, ProposerContext
from tokenmill.plugins.speculative.ngram import NgramProposer


def proposer(min_n: int, max_n: int, vocab_size: int = 8) -> NgramProposer:
    return NgramProposer(ProposerContext(num_speculative_tokens=4, vocab_size=vocab_size, max_model_len=4096,
                                         load_model=lambda path: None,
                                         options={"prompt_lookup_min": min_n, "prompt_lookup_max": max_n}))


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    end = len(tokens) - 1
    for n in range(max_n, min_n - 1, -1):
        for i in range(n - 1, end):  # an earlier occurrence ending at i
            if tokens[i - n + 1:i + 1] == tokens[end - n + 1:end + 1]:
                return tokens[i + 1:i + 1 + k]
    return []


lookup_bounds = st.integers(1, 4).flatmap(lambda low: st.tuples(st.just(low), st.integers(low, low + 3)))


def short_or_prompt_long(alphabet: int, long: tuple[int, int]) -> st.SearchStrategy[list[int]]:
    """Hypothesis draws short lists mostly: the long ones are asked for on their own."""
    tokens = st.integers(0, alphabet - 1)
    return st.lists(tokens, min_size=1, max_size=40) | st.lists(tokens, min_size=long[0], max_size=long[1])


@settings(max_examples=400, deadline=None)
@given(tokens=short_or_prompt_long(5, (70, 200)), bounds=lookup_bounds, k=st.integers(1, 5),
       vocab_size=st.sampled_from([8, 2**40]))
def test_drafts_follow_the_earliest_of_the_longest_match(tokens, bounds, k, vocab_size):
    min_n, max_n = bounds
    drafts = proposer(min_n, max_n, vocab_size).propose([DraftRequest("r", tokens, [], k)])
    assert drafts == [brute_force(tokens, k, min_n, max_n)]


@settings(max_examples=60, deadline=None)
@given(tokens=short_or_prompt_long(4, (300, 700)), steps=st.lists(st.integers(1, 300), max_size=6),
       vocab_size=st.sampled_from([8, 2**40]))
def test_a_request_growing_across_steps_is_looked_up_in_full(tokens, steps, vocab_size):
    """The proposer keeps each request's patterns between steps and adds the new ones: every
    step sees the whole context, and a forgotten request (finished or preempted) starts over."""
    lookup = proposer(2, 4, vocab_size)
    live: list[int] = []
    other = [3, 2, 1, 0] * 5
    for step in [*steps, len(tokens)]:
        live = tokens[:max(len(live), min(len(tokens), len(live) + step))]
        got = lookup.propose([DraftRequest("r", live, [], 4), DraftRequest("s", other, [], 4)])
        assert got == [brute_force(live, 4, 2, 4), brute_force(other, 4, 2, 4)]
    lookup.forget(["r"])
    fresh = [7] * len(live)  # as long as the forgotten one, so only forgetting tells them apart
    assert lookup.propose([DraftRequest("r", fresh, [], 4)]) == [brute_force(fresh, 4, 2, 4)]
