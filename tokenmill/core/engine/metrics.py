"""Prometheus metrics with vLLM's names under the ``tokenmill:`` prefix.

Each app has its own CollectorRegistry, so several servers (or tests) in one
process never share counters. Engine-wide gauges are sampled after every
step by a StepObserver on the loop thread; per-request latencies from the
requests each step advanced (``last_step_progress``), whatever outputs their
``output_kind`` let the step return.

The observer runs between every two steps of the engine's thread, so it is host
work per step: every prometheus_client call takes a lock, and after a forward pass
each cost 5-8 µs. Gauges and counters are set only when their value changed, and
the per-step histograms are ``StepHistogram``s (a list append a step).
"""

from __future__ import annotations

import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.core.engine.llm_engine import LLMEngine
from tokenmill.core.engine.output_processor import RequestProgress
from tokenmill.core.engine.step_histogram import StepHistogram
from tokenmill.core.sched.spec_decode_stats import SpecDecodingStats
from tokenmill.interfaces.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"tokenmill:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"tokenmill:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc):
            return Histogram(f"tokenmill:{name}", doc, labels, buckets=_LATENCY_BUCKETS,
                             registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.swapped = gauge("num_requests_swapped", "Preempted requests whose KV is in the host swap space.")
        self.batch_tokens = StepHistogram("tokenmill:iteration_tokens_total", "Tokens scheduled per engine step.",
                                          {"model_name": model_name},
                                          (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192), r)
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Requests preempted.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served by the prefix cache.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications of a request's draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_position = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft.",
                                          ["model_name", "position"], registry=r)
        self._success = Counter("tokenmill:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        #: one observation per request a step advanced: taken a step at a time
        self.itl = StepHistogram("tokenmill:inter_token_latency_seconds", "Time between output tokens.",
                                 {"model_name": model_name}, _LATENCY_BUCKETS, r)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.")
        self.model_name = model_name
        self._last_token_time: dict[str, tuple[float, int]] = {}
        #: the gauges' values as last set (running, waiting, swapped, KV usage)
        self._seen_gauges: tuple = ()
        self._seen_preemptions = 0
        self._seen_prefix = (0, 0)
        self._seen_spec = SpecDecodingStats()

    def observe_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """StepObserver: called on the engine thread after each step (and each abort)."""
        scheduler = engine.scheduler
        kv = scheduler.kv_cache
        gauges = (len(scheduler.running), len(scheduler.waiting), scheduler.num_swapped, kv.pool.usage())
        if gauges != self._seen_gauges:  # most decode steps change none of them
            self._seen_gauges = gauges
            for gauge, value in zip((self.running, self.waiting, self.swapped, self.kv_usage), gauges):
                gauge.set(value)
        stats = engine.last_scheduler_stats
        if stats is not None and engine.last_step_progress:
            self.batch_tokens.observe(stats.num_scheduled_tokens)
        if scheduler.num_preemptions_total != self._seen_preemptions:
            self.preemptions.inc(scheduler.num_preemptions_total - self._seen_preemptions)
            self._seen_preemptions = scheduler.num_preemptions_total
        prefix = (kv.prefix_queries, kv.prefix_hits)
        if prefix != self._seen_prefix:
            self.prefix_queries.inc(prefix[0] - self._seen_prefix[0])
            self.prefix_hits.inc(prefix[1] - self._seen_prefix[1])
            self._seen_prefix = prefix
        self._observe_spec(scheduler.spec_stats)
        now = time.monotonic()
        latencies: list[float] = []
        generated = sum(self._observe_request(progress, now, latencies) for progress in engine.last_step_progress)
        if generated:
            self.generation_tokens.inc(generated)
        self.itl.observe_many(latencies)

    def _observe_spec(self, stats: SpecDecodingStats) -> None:
        if stats.num_drafts == self._seen_spec.num_drafts:  # most steps: nothing verified
            return
        new = stats.since(self._seen_spec)
        self.spec_drafts.inc(new.num_drafts)
        self.spec_draft_tokens.inc(new.num_draft_tokens)
        self.spec_accepted_tokens.inc(new.num_accepted_tokens)
        for position, count in enumerate(new.accepted_per_position):
            self._spec_per_position.labels(self.model_name, str(position)).inc(count)
        self._seen_spec = stats.snapshot()

    def _observe_request(self, progress: RequestProgress, now: float, latencies: list[float]) -> int:
        """Observe one request's progress; its inter-token latency goes to ``latencies``.
        Returns the tokens it generated since the last step."""
        metrics = progress.metrics
        generated = metrics.num_generation_tokens
        last: Optional[tuple[float, int]] = self._last_token_time.get(progress.request_id)
        if last is None:
            if generated and metrics.first_token_time is not None:
                self.prompt_tokens.inc(metrics.num_prompt_tokens)
                self.ttft.observe(metrics.first_token_time - metrics.arrival_time)
                if metrics.first_scheduled_time is not None:
                    self.queue_time.observe(metrics.first_scheduled_time - metrics.arrival_time)
        elif generated > last[1]:
            latencies.append((now - last[0]) / (generated - last[1]))
        previous = last[1] if last else 0
        if progress.finish_reasons is not None:
            self._last_token_time.pop(progress.request_id, None)
            for reason in progress.finish_reasons:
                self._success.labels(self.model_name, reason).inc()
            self.e2e.observe(now - metrics.arrival_time)
        elif generated:
            self._last_token_time[progress.request_id] = (now, generated)
        return max(0, generated - previous)
