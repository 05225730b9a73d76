"""One worker process's own metrics (``stepwarden_worker_*``): what it claimed, applied, rescued, its
breakers and leadership, read from its roles at scrape time, plus what its hooks record (sweep and
attempt durations); served by :func:`start_worker_metrics`."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..cli_params import bracketed
from .common import BREAKER_VALUE, FINAL_STATES, LATENCY_BUCKETS, counter, labelled

if TYPE_CHECKING:
    from ..store import ApplyResult, SweepResult
    from ..worker import Worker


class WorkerMetrics(Collector):
    """Metrics of one worker process. Its roles' own counters are read at scrape time (no hook
    needed); the hook methods (:meth:`applied`, :meth:`swept`, :meth:`lease_changed`,
    :meth:`attempt_finished`) add what only the moment of the event knows."""

    def __init__(self, worker: Worker, registry: CollectorRegistry | None = None) -> None:
        self.worker = worker
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.sweep_duration = Histogram(
            "stepwarden_worker_sweep_duration_seconds",
            "Supervisor sweeps led by this process.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.attempt_duration = Histogram(
            "stepwarden_worker_attempt_duration_seconds",
            "Attempts run by this process's agents, by outcome (silent: passed complete-by).",
            ["agent", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._lock = threading.Lock()
        self._finished: Counter[str] = Counter()
        self._applied: Counter[str] = Counter()
        self._alerts: Counter[str] = Counter()
        self._sweeps = 0
        self._sweep_rescued = 0
        self._lease_changes: Counter[tuple[str, str]] = Counter()
        r.register(self)

    # hooks ------------------------------------------------------------------------------------------
    def applied(self, result: ApplyResult) -> None:
        """Replies applied by this process -- by its scheduler (``SchedulerRole(on_applied=...)``)
        or, when it applies its own agents' replies as it sends them, by its agent role."""
        with self._lock:
            self._applied["accepted"] += result.accepted
            self._applied["stale"] += result.stale
            for _, state in result.finished:
                self._finished[state] += 1
            for a in result.alerts:
                self._alerts[str(a.get("kind"))] += 1

    def swept(self, result: SweepResult, seconds: float | None = None) -> None:
        """``Supervisor(on_sweep=...)``; the duration from ``seconds`` or ``result.seconds`` if present."""
        took = seconds if seconds is not None else getattr(result, "seconds", None)
        if took is not None:
            self.sweep_duration.observe(float(took))
        with self._lock:
            self._sweeps += 1
            self._sweep_rescued += result.rescued
            for _, state in result.finished:  # the tasks a sweep ended are this process's too
                self._finished[state] += 1
            for a in result.alerts:
                self._alerts[str(a.get("kind"))] += 1

    def lease_changed(self, what: str, term: int) -> None:
        """``LeaseKeeper(on_change=...)``: ``what`` is ``"acquired"`` or ``"lost"``."""
        name = self.worker.keeper.name if self.worker.keeper is not None else "supervisor"
        with self._lock:
            self._lease_changes[(name, what)] += 1

    def attempt_finished(self, agent: str, outcome: str, seconds: float) -> None:
        """An agent role's attempt ended: ``outcome`` is ok, error, retry or silent."""
        self.attempt_duration.labels(agent, outcome).observe(max(0.0, seconds))

    # scrape -------------------------------------------------------------------------------------------
    def collect(self) -> Iterable[Metric]:
        w = self.worker
        info = GaugeMetricFamily(
            "stepwarden_worker_info", "This worker's identity.", labels=["worker", "roles"]
        )
        info.add_metric([w.identity, ",".join(w.settings.roles)], 1)
        yield info
        sch = w.scheduler
        yield counter(
            "stepwarden_worker_tasks_claimed", "Tasks claimed by this scheduler.", sch.claimed if sch else 0
        )
        role = w.agent_role
        yield counter(
            "stepwarden_worker_requests_completed",
            "Replies sent by this process's agents.",
            role.completed if role else 0,
        )
        yield counter(
            "stepwarden_worker_reply_batches",
            "Transactions that carried those replies: requests completed per batch is how well they "
            "share commits (about the agent's concurrency when its calls are quick).",
            role.batches if role else 0,
        )
        inflight = GaugeMetricFamily(
            "stepwarden_worker_inflight", "Requests running now, by agent.", labels=["agent"]
        )
        breaker = GaugeMetricFamily(
            "stepwarden_worker_breaker_state",
            "The agents' shared breakers as this process last read them: 0 closed, 1 half-open, 2 open.",
            labels=["agent"],
        )
        healthy = GaugeMetricFamily(
            "stepwarden_worker_agent_healthy",
            "1 if this instance is healthy for the agent, 0 if it stopped pulling its requests.",
            labels=["agent"],
        )
        if role is not None:
            for name in sorted(role.agents):
                inflight.add_metric([name], role.inflight.get(name, 0))
                breaker.add_metric([name], BREAKER_VALUE.get(role.breakers[name].state, 2))
                healthy.add_metric([name], 1 if role.health.healthy(name) else 0)
        yield from (inflight, breaker, healthy)
        sup = w.supervisor
        yield counter(
            "stepwarden_worker_rescued",
            "Expired attempts rescued while this process led.",
            sup.rescued if sup else 0,
        )
        keeper = w.keeper
        leader = GaugeMetricFamily(
            "stepwarden_worker_is_leader", "1 while this process holds the lease.", labels=["lease"]
        )
        term = GaugeMetricFamily(
            "stepwarden_worker_leader_term", "The term this process holds (0: none).", labels=["lease"]
        )
        held = CounterMetricFamily(
            "stepwarden_worker_terms_held", "Terms this process has led.", labels=["lease"]
        )
        if keeper is not None:
            leader.add_metric([keeper.name], 1 if keeper.is_leader else 0)
            term.add_metric([keeper.name], keeper.term or 0)
            held.add_metric([keeper.name], keeper.terms_held)
        yield from (leader, term, held)
        with self._lock:
            finished, alerts, applied = dict(self._finished), dict(self._alerts), dict(self._applied)
            sweeps, rescued, changes = self._sweeps, self._sweep_rescued, dict(self._lease_changes)
        yield labelled(
            CounterMetricFamily,
            "stepwarden_worker_replies_applied",
            "Replies judged by this process.",
            "status",
            ((status, applied.get(status, 0)) for status in ("accepted", "stale")),
        )
        yield labelled(
            CounterMetricFamily,
            "stepwarden_worker_tasks_finished",
            "Tasks this scheduler brought to a final state.",
            "state",
            ((state, finished.get(state, 0)) for state in FINAL_STATES),
        )
        yield labelled(
            CounterMetricFamily,
            "stepwarden_worker_alerts",
            "Alerts raised by this process.",
            "kind",
            sorted(alerts.items()),
        )
        yield counter("stepwarden_worker_sweeps", "Supervisor sweeps led by this process.", sweeps)
        yield counter("stepwarden_worker_sweep_rescued", "Attempts rescued by those sweeps.", rescued)
        fam = CounterMetricFamily(
            "stepwarden_worker_leader_changes",
            "Leadership gained or lost by this process.",
            labels=["lease", "change"],
        )
        for (lease, what), n in sorted(changes.items()):
            fam.add_metric([lease, what], n)
        yield fam

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class MetricsServer:
    metrics: WorkerMetrics
    url: str
    _server: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_worker_metrics(worker: Worker, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``worker``'s metrics at ``http://HOST:PORT/metrics`` from a daemon thread.

    Port 0 picks a free port (see the returned ``url``). The hooks of the returned
    ``.metrics`` are for the worker to pass to its roles (see docs/dashboard.md).
    """
    from .http_server import serve_metrics

    metrics = WorkerMetrics(worker)
    server = serve_metrics(metrics.registry, host, port)
    bound = server.server_address[1]
    shown = bracketed(host)
    return MetricsServer(metrics, f"http://{shown}:{bound}/metrics", server)
