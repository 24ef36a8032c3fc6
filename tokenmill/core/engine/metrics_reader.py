"""vLLM's metric snapshot types (``vllm.v1.metrics.reader``): what ``LLM.get_metrics()``
returns, read from the engine's Prometheus registry (the names ``/metrics`` serves)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: float = 0.0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Histogram(Metric):
    count: int = 0
    sum: float = 0.0
    #: upper bound ("+Inf" last) -> observations at or below it
    buckets: dict[str, int] = field(default_factory=dict)


def read_metrics(registry: CollectorRegistry) -> list[Metric]:
    """Every sample of ``registry`` as Counter, Gauge or Histogram snapshots."""
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.type == "histogram":
            series: dict[tuple, Histogram] = {}
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "le"}
                entry = series.setdefault(tuple(sorted(labels.items())), Histogram(family.name, labels))
                if sample.name.endswith("_bucket"):
                    entry.buckets[sample.labels["le"]] = int(sample.value)
                elif sample.name.endswith("_count"):
                    entry.count = int(sample.value)
                elif sample.name.endswith("_sum"):
                    entry.sum = sample.value
            metrics.extend(series.values())
        elif family.type in ("counter", "gauge"):
            kind = Counter if family.type == "counter" else Gauge
            metrics.extend(kind(family.name, dict(sample.labels), sample.value) for sample in family.samples
                           if not sample.name.endswith("_created"))
    return metrics
