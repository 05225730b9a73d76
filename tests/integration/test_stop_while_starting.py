"""A worker stopped while it starts stops at once (DEP4): while it opens and migrates the store,
and while it records its workflows, each of which can wait long for the store (another process
holding SQLite's write lock for up to the busy timeout, another session's migration or a table
lock on PostgreSQL). It used to wait that out: SIGINT ended it only after the wait (27 s
measured), SIGTERM killed it on the spot (exit -15, no word).

Now SIGTERM and SIGINT alike end it within about a second, with exit code 0 (a stop asked for is
a success, as for a running worker) and one line that says so, having taken no work and written
nothing: each of those steps is one transaction, committed whole or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from harness import Cluster, wait_until

from stepwarden import App
from stepwarden.store.base import Tx, read_only
from stepwarden.store.pg_migrate import MIGRATION_LOCK

pytestmark = pytest.mark.timeout(90)

PROMPT = 3.0  # "about a second", with room for a loaded machine; the wait it replaces was 30 s
# How often the waits look for what they wait for (a lock wait, a session ending).
WATCH = 0.02


@contextlib.contextmanager
def migration_held(cluster: Cluster) -> Iterator[Callable[[int], bool]]:
    """Make a starting worker's migration wait, as another process's would: SQLite's write lock
    held by another connection (the migration's ``BEGIN IMMEDIATE`` waits up to the busy
    timeout), or PostgreSQL's migration lock held by another session (polled for up to 120 s).
    Yields ``waiting(pid)``: whether that worker process has reached the wait."""
    if cluster.sqlite:
        holder = sqlite3.connect(cluster.db_path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        wal = f"{cluster.db_path}-wal"

        def opened(pid: int) -> bool:
            """The worker's own connection is open (the migration's BEGIN comes right after).
            Looked for once the process runs the worker: before its exec, a child started by
            this test has this test's files open, the holder's among them."""
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"\0-m\0stepwarden\0" not in f.read():
                        return False
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                return False
            links = set()
            for fd in fds:
                with contextlib.suppress(OSError):
                    links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            return wal in links

        try:
            yield opened
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    with psycopg.connect(cluster.url, autocommit=True) as pg:
        pg.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))

        def polling(pid: int) -> bool:
            """A session other than ours has tried for the migration lock, or the worker ``pid``
            said it waits for it (as it does at its first failed try): the session's last
            statement names the lock only from a try to its commit, about a millisecond of each
            quarter second, which a busy machine's polls can miss for 20 s."""
            if any(
                w.pid == pid and "waiting for another session's migration" in w.log_text()
                for w in cluster.workers
            ):
                return True
            # Its last statement: the try, or the look-up of who holds the lock that follows it.
            row = pg.execute(
                "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid() AND query LIKE %s",
                ("%advisory%",),
            ).fetchone()
            return bool(row and row[0])

        yield polling


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_worker_stopped_while_it_waits_to_migrate_the_store_stops_at_once(
    cluster: Cluster, sig: signal.Signals
) -> None:
    with migration_held(cluster) as waiting:
        w = cluster.start("starting", "scheduler,agent,supervisor", wait=False)
        wait_until(lambda: waiting(w.pid) or not w.alive(), 20, "the worker to wait for the migration", WATCH)
        assert w.alive(), w.log_text()
        code, took = w.stop(sig, 30)
        log = w.log_text()
        assert (code, took < PROMPT) == (0, True), f"exit {code} after {took:.1f}s of {sig.name}:\n{log}"
        assert "Traceback" not in log, log
        # One line says so, naming the signal.
        said = [line for line in log.splitlines() if "stopped" in line]
        assert len(said) == 1, log
        assert re.search(
            rf"worker starting:{w.pid}:[0-9a-f]+ stopped by {sig.name} before it could start"
            r" \(while opening the store\); it took no work$",
            said[0],
        ), log
    # It wrote nothing: no worker record, no workflows, and the store opens as before.
    assert cluster.sql("SELECT id FROM workers") == []
    assert cluster.sql("SELECT name FROM workflows") == []


@contextlib.contextmanager
def registration_held(url: str) -> Iterator[Callable[[], bool]]:
    """Make a worker's first transaction (recording its workflows) wait for a lock: SQLite's write
    lock, or on PostgreSQL a lock on the workflows table (the upsert waits up to lock_timeout,
    10 s, and then is retried). Yields ``waiting()``: whether a transaction waits for it (on
    SQLite every writer waits: the caller knows when its worker begins)."""
    if url.startswith("sqlite:///"):
        holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            yield lambda: True
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    with psycopg.connect(url) as pg, psycopg.connect(url, autocommit=True) as watch:
        pg.execute("LOCK TABLE workflows IN EXCLUSIVE MODE")

        def waiting() -> bool:
            row = watch.execute(
                "SELECT COUNT(*) FROM pg_locks WHERE relation = 'workflows'::regclass AND NOT granted"
            ).fetchone()
            return bool(row and row[0])

        try:
            yield waiting
        finally:
            pg.rollback()


@read_only
def read(tx: Tx, query: str) -> list[dict[str, Any]]:
    return tx.sql(query)


def test_a_worker_stopped_while_it_records_its_workflows_stops_at_once(
    store_url: str, caplog: pytest.LogCaptureFixture, noop_app: Callable[..., App]
) -> None:
    """``Worker.run`` itself: the stop came while the registration's transaction waits for a lock
    (up to SQLite's 30 s busy timeout; PostgreSQL's 10 s lock_timeout, then retried). That wait
    is not waited out: ``run`` returns at once, the worker not started."""
    caplog.set_level("INFO", logger="stepwarden")
    app = noop_app(store_url)
    app.store.transact_sync(lambda tx: None)  # opened and migrated before the lock is taken
    try:
        with registration_held(store_url) as waiting:
            worker = app.worker(name="starting")
            entered = asyncio.Event()
            through = app.store.register_workflows

            async def spied(*args: Any, **kwargs: Any) -> Any:
                entered.set()
                return await through(*args, **kwargs)

            app.store.register_workflows = spied  # type: ignore[method-assign]

            async def body() -> tuple[float, bool]:
                stop = asyncio.Event()
                run = asyncio.create_task(worker.run(stop))
                await asyncio.wait_for(entered.wait(), 20)
                end = time.monotonic() + 20
                while not waiting():
                    assert time.monotonic() < end and not run.done(), "the registration never waited"
                    await asyncio.sleep(0.02)
                stop.set()
                sent = time.monotonic()
                started = await asyncio.wait_for(run, 8)
                return time.monotonic() - sent, started

            took, started = asyncio.run(body())
            assert took < 1.0, f"run() took {took:.1f}s to return after the stop"
            assert started is False
            # Nothing written, as it returned (the lock is still held: read without waiting for it).
            assert app.store.transact_sync(read, "SELECT name FROM workflows") == []
            assert app.store.transact_sync(read, "SELECT id FROM workers") == []
        said = [r.getMessage() for r in caplog.records if "before it could start" in r.getMessage()]
        assert said == [
            f"worker {worker.identity} stopped before it could start (while recording its workflows"
            " in the store); it took no work"
        ]
    finally:
        app.close()


def test_the_worker_command_stopped_while_it_records_its_workflows_exits_at_once(
    pg_cluster: Cluster,
) -> None:
    """The command line's side of the same stop: the transaction still waiting for its lock, in a
    thread, does not hold the process (it would until PostgreSQL's lock_timeout, 10 s). Its
    session goes with the process, its transaction never committed. PostgreSQL only: on SQLite
    the migration before it takes the same write lock, so no test can hold the one and not the
    other (the test above covers ``Worker.run`` on both stores)."""
    with registration_held(pg_cluster.url) as waiting:
        w = pg_cluster.start("starting", "scheduler,agent,supervisor", wait=False)
        what = "the worker's registration to wait for its lock"
        wait_until(lambda: waiting() or not w.alive(), 20, what, WATCH)
        assert w.alive(), w.log_text()
        code, took = w.stop(signal.SIGTERM, 30)
        log = w.log_text()
        assert (code, took < PROMPT) == (0, True), f"exit {code} after {took:.1f}s of SIGTERM:\n{log}"
        assert "Traceback" not in log, log
        said = [line for line in log.splitlines() if "before it could start" in line]
        assert len(said) == 1 and "(while recording its workflows in the store)" in said[0], log
    # The lock is free now: the worker's session, had it lived on, would commit its upsert.
    wait_until(
        lambda: (
            not pg_cluster.sql(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query LIKE ?",
                "%INSERT INTO workflows%",
            )
        ),
        20,
        "the stopped worker's session to end",
        WATCH,
    )
    assert pg_cluster.sql("SELECT name FROM workflows") == []
    assert pg_cluster.sql("SELECT id FROM workers") == []
