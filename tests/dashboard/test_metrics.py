"""``/metrics`` (OPS6): parses with the Prometheus text parser and carries the system's metrics,
on SQLite and PostgreSQL; a worker's own metrics endpoint; JSON log lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import warnings

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepwarden.dashboard.web import create_app
from stepwarden.logs import JsonFormatter, configure_logging
from stepwarden.metrics import EventTally, StoreMetrics, _first_id_at_or_after, start_worker_metrics

from .conftest import Scene

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")


Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def parse(text: str) -> Samples:
    """``{sample name: {sorted labels: value}}`` via the official parser (which must accept it all)."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def value(m: Samples, name: str, **labels: str) -> float:
    return m[name][tuple(sorted(labels.items()))]


def test_metrics_parse_and_carry_the_system_metrics(scene: Scene) -> None:
    store = scene.store
    # leader, worker with an open breaker, a queued request: before the dashboard starts
    term = asyncio.run(store.acquire_lease("supervisor", "sup-1:3:cccccc", 30.0))
    assert term is not None
    asyncio.run(
        store.worker_beat(
            "agent-1:2:bbbbbb",
            ["agent"],
            ["inventory", "payments"],
            breakers={"inventory": "open", "payments": "closed"},
        )
    )
    failed = scene.errored("order-1")
    with TestClient(create_app(store, "t")) as c:
        first = parse(c.get("/metrics").text)
        # after the dashboard started: a task that completes its first step, one still queued
        scene.submit("order-2")
        scene.submit("order-3")
        scene.dispatch()
        scene.reply_all("inventory", "ok", result={"ok": 1})
        r = c.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        m = parse(r.text)
    assert value(first, "stepwarden_tasks", state="error") == 1
    assert value(m, "stepwarden_tasks", state="error") == 1
    assert value(m, "stepwarden_tasks", state="processing") == 2
    assert value(m, "stepwarden_tasks", state="processed") == 0
    assert value(m, "stepwarden_queue_depth", agent="payments") == 2  # the charge steps wait
    assert value(m, "stepwarden_steps_dispatched_total") == 3 + 2
    assert value(m, "stepwarden_steps_completed_total") == 2
    assert value(m, "stepwarden_steps_failed_total") == 1
    assert value(m, "stepwarden_steps_rescued_total") == 0
    assert value(m, "stepwarden_tasks_submitted_total") == 3
    assert value(m, "stepwarden_tasks_finished_total", state="error") == 1
    assert value(m, "stepwarden_events_total", kind="received") == 3
    assert value(m, "stepwarden_leader_term", lease="supervisor") == term[0]
    assert value(m, "stepwarden_leader_changes_total", lease="supervisor") == term[0]
    assert value(m, "stepwarden_leader_active", lease="supervisor") == 1
    assert value(m, "stepwarden_leader_info", lease="supervisor", holder="sup-1:3:cccccc") == 1
    assert value(m, "stepwarden_breaker_state", worker="agent-1:2:bbbbbb", agent="inventory") == 2
    assert value(m, "stepwarden_breaker_state", worker="agent-1:2:bbbbbb", agent="payments") == 0
    assert value(m, "stepwarden_breakers_open", agent="inventory") == 1
    assert value(m, "stepwarden_workers", role="agent") == 1
    assert value(m, "stepwarden_alerts_unacked", kind="task_error") == 1
    # attempt durations and reply latency: the two replies sent after the dashboard started, and
    # not the error reply committed before it
    assert value(m, "stepwarden_attempt_duration_seconds_count", agent="inventory", outcome="ok") == 2
    errors = (("agent", "inventory"), ("outcome", "error"))
    assert errors not in m["stepwarden_attempt_duration_seconds_count"]
    assert value(m, "stepwarden_reply_latency_seconds_count", agent="inventory") == 2
    assert "stepwarden_attempt_duration_seconds_bucket" in m
    assert scene.state(failed) == "error"


def test_rescues_and_actions_are_counted(scene: Scene) -> None:
    tid = scene.errored("order-1")
    with TestClient(create_app(scene.store, "t")) as c:
        c.post(f"/tasks/{tid}/retry", headers={"Authorization": "Bearer t"})
        c.post(f"/tasks/{tid}/retry", headers={"Authorization": "Bearer nope"})
        m = parse(c.get("/metrics").text)
    assert value(m, "stepwarden_dashboard_actions_total", action="retry", result="ok") == 1
    assert value(m, "stepwarden_dashboard_actions_total", action="retry", result="refused") == 1
    assert value(m, "stepwarden_events_total", kind="retried") == 1


def test_tally_reads_each_event_once_and_counts_per_minute(scene: Scene) -> None:
    store = scene.store
    tally = EventTally(store.dialect)
    store.transact_sync(tally.refresh)
    assert tally.totals == {}
    for i in range(3):
        scene.submit(f"o-{i}")
    store.transact_sync(tally.refresh)
    store.transact_sync(tally.refresh)
    assert tally.totals["received"] == 3
    now = store.transact_sync(lambda tx: float(tx.one("now")["now"]))  # type: ignore[index]
    series = tally.per_minute(now, "received")
    assert len(series) == 15 and series[-1][1] == 3 and sum(n for _, n in series) == 3
    # a second tally started later finds the same totals at its first refresh
    late = EventTally(store.dialect)
    store.transact_sync(late.refresh)
    assert late.totals == tally.totals


def test_first_id_at_or_after_is_a_binary_search(scene: Scene) -> None:
    for i in range(5):
        scene.submit(f"o-{i}")
    rows = scene.store.transact_sync(lambda tx: tx.sql("SELECT id, at FROM events ORDER BY id"))
    for r in rows:
        got = scene.store.transact_sync(_first_id_at_or_after, "events", float(r["at"]))
        assert got <= r["id"]
        assert all(float(x["at"]) < float(r["at"]) for x in rows if x["id"] < got)
    last = rows[-1]
    assert (
        scene.store.transact_sync(_first_id_at_or_after, "events", float(last["at"]) + 10) == last["id"] + 1
    )


def test_store_metrics_without_the_web_app(scene: Scene) -> None:
    sm = StoreMetrics(scene.store)
    scene.store.transact_sync(sm.refresh)
    assert b"stepwarden_tasks" in sm.render()


# -- a worker process's own metrics ------------------------------------------------------------------


def test_worker_metrics_endpoint(scene: Scene) -> None:
    from stepwarden.agent import AgentRole
    from stepwarden.demo.app import app as demo_app
    from stepwarden.store.base import ApplyResult, SweepResult
    from stepwarden.worker import Worker, WorkerSettings

    demo_app.use_store(scene.store)
    w = Worker(demo_app, WorkerSettings(name="metrics-test"))
    server = start_worker_metrics(w, 0)
    try:
        m = server.metrics
        m.applied(
            ApplyResult(
                accepted=2, finished=[(1, "processed"), (2, "error")], alerts=[{"kind": "task_error"}]
            )
        )
        m.swept(SweepResult(rescued=3, finished=[(3, "error")]), seconds=0.02)  # a task a sweep ended
        m.lease_changed("acquired", 7)
        m.attempt_finished("inventory", "ok", 0.15)
        w.agent_role = AgentRole(scene.store, {}, w.identity)  # as run() makes it
        w.agent_role.completed, w.agent_role.batches = 16, 2
        r = httpx.get(server.url, timeout=10)
        assert r.status_code == 200
        got = parse(r.text)
    finally:
        server.close()
        demo_app._store = None
    assert value(got, "stepwarden_worker_info", worker=w.identity, roles="scheduler,agent,supervisor") == 1
    assert value(got, "stepwarden_worker_tasks_finished_total", state="processed") == 1
    # one by a reply, one by a sweep (found by review: a sweep's were counted nowhere)
    assert value(got, "stepwarden_worker_tasks_finished_total", state="error") == 2
    assert value(got, "stepwarden_worker_replies_applied_total", status="accepted") == 2
    assert value(got, "stepwarden_worker_alerts_total", kind="task_error") == 1
    assert value(got, "stepwarden_worker_sweeps_total") == 1
    assert value(got, "stepwarden_worker_sweep_rescued_total") == 3
    assert value(got, "stepwarden_worker_sweep_duration_seconds_count") == 1
    assert value(got, "stepwarden_worker_leader_changes_total", lease="supervisor", change="acquired") == 1
    assert (
        value(got, "stepwarden_worker_attempt_duration_seconds_count", agent="inventory", outcome="ok") == 1
    )
    assert value(got, "stepwarden_worker_tasks_claimed_total") == 0  # no scheduler running yet
    assert value(got, "stepwarden_worker_requests_completed_total") == 16
    assert value(got, "stepwarden_worker_reply_batches_total") == 2


# -- structured logs -----------------------------------------------------------------------------------


def test_json_log_lines() -> None:
    buf = io.StringIO()
    fmt = JsonFormatter()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(fmt)
    log = logging.getLogger("stepwarden.test-json")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning(
            "step %s failed: %s", "reserve", 'quote " and\nnewline', extra={"task_id": 7, "when": object()}
        )
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("it broke")
    finally:
        log.removeHandler(handler)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(x) for x in lines)
    assert first["level"] == "WARNING" and first["logger"] == "stepwarden.test-json"
    assert first["message"] == 'step reserve failed: quote " and\nnewline'
    assert first["task_id"] == 7 and isinstance(first["when"], str)
    assert first["ts"].endswith("Z") and isinstance(first["pid"], int)
    assert second["exc_type"] == "ValueError" and "boom" in second["exc"]


def test_configure_logging_json_and_text() -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buf = io.StringIO()
    try:
        root.handlers[:] = []
        configure_logging("INFO", "json", stream=buf)
        logging.getLogger("stepwarden.x").info("hello")
        assert json.loads(buf.getvalue())["message"] == "hello"
        configure_logging("DEBUG", "text", stream=buf)  # replaces its own handler, not a second one
        assert len(root.handlers) == 1 and root.level == logging.DEBUG
        logging.getLogger("stepwarden.x").info("plain")
        assert buf.getvalue().splitlines()[-1].endswith("INFO stepwarden.x: plain")
        with pytest.raises(ValueError):
            configure_logging("INFO", "xml")
        other = logging.StreamHandler(io.StringIO())
        root.handlers[:] = [other]
        configure_logging("INFO", "json")
        assert root.handlers == [other]  # someone else's logging is left alone
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_breaker_states_as_workers_record_them() -> None:
    from stepwarden.metrics import breaker_state

    assert [breaker_state(v) for v in ("closed", "half_open", "open")] == ["closed", "half_open", "open"]
    assert breaker_state({"state": "half_open", "failures": 3}) == "half_open"
    assert breaker_state(None) == "closed" and breaker_state("unknown") == "open"


def test_a_refresh_that_ends_last_with_older_totals_does_not_lower_a_counter(
    scene: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two refreshes overlap (two scrapers, or a scrape and the overview page): the first copies
    the totals, then the second copies newer ones and is served; the first, ending last, was then
    served over it, and a counter went down (Prometheus reads that as a reset)."""
    import threading

    from stepwarden.metrics import system
    from stepwarden.store.records import event

    m = StoreMetrics(scene.store)
    scene.store.transact_sync(m.refresh)
    read = system.read_snapshot
    copied, go = threading.Event(), threading.Event()
    first: list[int] = []

    def paused(tx: object, tally: EventTally) -> object:
        out = read(tx, tally)  # type: ignore[arg-type]
        if not first:  # the first refresh below: it has copied the totals, and waits
            first.append(1)
            copied.set()
            assert go.wait(15)
        return out

    monkeypatch.setattr(system, "read_snapshot", paused)
    slow = threading.Thread(target=lambda: scene.store.transact_sync(m.refresh))
    slow.start()
    try:
        assert copied.wait(15)
        scene.store.transact_sync(lambda tx: event(tx, "received", None, "x"))  # one more submitted
        scene.store.transact_sync(m.refresh)
        served = value(parse(m.render().decode()), "stepwarden_tasks_submitted_total")
    finally:
        go.set()
        slow.join(15)
    assert value(parse(m.render().decode()), "stepwarden_tasks_submitted_total") == served
