"""The whole system's metrics (``stepwarden_*``), read from the store: the dashboard's ``/metrics``.

:class:`StoreMetrics` reads a :class:`StoreSnapshot` in one transaction (``refresh``) and renders
it without touching the database (``render``): tasks by state, queue depth, steps dispatched /
completed / failed / rescued, leader term and changes, breakers, attempt durations and reply latency.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..store import TASK_STATES, Store, Tx, views
from ..store import agents as store_agents
from ..store.base import read_only
from .common import BREAKER_VALUE, FINAL_STATES, LATENCY_BUCKETS, breaker_state, counter, labelled
from .tally import EventTally, db_now


@dataclass
class StoreSnapshot:
    now: float = 0.0
    states: dict[str, int] = field(default_factory=dict)
    queues: dict[str, int] = field(default_factory=dict)
    unapplied_replies: int = 0
    leases: list[dict[str, Any]] = field(default_factory=list)
    workers: list[dict[str, Any]] = field(default_factory=list)
    agents: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {"breakers": [], "instances": []})
    alerts: dict[str, int] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    refresh_seconds: float = 0.0
    seq: int = 0  # the order in which snapshots copied the tally's totals (see StoreMetrics.refresh)


def read_snapshot(tx: Tx, tally: EventTally) -> tuple[StoreSnapshot, list[dict[str, Any]]]:
    """Everything ``/metrics`` shows, in one transaction."""
    t0 = time.monotonic()
    replies = tally.refresh(tx)
    snap = StoreSnapshot(now=db_now(tx))
    snap.states = views.state_counts(tx)
    snap.queues = {
        r["agent"]: int(r["n"])
        for r in tx.sql("SELECT agent, COUNT(*) AS n FROM requests WHERE state = 'queued' GROUP BY agent")
    }
    snap.unapplied_replies = int(tx.sql("SELECT COUNT(*) AS n FROM replies WHERE status = 'new'")[0]["n"])
    snap.leases = [
        {k: r[k] for k in ("name", "holder", "term", "expires_at")}
        for r in tx.sql("SELECT name, holder, term, expires_at FROM leases ORDER BY name")
    ]
    snap.workers = views.list_workers(tx, include_silent=False)  # a killed worker is no live series
    snap.agents = store_agents.list_agents(tx)
    snap.alerts = {
        r["kind"]: int(r["n"])
        for r in tx.sql("SELECT kind, COUNT(*) AS n FROM alerts WHERE acked_at IS NULL GROUP BY kind")
    }
    with tally.lock:
        snap.totals = dict(tally.totals)
        tally.copies += 1
        snap.seq = tally.copies
    snap.refresh_seconds = time.monotonic() - t0
    return snap, replies


class StoreMetrics(Collector):
    """The system's metrics from the store. Call :meth:`refresh` (a database read, e.g. via
    ``await store.transact(metrics.refresh)``) and then :meth:`render` (no database access)."""

    def __init__(self, store: Store, registry: CollectorRegistry | None = None) -> None:
        self.store = store
        self.tally = EventTally(store.dialect)
        self.registry = registry or CollectorRegistry()
        self.snapshot = StoreSnapshot()
        self._lock = threading.Lock()
        self.attempt_duration = Histogram(
            "stepwarden_attempt_duration_seconds",
            "Attempts replied to since this process started: from an agent taking the request to its reply.",
            ["agent", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.reply_latency = Histogram(
            "stepwarden_reply_latency_seconds",
            "Attempts replied to since this process started: from dispatch to the agent's reply.",
            ["agent"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(self)

    @read_only
    def refresh(self, tx: Tx) -> StoreSnapshot:
        snap, replies = read_snapshot(tx, self.tally)
        for r in replies:
            if r["at"] is None:
                continue
            at = float(r["at"])
            if r["taken_at"] is not None:
                self.attempt_duration.labels(r["agent"], r["outcome"]).observe(max(0.0, at - r["taken_at"]))
            self.reply_latency.labels(r["agent"]).observe(max(0.0, at - float(r["dispatched_at"])))
        with self._lock:
            # Two refreshes may overlap (two scrapers, a scrape and a page): the one that copied
            # the totals first may finish last, and served as the newer its counters went down,
            # which Prometheus reads as a reset. Only a snapshot with later totals replaces the
            # one served, and a lease's term (the leader-changes counter) never goes back either.
            if snap.seq > self.snapshot.seq:
                served = {lease["name"]: lease["term"] for lease in self.snapshot.leases}
                for lease in snap.leases:
                    lease["term"] = max(lease["term"], served.get(lease["name"], lease["term"]))
                self.snapshot = snap
            return self.snapshot

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            s = self.snapshot
        yield from _store_families(s)


def _store_families(s: StoreSnapshot) -> Iterator[Metric]:
    states = ((state, s.states.get(state, 0)) for state in TASK_STATES)
    yield labelled(GaugeMetricFamily, "stepwarden_tasks", "Tasks in the store by state.", "state", states)
    yield labelled(
        GaugeMetricFamily,
        "stepwarden_queue_depth",
        "Requests waiting for an agent instance, by agent.",
        "agent",
        sorted(s.queues.items()),
    )
    yield GaugeMetricFamily(
        "stepwarden_replies_unapplied",
        "Agent replies not yet applied by a scheduler.",
        value=s.unapplied_replies,
    )
    t = s.totals
    yield counter(
        "stepwarden_steps_dispatched",
        "Attempts dispatched to agents (steps and undos).",
        t.get("dispatched", 0),
    )
    yield counter("stepwarden_steps_completed", "Steps completed.", t.get("step_completed", 0))
    yield counter(
        "stepwarden_steps_failed",
        "Failed attempts (error replies, transient failures that used up an attempt, expiries).",
        t.get("retry_scheduled", 0) + t.get("escalated", 0) + t.get("error", 0),
    )
    yield counter(
        "stepwarden_steps_rescued",
        "Attempts rescued by the supervisor (complete-by passed, or their worker presumed dead).",
        t.get("rescued", 0),
    )
    yield counter("stepwarden_steps_compensated", "Compensations completed.", t.get("step_compensated", 0))
    yield counter("stepwarden_replies_stale", "Replies ignored as stale (SCH4).", t.get("stale_reply", 0))
    yield counter("stepwarden_tasks_submitted", "Tasks submitted.", t.get("received", 0))
    finished = ((state, t.get(state, 0)) for state in FINAL_STATES)
    yield labelled(
        CounterMetricFamily,
        "stepwarden_tasks_finished",
        "Tasks that reached a final state.",
        "state",
        finished,
    )
    yield labelled(
        CounterMetricFamily,
        "stepwarden_events",
        "Events recorded in the store, by kind.",
        "kind",
        sorted(t.items()),
    )
    term = GaugeMetricFamily("stepwarden_leader_term", "Current term of each lease.", labels=["lease"])
    changes = CounterMetricFamily(
        "stepwarden_leader_changes",
        "Terms granted for each lease (every change of leader).",
        labels=["lease"],
    )
    active = GaugeMetricFamily(
        "stepwarden_leader_active", "1 if the lease has an unexpired holder.", labels=["lease"]
    )
    info = GaugeMetricFamily(
        "stepwarden_leader_info", "The current holder of each lease.", labels=["lease", "holder"]
    )
    for lease in s.leases:
        held = lease["holder"] is not None and float(lease["expires_at"]) > s.now
        term.add_metric([lease["name"]], lease["term"])
        changes.add_metric([lease["name"]], lease["term"])
        active.add_metric([lease["name"]], 1 if held else 0)
        if held:
            info.add_metric([lease["name"], lease["holder"]], 1)
    yield from (term, changes, active, info)
    breaker = GaugeMetricFamily(
        "stepwarden_breaker_state",
        "Circuit breaker of each agent in each live worker: 0 closed, 1 half-open, 2 open.",
        labels=["worker", "agent"],
    )
    open_ = GaugeMetricFamily(
        "stepwarden_breakers_open",
        "Live worker instances whose breaker for the agent is open.",
        labels=["agent"],
    )
    opened: Counter[str] = Counter()
    workers = GaugeMetricFamily("stepwarden_workers", "Live worker processes by role.", labels=["role"])
    roles: Counter[str] = Counter()
    age = GaugeMetricFamily(
        "stepwarden_worker_heartbeat_age_seconds",
        "Seconds since each live worker's heartbeat.",
        labels=["worker"],
    )
    for w in s.workers:
        for role in w["roles"]:
            roles[role] += 1
        age.add_metric([w["id"]], w["heartbeat_age"])
        for agent, state in sorted(w["breakers"].items()):
            value = BREAKER_VALUE[breaker_state(state)]
            breaker.add_metric([w["id"], agent], value)
            opened[agent] += value == 2
    for role in ("scheduler", "agent", "supervisor"):
        workers.add_metric([role], roles[role])
    for agent, n in sorted(opened.items()):
        open_.add_metric([agent], n)
    yield from (breaker, open_, workers, age)
    yield from _agent_families(s)
    yield labelled(
        GaugeMetricFamily,
        "stepwarden_alerts_unacked",
        "Alerts not yet acknowledged, by kind.",
        "kind",
        sorted(s.alerts.items()),
    )
    yield GaugeMetricFamily(
        "stepwarden_metrics_refresh_seconds",
        "How long the last read of the store took.",
        value=s.refresh_seconds,
    )


def _agent_families(s: StoreSnapshot) -> Iterator[Metric]:
    """The agents' shared breakers and their instances' own health (AGT3, AGT6)."""
    state = GaugeMetricFamily(
        "stepwarden_agent_breaker_state",
        "Each agent's circuit breaker, shared by all its instances: 0 closed, 1 half-open, 2 open.",
        labels=["agent"],
    )
    opens = CounterMetricFamily(
        "stepwarden_agent_breaker_opens", "Times each agent's shared breaker opened.", labels=["agent"]
    )
    for b in s.agents["breakers"]:
        state.add_metric([b["agent"]], BREAKER_VALUE.get(b["state"], 2))
        opens.add_metric([b["agent"]], b["opens"])
    healthy = GaugeMetricFamily(
        "stepwarden_agent_instance_healthy",
        "1 if the agent instance is healthy, 0 if it stopped pulling because its own calls fail.",
        labels=["agent", "worker"],
    )
    inflight = GaugeMetricFamily(
        "stepwarden_agent_instance_inflight",
        "Requests each agent instance runs, as of its last heartbeat.",
        labels=["agent", "worker"],
    )
    capacity = GaugeMetricFamily(
        "stepwarden_agent_instance_capacity", "Each agent instance's capacity.", labels=["agent", "worker"]
    )
    for i in s.agents["instances"]:
        labels = [i["agent"], i["worker"]]
        healthy.add_metric(labels, 1 if i["healthy"] else 0)
        inflight.add_metric(labels, i["inflight"])
        capacity.add_metric(labels, i["capacity"])
    yield from (state, opens, healthy, inflight, capacity)
