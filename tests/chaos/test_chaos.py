"""Short chaos runs, one per store: the demo workload under every fault kind that applies to the store.

Each run injects faults for 30 s on a fixed seed: SIGKILL of workers of every role mix and of the
supervisor leader, SIGSTOP of the leader past its lease and of other workers briefly, SIGTERM of
the leader, the services' own transient, hang-then-apply and permanent faults, and on PostgreSQL
connection resets and stalls through a proxy and a server restart. An operator cancels and retries
tasks meanwhile (``stepwarden task cancel|retry``), and the workers keep finished tasks 8 s only, so
the leader prunes most of the run's tasks while it runs and while leaders are killed. Then it waits
for every task to end and checks the outcome against the services' ledger and the store's log of
leader terms (REL1, REL2, REL3, LEAD4, SUP5, CMP4, OPS2, OPS3), counting the pruned tasks in the
state the harness saw them end in. The two runs are independent (own temp dir, own services, on
PostgreSQL a server of their own, so the suite's shared server is never restarted) and can run in
parallel under ``pytest -n 2``.
"""

from __future__ import annotations

import itertools
import random
import socket
import socketserver
import threading
import time
from types import ModuleType
from typing import Any

import pytest

from stepwarden.store import open_store

EXPECTED = {
    "sqlite": {"kill", "kill_leader", "stop_leader", "stop_worker", "term_leader"},
    "postgres": {
        "kill",
        "kill_leader",
        "stop_leader",
        "stop_worker",
        "term_leader",
        "proxy_reset",
        "proxy_stall",
        "pg_restart",
    },
}


def _explain(chaos: ModuleType, report: dict[str, Any]) -> str:
    lines = chaos.summary_lines(report)
    lines.append(f"problems: {report['problems']}")
    lines.append(f"stuck tasks: {report['stuck_tasks']}")
    lines.append(f"unexpected worker exits: {report['workers']['unexpected_exit_detail']}")
    lines.append(f"logs and data kept in {report['workdir']}")
    return "\n".join(lines)


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_short_chaos_run_loses_nothing_and_applies_nothing_twice(chaos: ModuleType, store: str) -> None:
    options = chaos.Options(
        store=store,
        workers=5,
        duration=30.0,
        rate=6.0,
        fault_every=2.0,
        seed=2,
        settle=120.0,
        retention=8.0,
        operator_every=3.0,
    )
    report, ok = chaos.execute(options)
    why = _explain(chaos, report)
    print(why)  # the run's figures, for `pytest -rP`

    # The guarantees: every task final, none lost, no effect applied twice or left un-undone, and
    # never two supervisor terms acting at once -- over every task, the pruned ones included.
    tasks = report["tasks"]
    assert tasks["submitted"] >= 150, why
    assert sum(tasks["by_state"].values()) == tasks["in_store"] + tasks["pruned"], why
    assert tasks["unaccounted"] == 0 and report["events"]["complete"], why
    assert report["stuck"] == 0, why
    assert report["lost"] == 0, why
    assert report["duplicate_effects"] == 0, why
    assert report["ledger"]["ok"], why
    assert report["leader_terms"]["acting_overlaps"] == 0, why
    assert report["leader_terms"]["fenced_writes_by_non_holder"] == 0, why
    assert report["workers"]["crashes"] == 0, why
    assert ok, why

    # Every fault kind that applies to this store was really injected.
    faults = report["faults"]
    assert EXPECTED[store] <= set(faults["by_kind"]), why
    assert set(faults["kills_by_role"]) == {"all", "scheduler", "agent", "supervisor"}, why
    assert {"transient", "hang", "permanent"} <= {k for k, n in faults["services"].items() if n > 0}, why
    if store == "postgres":
        restarts = [f for f in report["fault_log"] if f["kind"] == "pg_restart"]
        assert all(f.get("ok") for f in restarts), why
        assert all(f.get("ok") for f in report["fault_log"] if f["kind"].startswith("proxy_")), why
    # ... and had their effect: leadership moved after each leader fault, attempts were rescued.
    assert report["leader_changes"] >= 3, why
    for kind in ("failover_after_sigkill_s", "failover_after_sigstop_s", "failover_after_sigterm_s"):
        assert report[kind]["n"] >= 1 and report[kind]["unmeasured"] == 0, why
    assert report["rescues"] > 0, why

    # The leader pruned finished tasks during the run, and leader faults came after it began.
    assert tasks["pruned"] > 0 and report["retention"]["prunes_seen"] >= 1, why
    assert report["retention"]["leader_faults_after_first_prune"] >= 1, why
    # The operator's cancels and retries were carried out, and their tasks ended as promised: a
    # cancelled task undone (every effect of it undone, by the ledger), a retried one final.
    op = report["operator"]
    assert op["cancel"]["accepted"] >= 1 and op["retry"]["accepted"] >= 1, why
    assert op["problems"] == [] and op["cancelled_with_effects_left"] == 0, why
    assert set(op["retried_final_states"]) <= set(chaos.FINAL), why
    # What each SIGKILLed worker had in flight was read from the store (the figure is reported;
    # whether a kill hit an undo in flight depends on timing, so it is not required here).
    assert report["kills_in_flight"]["kills"] >= 1 and report["kills_in_flight"]["problems"] == [], why


def _echo_server() -> socketserver.ThreadingTCPServer:
    class Echo(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            while data := self.request.recv(1024):
                self.request.sendall(data)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


def test_proxy_forwards_resets_and_stalls(chaos: ModuleType) -> None:
    """The PostgreSQL run's fault proxy on its own: it forwards, cuts every connection, black-holes."""
    tcpproxy = chaos.load_tcpproxy()
    server = _echo_server()
    proxy = tcpproxy.ProxyThread("127.0.0.1", server.server_address[1])
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as c:
            c.sendall(b"ping")
            assert c.recv(16) == b"ping"
            assert proxy.stats()["open"] == 1
            assert proxy.reset() == 1
            with pytest.raises(ConnectionResetError):
                c.sendall(b"x")
                if c.recv(16) == b"":  # pragma: no cover - an RST, not a FIN, is what we send
                    pytest.fail("the connection was closed, not reset")
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as c:
            c.sendall(b"a")
            assert c.recv(16) == b"a"
            proxy.stall(0.6)
            t = time.monotonic()
            c.sendall(b"b")
            assert c.recv(16) == b"b"  # held in the black hole, then delivered
            assert time.monotonic() - t >= 0.5
        assert proxy.stats()["connections_reset"] == 1 and proxy.stats()["stalls"] == 1
    finally:
        proxy.close()
        server.shutdown()
        server.server_close()


def test_proxy_refuses_anything_but_loopback(chaos: ModuleType) -> None:
    tcpproxy = chaos.load_tcpproxy()
    with pytest.raises(ValueError, match="loopback"):
        tcpproxy.TcpProxy("10.1.2.3", 5432)
    with pytest.raises(ValueError, match="loopback"):
        tcpproxy.TcpProxy("127.0.0.1", 5432, listen_host="0.0.0.0")


def test_overlap_check_finds_a_deposed_leader_that_still_wrote(chaos: ModuleType) -> None:
    """The overlap figure can fail: term 2 began at t=10 while term 1 still rescued at t=11."""
    terms = [
        {"term": 1, "holder": "a:1:x", "acquired_at": 0.0, "ended_at": 10.0},
        {"term": 2, "holder": "b:2:y", "acquired_at": 10.0, "ended_at": 20.0},
        {"term": 3, "holder": "c:3:z", "acquired_at": 20.0, "ended_at": None},
    ]

    def rescued(term: int, at: float, actor: str) -> dict[str, Any]:
        return {"kind": "rescued", "actor": actor, "at": at, "detail": f'{{"term": {term}}}'}

    clean = chaos.term_analysis(terms, [rescued(1, 9.5, "a:1:x"), rescued(2, 19.0, "b:2:y")])
    assert clean["acting_overlaps"] == 0 and clean["nominal_overlaps"] == 0
    assert clean["fenced_writes"] == 2 and clean["fenced_writes_by_non_holder"] == 0
    bad = chaos.term_analysis(terms, [rescued(1, 11.0, "a:1:x"), rescued(3, 21.0, "b:2:y")])
    assert bad["acting_overlaps"] == 1
    assert (
        bad["acting_overlap_detail"][0]["term"] == 2 and bad["acting_overlap_detail"][0]["earlier_term"] == 1
    )
    assert bad["fenced_writes_by_non_holder"] == 1


def test_rescue_latency_runs_from_complete_by_to_the_retry_dispatch(chaos: ModuleType) -> None:
    events = [
        {"kind": "dispatched", "task_id": 1, "step_idx": 0, "attempt": 1, "at": 100.0, "detail": "{}"},
        {
            "kind": "rescued",
            "task_id": 1,
            "step_idx": 0,
            "attempt": 1,
            "at": 102.4,
            "detail": '{"complete_by": 102.0, "term": 1}',
        },
        {
            "kind": "retry_scheduled",
            "task_id": 1,
            "step_idx": 0,
            "attempt": 1,
            "at": 102.4,
            "detail": '{"delay": 0.3}',
        },
        {"kind": "dispatched", "task_id": 1, "step_idx": 0, "attempt": 2, "at": 102.9, "detail": "{}"},
        # escalated to compensation: no retry, so no sample
        {
            "kind": "rescued",
            "task_id": 2,
            "step_idx": 1,
            "attempt": 3,
            "at": 50.5,
            "detail": '{"complete_by": 50.0}',
        },
        {"kind": "dispatched", "task_id": 2, "step_idx": 1, "attempt": 4, "at": 50.6, "detail": "{}"},
    ]
    (s,) = chaos.rescue_samples(events)
    assert s["latency"] == pytest.approx(0.9)
    assert s["detection"] == pytest.approx(0.4)
    assert s["backoff"] == pytest.approx(0.3)
    assert s["machinery"] == pytest.approx(0.6)


def test_fault_schedule_is_seeded_and_injects_every_kind_first(chaos: ModuleType) -> None:
    kinds = ["kill", "kill_leader", "stop_leader", "term_leader", "proxy_reset", "proxy_stall", "pg_restart"]
    a = chaos.plan_faults(random.Random(5), kinds, 30.0, 2.5, 8.0)
    assert a == chaos.plan_faults(random.Random(5), kinds, 30.0, 2.5, 8.0)
    assert set(kinds) <= {k for _, k in a}
    leader = [t for t, k in a if k in chaos.LEADER_FAULTS]
    assert all(b - x >= 10.0 for x, b in itertools.pairwise(leader))
    assert all(t + 8.0 + 1.0 <= 30.0 for t, k in a if k == "stop_leader")


def test_tracker_keeps_what_a_prune_deletes_and_reads_late_commits_once(
    chaos: ModuleType, store_url: str
) -> None:
    """The harness's tracker, against a real store: a task pruned after it was seen final keeps
    that outcome; an event is counted once however often it is read; the prune is seen. On
    PostgreSQL an event whose transaction took its id first but commits last -- after an event
    with a higher id was read -- is still read (by transaction, not by id), which is how the
    harness sees every event while the workers write concurrently. (SQLite has one writer at a
    time: its ids appear in commit order.)"""
    open_store(store_url).close()  # the schema (a fresh PostgreSQL database is migrated already)
    reader = chaos.Reader(store_url)
    tracker = chaos.Tracker(store_url, "p-", 0, 0.0)
    pg = reader.sqlite_path is None
    writer = reader._connect()  # an autocommit connection of the store's kind, for the test's writes
    late: Any = None

    def run(sql: str, *params: Any) -> None:
        writer.execute(sql.replace("?", "%s") if pg else sql, params)

    def event(kind: str, task: int) -> None:
        run("INSERT INTO events (task_id, kind, actor, detail, at) VALUES (?, ?, 't', '{}', 1)", task, kind)

    try:
        run(
            "INSERT INTO tasks (workflow, workflow_version, state, input, correlation_id, run_at, created_at,"
            " updated_at) VALUES ('wf', 1, 'processing', '{}', 'p-1', 0, 0, 0)"
        )
        tid = int(reader.rows("SELECT id FROM tasks WHERE correlation_id = 'p-1'")[0]["id"])
        event("claimed", tid)
        if pg:  # a transaction takes the next id and stays open
            import psycopg

            late = psycopg.connect(store_url)
            late.execute(
                "INSERT INTO events (task_id, kind, actor, detail, at) VALUES (%s, 'late', 't', '{}', 1)",
                (tid,),
            )
        event("dispatched", tid)
        tracker.poll()
        assert tracker.snapshot()[tid][:2] == ("processing", False)
        assert tracker.kinds == {"claimed": 1, "dispatched": 1}

        run("UPDATE tasks SET state = 'processed', finished_at = ? WHERE id = ?", chaos.now(), tid)
        if late is not None:
            late.commit()  # below the highest id read, committed after it was read
        tracker.poll()
        assert tracker.seen_terminal() == {tid}
        expected = {"claimed": 1, "dispatched": 1} | ({"late": 1} if pg else {})
        assert tracker.kinds == expected

        # The prune: the task and its events go, counted in event_totals in the same transaction.
        n = int(reader.rows("SELECT COUNT(*) AS n FROM events WHERE task_id = ?", (tid,))[0]["n"])
        run("INSERT INTO event_totals (kind, pruned) VALUES ('processed', ?)", n)
        run("DELETE FROM events WHERE task_id = ?", tid)
        run("DELETE FROM tasks WHERE id = ?", tid)
        tracker.poll()
        tracker.poll(full=True)
        assert tracker.kinds == expected  # each event once, however often it was read
        assert tracker.tasks[tid]["state"] == "processed" and tracker.in_store_at_end == set()
        assert len(tracker.prune_moments()) == 1
    finally:
        if late is not None:
            late.close()
        tracker.reader.close()
        writer.close()
        reader.close()
