"""A Prometheus histogram fed a whole step's observations at once, bucketed when read.

The engine observes the inter-token latency of every request each step advanced: at a batch
of 256, prometheus_client's ``Histogram.observe`` (a lock and a scan of the buckets for each
value) took about 3 µs a row, a tenth of the host's work per decoded token, all of it on the
engine loop's thread. Counting each step's values with numpy instead cost 90 µs a step at
batch 1 (numpy's calls, on caches a forward pass left cold: 4% of a small model's step). So a
step's values are only appended to a list; numpy buckets them when the registry is read (a
scrape, ``LLM.get_metrics``) or once enough are pending. It serves them as a custom collector
(prometheus_client's documented way to expose figures kept elsewhere): the same
``_bucket``/``_count``/``_sum`` samples, and ``_created`` unless prometheus_client's are
turned off.
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
                 registry: CollectorRegistry, pending_limit: int = 4096) -> None:
        self._name, self._documentation = name, documentation
        self._label_names, self._label_values = list(labels), list(labels.values())
        self._bounds = np.array([*buckets, np.inf])
        self._le = [floatToGoString(bound) for bound in self._bounds]
        self._counts = np.zeros(len(self._bounds), dtype=np.int64)
        self._sum = 0.0
        self._created = time.time()
        #: values observed and not yet counted into the buckets, at most ``pending_limit``
        self._pending: list[float] = []
        self._pending_limit = pending_limit
        self._lock = threading.Lock()  # observed on the engine thread, collected on the server's
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values: Sequence[float]) -> None:
        if not values:
            return
        with self._lock:
            self._pending.extend(values)
            if len(self._pending) >= self._pending_limit:
                self._count_pending()

    def _count_pending(self) -> None:
        """Count each pending value into the first bucket whose upper bound it does not pass
        (NaNs are dropped: they belong in no bucket). Called with the lock held."""
        if not self._pending:
            return
        array = np.asarray(self._pending, dtype=np.float64)
        self._pending = []
        array = array[~np.isnan(array)]
        if array.size:
            self._counts += np.bincount(np.searchsorted(self._bounds, array), minlength=len(self._bounds))
            self._sum += float(array.sum())

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self._name, self._documentation, labels=self._label_names)

    def describe(self) -> list[HistogramMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            self._count_pending()
            cumulative, total = np.cumsum(self._counts).tolist(), self._sum
        family = self._family()
        family.add_metric(self._label_values, list(zip(self._le, cumulative)), total)
        if getattr(prometheus_metrics, "_use_created", True):  # PROMETHEUS_DISABLE_CREATED_SERIES turns it off
            family.samples.append(Sample(f"{self._name}_created", dict(zip(self._label_names, self._label_values)),
                                         self._created))
        yield family
