"""``tokenmill bench serve``'s load split over processes: every prompt sent once, the
concurrency and the rate shared out whole, and the results back in prompt order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenmill.bench.serve_load import LoadSpec, in_prompt_order, split


@given(prompts=st.integers(1, 40), concurrency=st.integers(1, 70), processes=st.integers(1, 9),
       rate=st.none() | st.floats(0.1, 100))
def test_a_split_sends_every_prompt_once_and_shares_out_the_concurrency_and_rate(prompts, concurrency, processes,
                                                                                 rate):
    spec = LoadSpec("http://x", "m", [str(i) for i in range(prompts)], 8, rate, concurrency, 5, {})
    shares = split(spec, processes)
    assert 1 <= len(shares) <= min(processes, prompts, concurrency)
    assert sum(share.concurrency for share in shares) == concurrency
    assert all(share.concurrency >= 1 and share.prompts for share in shares)
    assert in_prompt_order([share.prompts for share in shares]) == spec.prompts
    assert len({share.seed for share in shares}) == len(shares)
    if rate is None:
        assert all(share.rate is None for share in shares)
    else:
        assert abs(sum(share.rate for share in shares) - rate) < 1e-9 * rate
