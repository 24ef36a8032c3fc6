"""``LLM.get_metrics()`` (vLLM's offline metric snapshot): the engine's Prometheus metrics,
the names ``/metrics`` serves, as Counter / Gauge / Histogram objects."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as PrometheusHistogram

from conftest import make_llm
from tokenmill import SamplingParams
from tokenmill.core.engine.metrics import _LATENCY_BUCKETS
from tokenmill.core.engine.metrics_reader import Counter, Gauge, Histogram, read_metrics
from tokenmill.core.engine.step_histogram import StepHistogram
from tokenmill.interfaces.errors import InvalidRequest


def test_a_snapshot_counts_what_the_generate_calls_did(model_dir):
    with make_llm(model_dir("llama")) as llm:
        prompts = [[5, 6, 7], [8, 9, 10, 11]]
        for _ in range(2):
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics() if not m.labels.get("finished_reason")}
        success = [m for m in llm.get_metrics() if m.name == "tokenmill:request_success"]
    assert isinstance(metrics["tokenmill:prompt_tokens"], Counter)
    assert metrics["tokenmill:prompt_tokens"].value == 2 * 7
    assert metrics["tokenmill:generation_tokens"].value == 2 * 2 * 3
    assert [(m.labels["finished_reason"], m.value) for m in success] == [("length", 4.0)]
    assert isinstance(metrics["tokenmill:num_requests_running"], Gauge)
    assert metrics["tokenmill:num_requests_running"].value == 0
    ttft = metrics["tokenmill:time_to_first_token_seconds"]
    assert isinstance(ttft, Histogram) and ttft.count == 4 and ttft.buckets["+Inf"] == 4 and ttft.sum > 0
    # generate returns final outputs only; every step still counts: 3 tokens, 2 gaps per request
    assert metrics["tokenmill:inter_token_latency_seconds"].count == 4 * 2


def test_an_embedding_model_has_none(model_dir):
    with make_llm(model_dir("bert")) as llm:
        with pytest.raises(InvalidRequest, match="keeps no generation metrics"):
            llm.get_metrics()


@settings(max_examples=50, deadline=None)
@given(steps=st.lists(st.lists(st.one_of(st.sampled_from(_LATENCY_BUCKETS), st.floats(0, 100)), max_size=40),
                      max_size=5),
       pending_limit=st.sampled_from([1, 7, 4096]), reads=st.integers(0, 2))
def test_a_step_histogram_exposes_what_prometheus_histogram_does(steps, pending_limit, reads):
    """The inter-token latency histogram takes a step's values at once and buckets them when read
    or when ``pending_limit`` are waiting; /metrics shows the same samples (a value on a bound
    counts in that bucket; `_created` too) as prometheus_client's, the sum up to its order of
    additions, however often it was read between steps."""
    plain, batched = CollectorRegistry(), CollectorRegistry()
    histogram = PrometheusHistogram("tokenmill:itl_seconds", "doc", ["model_name"], buckets=_LATENCY_BUCKETS,
                                    registry=plain).labels("m")
    step_histogram = StepHistogram("tokenmill:itl_seconds", "doc", {"model_name": "m"}, _LATENCY_BUCKETS, batched,
                                   pending_limit=pending_limit)
    for step, values in enumerate(steps):
        for value in values:
            histogram.observe(value)
        if len(values) == 1 and step % 2:
            step_histogram.observe(values[0])
        else:
            step_histogram.observe_many(values)
        if step < reads:
            read_metrics(batched)
    expected, got = read_metrics(plain)[0], read_metrics(batched)[0]
    assert got.sum == pytest.approx(expected.sum)

    def lines(registry):  # the exposition, less the values that may differ: the sum's last bits, the creation time
        return [line for line in generate_latest(registry).decode().splitlines()
                if not line.startswith(("tokenmill:itl_seconds_sum", "tokenmill:itl_seconds_created"))]

    assert lines(batched) == lines(plain)
    assert [s.name for s in next(iter(batched.collect())).samples][-1] == "tokenmill:itl_seconds_created"
