"""What the store's metrics and a worker's metrics share: the exposition content type, the breaker
encoding, the latency buckets and a one-sample counter family."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BREAKER_VALUE = {"closed": 0, "half_open": 1, "open": 2}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def breaker_state(value: Any) -> str:
    """A breaker's state as recorded for a worker: a name, or a mapping with a ``state``."""
    if isinstance(value, dict):
        value = value.get("state")
    return str(value) if value in BREAKER_VALUE else "open" if value else "closed"


def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> CounterMetricFamily:
    """A counter family of one sample, with ``labels`` (name -> value) if given."""
    if labels is None:
        return CounterMetricFamily(name, doc, value=value)
    fam = CounterMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam
