"""Prometheus metrics (OPS6), from the store for the dashboard and from each worker process.

Two sources, two name spaces, so that summing over processes never counts a thing twice:

- ``stepwarden_*``: the whole system, read from the store by :class:`StoreMetrics` (the
  dashboard's ``/metrics``): tasks by state, queue depth, steps dispatched / completed / failed /
  rescued, leader term and changes, breaker states, attempt durations and reply latency.
- ``stepwarden_worker_*``: one worker process, read from its roles by :class:`WorkerMetrics`
  (``start_worker_metrics(worker, port)``): what this process claimed, applied, rescued, its
  breakers and leadership, and, through hooks, sweep durations and attempt durations.

Counters computed from the store are totals over the store's history (the ``events`` table), so
they survive a dashboard restart. They are read incrementally (:class:`EventTally`): a refresh
reads only the events and replies added since the previous one. Needs the ``dashboard`` extra
(``prometheus-client``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .store import TASK_STATES, Store, Tx, views
from .store import agents as store_agents

if TYPE_CHECKING:
    from .store import ApplyResult, SweepResult
    from .worker import Worker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BREAKER_VALUE = {"closed": 0, "half_open": 1, "open": 2}
# Events whose counts per minute the dashboard draws (throughput) -- the finished states and arrivals.
PER_MINUTE = ("received", "processed", "error", "compensated", "cancelled")
# Seconds an event or reply must be old before its id range counts as settled. On PostgreSQL ids
# are taken before commit, so a row can become visible after a higher id; rows newer than this are
# read again on the next refresh (and counted once: their ids are remembered). SQLite commits in
# id order (one writer at a time), so it needs no lag.
PG_SETTLE_LAG = 5.0
BATCH = 20_000
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


def breaker_state(value: Any) -> str:
    """A breaker's state as recorded for a worker: a name, or a mapping with a ``state``."""
    if isinstance(value, dict):
        value = value.get("state")
    return str(value) if value in BREAKER_VALUE else "open" if value else "closed"


def _now(tx: Tx) -> float:
    row = tx.one("now")
    return float(row["now"]) if row else time.time()


class _Tail:
    """Reads rows of one append-only table by id, each once, tolerating late commits (see PG_SETTLE_LAG)."""

    def __init__(self, select: str, lag: float) -> None:
        self.select = select  # "SELECT ... WHERE x.id > ? ORDER BY x.id LIMIT ?", with columns id and at
        self.lag = lag
        self.horizon = 0  # every row with id <= horizon has been seen
        self.seen: set[int] = set()  # rows above the horizon already counted

    def read(self, tx: Tx, now: float) -> list[dict[str, Any]]:
        fresh: list[dict[str, Any]] = []
        after = self.horizon
        settled_to = self.horizon
        unsettled = False
        for _ in range(20):  # bounded work per refresh; the rest waits for the next one
            rows = tx.sql(self.select, (after, BATCH))
            for r in rows:
                rid = int(r["id"])
                if r["at"] is not None and float(r["at"]) <= now - self.lag and not unsettled:
                    settled_to = rid
                else:
                    unsettled = True
                if rid not in self.seen:
                    self.seen.add(rid)
                    fresh.append(r)
            if len(rows) < BATCH:
                break
            after = int(rows[-1]["id"])
        self.horizon = settled_to
        self.seen = {i for i in self.seen if i > settled_to}
        return fresh


@dataclass
class EventTally:
    """Totals of events by kind, per-minute counts, and new replies, read incrementally from a store."""

    dialect: str
    window_minutes: int = 15
    totals: Counter[str] = field(default_factory=Counter)
    minutes: dict[int, Counter[str]] = field(default_factory=dict)
    started: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        lag = PG_SETTLE_LAG if self.dialect == "postgres" else 0.0
        self.events = _Tail("SELECT id, kind, at FROM events WHERE id > ? ORDER BY id LIMIT ?", lag)
        self.replies = _Tail(
            "SELECT r.id, r.outcome, r.received_at AS at, q.agent, q.dispatched_at, q.taken_at "
            "FROM replies r JOIN requests q ON q.id = r.request_id WHERE r.id > ? ORDER BY r.id LIMIT ?",
            lag,
        )

    def _start(self, tx: Tx, now: float) -> None:
        """Totals up to now with one GROUP BY; per-minute counts of the window; replies from now on."""
        horizon = _first_id_at_or_after(tx, "events", now - self.events.lag) - 1
        for r in tx.sql("SELECT kind, COUNT(*) AS n FROM events WHERE id <= ? GROUP BY kind", (horizon,)):
            self.totals[r["kind"]] += int(r["n"])
        low = _first_id_at_or_after(tx, "events", now - 60 * self.window_minutes)
        marks = ", ".join("?" for _ in PER_MINUTE)
        for r in tx.sql(
            f"SELECT kind, at FROM events WHERE id >= ? AND id <= ? AND kind IN ({marks})",
            (low, horizon, *PER_MINUTE),
        ):
            self.minutes.setdefault(int(float(r["at"]) // 60), Counter())[r["kind"]] += 1
        self.events.horizon = horizon
        self.replies.horizon = _first_id_at_or_after(tx, "replies", now - self.replies.lag, "received_at") - 1
        self.started = True

    def refresh(self, tx: Tx) -> list[dict[str, Any]]:
        """Read what is new; returns the new replies (for the latency histograms)."""
        with self.lock:
            now = _now(tx)
            if not self.started:
                self._start(tx, now)
            for r in self.events.read(tx, now):
                self.totals[r["kind"]] += 1
                if r["kind"] in PER_MINUTE:
                    self.minutes.setdefault(int(float(r["at"]) // 60), Counter())[r["kind"]] += 1
            oldest = int(now // 60) - 2 * self.window_minutes
            for m in [m for m in self.minutes if m < oldest]:
                del self.minutes[m]
            return self.replies.read(tx, now)

    def per_minute(self, now: float, kind: str = "processed") -> list[tuple[int, int]]:
        """``[(minute_start_epoch, count), ...]``: the last ``window_minutes`` minutes, the current last."""
        current = int(now // 60)
        with self.lock:
            return [
                (m * 60, self.minutes.get(m, Counter())[kind])
                for m in range(current - self.window_minutes + 1, current + 1)
            ]


def _first_id_at_or_after(tx: Tx, table: str, t: float, col: str = "at") -> int:
    """The first id whose time is at or after ``t`` (ids rise with time), by binary search on the
    primary key: a few indexed lookups instead of a scan. One past the last id if none is."""
    sql = f"SELECT id, {col} AS at FROM {table} WHERE id >= ? ORDER BY id LIMIT 1"  # table/col are ours
    top = tx.sql(f"SELECT COALESCE(MAX(id), 0) AS m FROM {table}")[0]["m"]
    lo, hi = 1, int(top) + 1  # answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        rows = tx.sql(sql, (mid,))
        if not rows:
            hi = mid
            continue
        rid, at = int(rows[0]["id"]), float(rows[0]["at"])
        if at >= t:
            hi = min(mid, rid)
        else:
            lo = rid + 1
    return lo


# -- the store's view: the dashboard's /metrics -------------------------------------------------------


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


def read_snapshot(tx: Tx, tally: EventTally) -> tuple[StoreSnapshot, list[dict[str, Any]]]:
    """Everything ``/metrics`` shows, in one transaction."""
    t0 = time.monotonic()
    replies = tally.refresh(tx)
    snap = StoreSnapshot(now=_now(tx))
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
    snap.workers = views.list_workers(tx)
    for w in snap.workers:
        w["heartbeat_epoch"] = _epoch(w["heartbeat_at"])
    snap.agents = store_agents.list_agents(tx)
    snap.alerts = {
        r["kind"]: int(r["n"])
        for r in tx.sql("SELECT kind, COUNT(*) AS n FROM alerts WHERE acked_at IS NULL GROUP BY kind")
    }
    with tally.lock:
        snap.totals = dict(tally.totals)
    snap.refresh_seconds = time.monotonic() - t0
    return snap, replies


def _epoch(iso: str | None) -> float | None:
    if iso is None:
        return None
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


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
            self.snapshot = snap
        return snap

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            s = self.snapshot
        yield from _store_families(s)


def _counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> CounterMetricFamily:
    if labels is None:
        return CounterMetricFamily(name, doc, value=value)
    fam = CounterMetricFamily(name, doc, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


def _store_families(s: StoreSnapshot) -> Iterator[Metric]:
    tasks = GaugeMetricFamily("stepwarden_tasks", "Tasks in the store by state.", labels=["state"])
    for state in TASK_STATES:
        tasks.add_metric([state], s.states.get(state, 0))
    yield tasks
    queue = GaugeMetricFamily(
        "stepwarden_queue_depth", "Requests waiting for an agent instance, by agent.", labels=["agent"]
    )
    for agent, n in sorted(s.queues.items()):
        queue.add_metric([agent], n)
    yield queue
    yield GaugeMetricFamily(
        "stepwarden_replies_unapplied",
        "Agent replies not yet applied by a scheduler.",
        value=s.unapplied_replies,
    )
    t = s.totals
    yield _counter(
        "stepwarden_steps_dispatched",
        "Attempts dispatched to agents (steps and undos).",
        t.get("dispatched", 0),
    )
    yield _counter("stepwarden_steps_completed", "Steps completed.", t.get("step_completed", 0))
    yield _counter(
        "stepwarden_steps_failed",
        "Failed attempts (error replies, transient failures that used up an attempt, expiries).",
        t.get("retry_scheduled", 0) + t.get("escalated", 0) + t.get("error", 0),
    )
    yield _counter(
        "stepwarden_steps_rescued",
        "Attempts rescued by the supervisor after complete-by.",
        t.get("rescued", 0),
    )
    yield _counter("stepwarden_steps_compensated", "Compensations completed.", t.get("step_compensated", 0))
    yield _counter("stepwarden_replies_stale", "Replies ignored as stale (SCH4).", t.get("stale_reply", 0))
    yield _counter("stepwarden_tasks_submitted", "Tasks submitted.", t.get("received", 0))
    finished = CounterMetricFamily(
        "stepwarden_tasks_finished", "Tasks that reached a final state.", labels=["state"]
    )
    for state in ("processed", "error", "compensated", "cancelled"):
        finished.add_metric([state], t.get(state, 0))
    yield finished
    events = CounterMetricFamily(
        "stepwarden_events", "Events recorded in the store, by kind.", labels=["kind"]
    )
    for kind, n in sorted(t.items()):
        events.add_metric([kind], n)
    yield events
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
        if w.get("heartbeat_epoch") is not None:
            age.add_metric([w["id"]], max(0.0, s.now - w["heartbeat_epoch"]))
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
    alerts = GaugeMetricFamily(
        "stepwarden_alerts_unacked", "Alerts not yet acknowledged, by kind.", labels=["kind"]
    )
    for kind, n in sorted(s.alerts.items()):
        alerts.add_metric([kind], n)
    yield alerts
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


# -- one worker process ------------------------------------------------------------------------------


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
        yield _counter(
            "stepwarden_worker_tasks_claimed", "Tasks claimed by this scheduler.", sch.claimed if sch else 0
        )
        role = w.agent_role
        yield _counter(
            "stepwarden_worker_requests_completed",
            "Replies sent by this process's agents.",
            role.completed if role else 0,
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
        yield _counter(
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
        fam = CounterMetricFamily(
            "stepwarden_worker_replies_applied", "Replies judged by this process.", labels=["status"]
        )
        for status in ("accepted", "stale"):
            fam.add_metric([status], applied.get(status, 0))
        yield fam
        fam = CounterMetricFamily(
            "stepwarden_worker_tasks_finished",
            "Tasks this scheduler brought to a final state.",
            labels=["state"],
        )
        for state in ("processed", "error", "compensated", "cancelled"):
            fam.add_metric([state], finished.get(state, 0))
        yield fam
        fam = CounterMetricFamily(
            "stepwarden_worker_alerts", "Alerts raised by this process.", labels=["kind"]
        )
        for kind, n in sorted(alerts.items()):
            fam.add_metric([kind], n)
        yield fam
        yield _counter("stepwarden_worker_sweeps", "Supervisor sweeps led by this process.", sweeps)
        yield _counter("stepwarden_worker_sweep_rescued", "Attempts rescued by those sweeps.", rescued)
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
    from prometheus_client import start_http_server

    metrics = WorkerMetrics(worker)
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    bound = server.server_address[1]
    shown = f"[{host}]" if ":" in host else host
    return MetricsServer(metrics, f"http://{shown}:{bound}/metrics", server)
