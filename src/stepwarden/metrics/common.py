"""What the store's metrics and a worker's metrics share: the exposition content type, the breaker
encoding, the latency buckets, and builders of the two shapes most families take."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..store import FINAL_TASK_STATES, TASK_STATES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BREAKER_VALUE = {"closed": 0, "half_open": 1, "open": 2}
# The final task states in their natural order (the store's set has none).
FINAL_STATES = tuple(state for state in TASK_STATES if state in FINAL_TASK_STATES)
Family = TypeVar("Family", CounterMetricFamily, GaugeMetricFamily)
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


def labelled(
    kind: type[Family], name: str, doc: str, label: str, samples: Iterable[tuple[str, float]]
) -> Family:
    """A family with one label, one sample per ``(label value, value)``."""
    fam = kind(name, doc, labels=[label])
    for key, value in samples:
        fam.add_metric([key], value)
    return fam
