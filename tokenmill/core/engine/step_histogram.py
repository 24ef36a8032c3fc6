"""A Prometheus histogram fed a whole step's observations at once.

The engine observes the inter-token latency of every request each step advanced: at a batch
of 256, prometheus_client's ``Histogram.observe`` (a lock and a scan of the buckets for each
value) took about 3 µs a row, a tenth of the host's work per decoded token, all of it on the
engine loop's thread. This one counts a step's values into its buckets with numpy, under one
lock, and serves them to the registry as a custom collector (prometheus_client's documented
way to expose figures kept elsewhere): the same ``_bucket``/``_count``/``_sum`` samples, and
``_created`` unless prometheus_client's are turned off.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class StepHistogram(Collector):
    """One labelled series of a histogram named ``name``, registered in ``registry``."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._label_names, self._label_values = list(labels), list(labels.values())
        self._bounds = np.array([*buckets, np.inf])
        self._le = [floatToGoString(bound) for bound in self._bounds]
        self._counts = np.zeros(len(self._bounds), dtype=np.int64)
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()  # observed on the engine thread, collected on the server's
        registry.register(self)

    def observe_many(self, values: Sequence[float]) -> None:
        """Count each value into the first bucket whose upper bound it does not pass (NaNs are
        dropped: they belong in no bucket)."""
        array = np.asarray(values, dtype=np.float64)
        array = array[~np.isnan(array)]
        if not array.size:
            return
        counts = np.bincount(np.searchsorted(self._bounds, array), minlength=len(self._bounds))
        with self._lock:
            self._counts += counts
            self._sum += float(array.sum())

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation, labels=self._label_names)

    def describe(self) -> list[HistogramMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            cumulative, total = np.cumsum(self._counts).tolist(), self._sum
        family = self._family()
        family.add_metric(self._label_values, list(zip(self._le, cumulative)), total)
        if getattr(prometheus_metrics, "_use_created", True):  # PROMETHEUS_DISABLE_CREATED_SERIES turns it off
            family.samples.append(Sample(f"{self._name}_created", dict(zip(self._label_names, self._label_values)),
                                         self._created))
        yield family
