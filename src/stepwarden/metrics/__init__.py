"""Prometheus metrics (OPS6), from the store for the dashboard and from each worker process.

Two sources, two name spaces, so that summing over processes never counts a thing twice:

- ``stepwarden_*``: the whole system, read from the store by :class:`StoreMetrics` (the
  dashboard's ``/metrics``): tasks by state, queue depth, steps dispatched / completed / failed /
  rescued, leader term and changes, breaker states, attempt durations and reply latency.
- ``stepwarden_worker_*``: one worker process, read from its roles by :class:`WorkerMetrics`
  (``start_worker_metrics(worker, port)``): what this process claimed, applied, rescued, its
  breakers and leadership, and, through hooks, sweep durations and attempt durations.

Counters computed from the store are totals over the store's history: the events stored plus
those the leader's prune deleted (``event_totals``, added to in the deleting transaction), so they
survive a dashboard restart and a prune, and never go down (Prometheus would read a drop as a
reset). They are read incrementally (:class:`EventTally`): a refresh reads only the events and
replies added since the previous one, each once however late its transaction commits. Needs the
``dashboard`` extra (``prometheus-client``).

The parts, each in its own module: :mod:`.common` (shared encodings), :mod:`.tally` (incremental
event counts), :mod:`.system` (the store's view) and :mod:`.worker_process` (one process's view).
"""

from __future__ import annotations

from .common import BREAKER_VALUE, CONTENT_TYPE, LATENCY_BUCKETS, breaker_state
from .system import StoreMetrics, StoreSnapshot, read_snapshot
from .tally import BATCH, PER_MINUTE, EventTally, _first_id_at_or_after
from .worker_process import MetricsServer, WorkerMetrics, start_worker_metrics

__all__ = [
    "BATCH",
    "BREAKER_VALUE",
    "CONTENT_TYPE",
    "LATENCY_BUCKETS",
    "PER_MINUTE",
    "EventTally",
    "MetricsServer",
    "StoreMetrics",
    "StoreSnapshot",
    "WorkerMetrics",
    "_first_id_at_or_after",
    "breaker_state",
    "read_snapshot",
    "start_worker_metrics",
]
