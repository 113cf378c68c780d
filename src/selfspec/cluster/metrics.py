"""One ``/metrics`` scrape across the replicas of ``selfspec serve --ray``.

Each engine replica pushes its Prometheus text (``serving/metrics.py``) every
:data:`PUSH_PERIOD_S` to the :class:`MetricsHub` deployment; the ingress answers
``/metrics`` (after the replica's own answer passed its API-key check) with every live
replica's families merged, each sample labelled ``replica="ID"``. A replica silent for
:data:`STALE_AFTER_S` is left out (its counters go with it, as an instance's do when it
restarts: Prometheus' ``rate`` handles that).
"""

from __future__ import annotations

import time

PUSH_PERIOD_S = 2.0
STALE_AFTER_S = 3 * PUSH_PERIOD_S


class MetricsHub:
    """The replicas' latest Prometheus texts (a one-replica Ray Serve deployment)."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[str, float]] = {}

    def put(self, replica: str, text: str) -> None:
        """Keep ``replica``'s latest text."""
        self._texts[replica] = (text, time.monotonic())

    def snapshot(self) -> dict[str, str]:
        """Every replica's text pushed within :data:`STALE_AFTER_S`."""
        now = time.monotonic()
        return {r: text for r, (text, at) in self._texts.items() if now - at <= STALE_AFTER_S}


def merge(texts: dict[str, str]) -> bytes:
    """The Prometheus texts of several replicas as one exposition: each family once, its
    samples from every replica with a ``replica`` label (prometheus-client parses and
    writes it)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type,
                                    family.unit))
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica},
                                  sample.value, sample.timestamp, sample.exemplar)

    class _Collector:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)
