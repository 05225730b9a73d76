"""What only PostgreSQL has: many workers racing on SKIP LOCKED claims, LISTEN switched off for a
pooler, and connection faults (REL3) — killed backends and a server restart in the middle of a run."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import Cluster, wait_until

from stepwarden.demo.app import app as demo_app
from stepwarden.demo.ledger import OrderOutcome, check_ledger, fetch_ledger
from stepwarden.demo.services import serve_in_thread
from stepwarden.store import FINAL_TASK_STATES, open_store, views
from stepwarden.store.core import _register
from stepwarden.testing.postgres import LocalPostgres

pytestmark = pytest.mark.timeout(240)


def test_four_workers_2000_tasks_no_task_claimed_twice(pg_cluster: Cluster) -> None:
    workers = [pg_cluster.start(f"w{i}") for i in range(1, 5)]
    ids: list[int] = []
    for burst in range(20):
        with pg_cluster.app.transaction() as tx:
            ids += [tx.submit("one", {"n": burst * 100 + i}) for i in range(100)]
    pg_cluster.wait(
        lambda: pg_cluster.one("SELECT COUNT(*) AS n FROM tasks WHERE state = 'processed'")["n"] == len(ids),
        180,
        "2000 tasks to be processed",
    )
    # The store's own records: one claim event and one request (attempt 1) per task, one owner each.
    claims = Counter(
        r["task_id"] for r in pg_cluster.sql("SELECT task_id FROM events WHERE kind = 'claimed'")
    )
    assert len(claims) == 2000 and set(claims.values()) == {1}
    reqs = pg_cluster.sql("SELECT task_id, attempt, dispatched_by, taken_by, outcome FROM requests")
    assert Counter(r["task_id"] for r in reqs) == Counter({t: 1 for t in ids})
    identities = {w.identity for w in workers}
    assert all(r["attempt"] == 1 and r["outcome"] == "ok" for r in reqs)
    assert all(r["dispatched_by"] in identities and r["taken_by"] in identities for r in reqs)
    assert len({r["dispatched_by"] for r in reqs}) > 1, "the claims raced between several schedulers"
    runs = Counter(e["task_id"] for e in pg_cluster.executions("kind = 'do'"))
    assert runs == Counter({t: 1 for t in ids}), "each task's operation ran exactly once"


def test_listen_off_for_a_transaction_pooler_still_processes_by_polling(pg_cluster: Cluster) -> None:
    pg_cluster.url += "?listen=off"
    pg_cluster.start("polling")
    task_id = pg_cluster.submit("one", {"n": 1})
    wait_until(lambda: pg_cluster.task_state(task_id) == "processed", 30, "the task to be processed")
    listening = pg_cluster.sql("SELECT COUNT(*) AS n FROM pg_stat_activity WHERE query LIKE 'LISTEN%'")
    assert listening == [{"n": 0}], "no LISTEN session with listen=off"


def test_listen_on_opens_one_listening_session_per_worker(pg_cluster: Cluster) -> None:
    pg_cluster.start("a")
    pg_cluster.start("b")
    wait_until(
        lambda: (
            pg_cluster.sql(
                "SELECT COUNT(DISTINCT pid) AS n FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE 'LISTEN%'"
            )
            == [{"n": 2}]
        ),
        20,
        "both workers to LISTEN",
    )


# -- connection faults with the demo's idempotent services and their ledger -----------------------


class DemoRun:
    """Demo workers on one PostgreSQL database with the fake services, and the ledger check."""

    def __init__(self, tmp: Path, url: str) -> None:
        self.tmp = tmp
        self.url = url
        self.base, self.stop_services = serve_in_thread(seed=3, transient_rate=0.05, hang_rate=0.0)
        self.env = dict(os.environ, STEPWARDEN_DEMO_SERVICES=self.base)
        self.store = open_store(url)
        self.store.transact_sync(_register, list(demo_app.workflows.values()), "test")
        self.workers: list[subprocess.Popen[bytes]] = []

    def start(self, n: int) -> None:
        for i in range(n):
            log = open(self.tmp / f"w{i}.log", "ab")  # noqa: SIM115 - the process owns it
            self.workers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "stepwarden",
                        "--db",
                        self.url,
                        "worker",
                        "--app",
                        "stepwarden.demo.app:app",
                        "--name",
                        f"w{i}",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                )
            )

    def submit(self, n: int) -> list[int]:
        demo_app.use_store(self.store)
        return [
            demo_app.submit(
                "process-order",
                {"order_id": f"o{i}", "sku": "s", "quantity": 1, "amount_cents": 100},
                correlation_id=f"o{i}",
            )
            for i in range(n)
        ]

    def final_count(self) -> int:
        counts = self.store.transact_sync(views.state_counts)
        return sum(v for k, v in counts.items() if k in FINAL_TASK_STATES)

    def check(self, n: int) -> None:
        wait_until(lambda: self.final_count() == n, 150, f"all {n} orders to end final")
        for i, w in enumerate(self.workers):
            assert w.poll() is None, f"worker w{i} died:\n{(self.tmp / f'w{i}.log').read_text()[-3000:]}"
        tasks = self.store.transact_sync(views.list_tasks)
        report = check_ledger(
            fetch_ledger(self.base),
            [OrderOutcome(t["correlation_id"], str(t["id"]), t["state"]) for t in tasks],
        )
        assert report.ok, report.problems
        assert report.duplicate_effects == 0 and report.lost == 0

    def close(self) -> None:
        for w in self.workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                w.wait(timeout=20)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        self.store.close()
        self.stop_services()


@pytest.fixture
def own_postgres() -> Iterator[LocalPostgres]:
    """A server of this test's own, so restarting it disturbs no other test. Not under pytest's
    basetemp (as the session's server, tests/conftest.py): another pytest run on the machine sets
    that tree back to 0700 when it starts, and the server's user then could not reach its own
    data directory to restart (pg_ctl: "could not access directory ... Permission denied")."""
    home = Path(tempfile.mkdtemp(prefix="stepwarden-test-own-pg-"))
    pg = LocalPostgres(home / "pgdata").start()
    try:
        yield pg
    finally:
        pg.stop("immediate")
        shutil.rmtree(home, ignore_errors=True)


def backends(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(
            "SELECT COUNT(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
        return int(row[0]) if row else 0


def kill_backends(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        rows = c.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
        return len(rows)


def test_workers_recover_when_all_their_connections_are_killed(tmp_path: Path, pg_url: str) -> None:
    run = DemoRun(tmp_path, pg_url)
    try:
        run.start(3)
        wait_until(lambda: backends(pg_url) >= 6, 30, "the workers to connect")
        ids = run.submit(400)
        wait_until(lambda: run.final_count() >= 10, 60, "the run to be under way")
        killed, done_before = 0, []
        for _ in range(3):  # three times, a moment apart, while orders are still in flight
            done_before.append(run.final_count())
            killed += kill_backends(pg_url)
            time.sleep(0.3)  # spacing the faults, not waiting for an outcome
        assert done_before[-1] < len(ids), f"the faults happened mid-run ({done_before})"
        assert killed >= 9
        run.check(len(ids))
        wait_until(lambda: backends(pg_url) >= 3, 30, "the workers to be connected again")
    finally:
        run.close()


def test_workers_recover_from_a_postgres_restart_mid_run(tmp_path: Path, own_postgres: LocalPostgres) -> None:
    with psycopg.connect(own_postgres.url(), autocommit=True) as c:
        c.execute("CREATE DATABASE faults")
    url = own_postgres.url("faults")
    run = DemoRun(tmp_path, url)
    try:
        run.start(3)
        ids = run.submit(150)
        wait_until(lambda: run.final_count() >= 20, 60, "the run to be under way")
        run.store.close()
        own_postgres.restart()  # every connection dies; the server is back on the same port
        run.store = open_store(url)
        assert run.final_count() < len(ids), "the restart happened mid-run"
        run.check(len(ids))
    finally:
        run.close()


def test_a_store_opened_while_the_server_is_down_waits_for_it(own_postgres: LocalPostgres) -> None:
    """A worker started during a restart must not give up: a refused connection is waited for
    (the fail-fast check answers only to errors that waiting cannot cure), without the pool's
    retry warnings, and the store works once the server is back."""
    url = own_postgres.url()
    own_postgres.stop("fast")
    got: dict[str, Any] = {}

    def open_it() -> None:
        try:
            got["store"] = open_store(url)
        except Exception as e:
            got["error"] = e

    opener = threading.Thread(target=open_it)
    started = time.monotonic()
    opener.start()
    time.sleep(1.0)  # the server is down for this long while the store waits
    own_postgres.start()
    opener.join(timeout=20)
    assert not opener.is_alive(), "open_store did not return"
    assert "error" not in got, got.get("error")
    store = got["store"]
    try:
        assert time.monotonic() - started >= 1.0
        assert store.transact_sync(lambda tx: tx.sql("SELECT COUNT(*) AS n FROM tasks"))[0]["n"] == 0
    finally:
        store.close()


def test_a_connection_lost_in_an_outage_is_retried_for_seconds_not_minutes(pg_url: str) -> None:
    """REL3: psycopg_pool reconnects a lost connection with back-off (1, 2, 4 ... 128 s between
    tries) for ``reconnect_timeout``, 300 s by default, and counts it as coming meanwhile: with
    the server back after a 90-200 s outage, workers sat idle for 12-35 s, their tries asleep.
    Bounded at RECONNECT_TIMEOUT, a try gives up within 10 s, and the next transaction that
    needs a connection starts a fresh one at once (measured: after a 60 s outage the first
    transaction went through 5.3 s after the server was back with the default, at once with
    this; see docs/operating.md). Both of a store's pools."""
    from stepwarden.store.postgres import RECONNECT_TIMEOUT, PostgresStore

    store = open_store(pg_url)
    try:
        assert isinstance(store, PostgresStore)
        assert RECONNECT_TIMEOUT <= 10
        assert store.pool.reconnect_timeout == RECONNECT_TIMEOUT
        assert store.lease_pool.reconnect_timeout == RECONNECT_TIMEOUT
    finally:
        store.close()


def test_watch_waits_out_a_server_restart_and_sees_the_task_to_its_end(
    tmp_path: Path, own_postgres: LocalPostgres
) -> None:
    """Found by review (OPS1, REL3): `watch ID` on a server that went away ended with the driver's
    bare "error: PoolTimeout: couldn't get a connection after 5.00 sec" (exit 1), while `watch
    --reply-to` waited the outage out. It now waits too: one warning, one line when the store
    answers, and the task's end once it comes."""
    from stepwarden import App, Step

    url = own_postgres.url()
    app = App(url)
    app.workflow("one", [Step("a", "ops.noop", complete_by=60)])
    task_id = app.submit("one", {})
    app.close()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "stepwarden", "--db", url, "watch", str(task_id), "--timeout", "90"]
    err_path = tmp_path / "watch.err"
    with open(err_path, "wb") as err_file:
        watch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, env=env, cwd=tmp_path)
    failed = f"watch {task_id}: a round on the store failed"
    try:
        out_fd = watch.stdout
        assert out_fd is not None

        def printed_received() -> bool | None:  # the first event is printed: the watch is running
            if not select.select([out_fd], [], [], 0.1)[0]:
                return None
            return b" received " in out_fd.peek() or None  # type: ignore[attr-defined]

        wait_until(printed_received, 30, "the watch to print the task's first event")
        own_postgres.stop("fast")
        # Down until the watch has met the outage (a read waits up to 5 s for a connection)
        wait_until(lambda: failed in err_path.read_text() or None, 30, "the watch to meet the outage")
        assert watch.poll() is None, err_path.read_text()
        own_postgres.start()
        own_postgres.wait_ready()
        with psycopg.connect(url, autocommit=True) as c:  # the task ends (as a worker would end it)
            c.execute("UPDATE tasks SET state = 'cancelled', finished_at = 1 WHERE id = %s", (task_id,))
        out, _ = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait(10)
    text = err_path.read_text()
    assert watch.returncode == 0, (out, text)
    assert f"task {task_id} is cancelled" in out.decode()
    assert text.count(failed) == 1, text
    assert "the store answers again" in text and "Traceback" not in text, text
