"""PostgreSQL-only failure modes of the fenced supervisor: a task row held by another session must
not stall the sweep (and with it the leader's own renewal), and a migration interrupted by a lost
connection is retried instead of failing a worker's start, while one that waits for another
session's migration says whose and gives up, naming it, after a bound."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import psycopg
import pytest

from stepwarden.clock import FakeClock
from stepwarden.errors import MigrationError
from stepwarden.store import open_store, pg_migrate
from stepwarden.store import transitions as t
from stepwarden.store.postgres import MIGRATION_LOCK, PostgresStore
from stepwarden.testing.postgres import wait_for_lock_waiter


def _submit(store: Any, wf: Any, n: int) -> list[int]:
    return [
        store.transact_sync(
            t.submit, wf, "{}", correlation_id=None, idempotency_key=None, priority=0, reply_to=None
        )[0]
        for _ in range(n)
    ]


def test_a_locked_task_is_skipped_by_the_sweep_and_renewal_is_not_blocked(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    store = open_store(pg_url, clock=clock)
    try:
        ids = _submit(store, make_workflow("a", budget=5), 2)
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 2
        term, _ = asyncio.run(store.acquire_lease("supervisor", "sup", 10)) or (0, 0.0)
        clock.advance(6)  # both attempts are past complete-by
        with psycopg.connect(pg_url) as other:  # a paused session holding the first task's row
            other.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", (ids[0],))
            started = time.monotonic()
            result = asyncio.run(store.sweep_expired("sup", "supervisor", term, 10))
            assert time.monotonic() - started < 3, "the sweep waited for the locked row"
            assert result.rescued == 1  # the other task
            renewed: list[bool] = []
            th = threading.Thread(
                target=lambda: renewed.append(asyncio.run(store.renew_lease("supervisor", "sup", term, 10)))
            )
            th.start()
            th.join(timeout=3)
            assert renewed == [True], "the renewal did not wait on the held task"
            other.rollback()
        again = asyncio.run(store.sweep_expired("sup", "supervisor", term, 10))
        assert again.rescued == 1, "the skipped task is rescued by the next sweep"
    finally:
        store.close()


def test_lease_work_runs_while_every_roles_connection_waits_on_a_lock(pg_url: str) -> None:
    """The lease lane has a connection of its own: with the roles' whole pool held by
    transactions waiting on another session's lock, a worker still beats and its lease is still
    taken and renewed, at once (sharing the pool, they waited up to the pool's 5 s and failed)."""
    store = PostgresStore(pg_url + "?pool_size=1")
    blocked: list[BaseException | None] = []

    def wait_on_the_lock(tx: Any) -> None:
        tx.sql("SELECT pg_advisory_xact_lock(%s)", (424242,))

    def roles_transaction() -> None:
        try:
            asyncio.run(store.transact(wait_on_the_lock))
            blocked.append(None)
        except BaseException as e:
            blocked.append(e)

    try:
        with psycopg.connect(pg_url, autocommit=True) as other:
            other.execute("SELECT pg_advisory_lock(%s)", (424242,))
            th = threading.Thread(target=roles_transaction)
            th.start()
            wait_for_lock_waiter(pg_url)  # the roles' transaction waits on the lock

            async def lease_work() -> tuple[int, bool]:
                await store.worker_beat("w1", ["supervisor"], [])
                got = await store.acquire_lease("supervisor", "w1", 10)
                assert got is not None
                return got[0], await store.renew_lease("supervisor", "w1", got[0], 10)

            started = time.monotonic()
            term, renewed = asyncio.run(asyncio.wait_for(lease_work(), 4))
            assert time.monotonic() - started < 2
            assert renewed and term >= 1
            assert th.is_alive() and blocked == [], "the roles' transaction should still be waiting"
            other.execute("SELECT pg_advisory_unlock(%s)", (424242,))
            th.join(timeout=10)
        assert blocked == [None], blocked
        beats = store.transact_sync(lambda tx: tx.sql("SELECT id FROM workers", ()))
        assert [r["id"] for r in beats] == ["w1"]
    finally:
        store.close()


def test_a_migration_interrupted_by_a_lost_connection_is_retried(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(pg_url)
    assert isinstance(store, PostgresStore)
    real = pg_migrate._migrate_once
    calls: list[int] = []

    def flaky(s: PostgresStore, target: int | None, lock_wait: float) -> int:
        calls.append(1)
        if len(calls) == 1:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return real(s, target, lock_wait)

    monkeypatch.setattr(pg_migrate, "_migrate_once", flaky)
    monkeypatch.setattr("stepwarden.store.pg_migrate.time.sleep", lambda s: None)  # no real back-off wait
    try:
        assert store.migrate() == 0
        assert len(calls) == 2
    finally:
        store.close()


def _hold_migration_lock(pg_url: str) -> psycopg.Connection[Any]:
    holder = psycopg.connect(pg_url, application_name="a migration in progress")
    holder.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))  # held until rollback
    return holder


def test_a_migration_waits_for_another_sessions_migration_and_says_who_holds_it(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two processes starting at once on a fresh database: the second waits for the first's
    migration, names it while waiting, and goes on once it ends (no lock-timeout error lines)."""
    store = open_store(pg_url)
    assert isinstance(store, PostgresStore)
    holder = _hold_migration_lock(pg_url)
    done: list[int | BaseException] = []

    def migrate() -> None:
        try:
            done.append(store.migrate())
        except BaseException as e:
            done.append(e)

    th = threading.Thread(target=migrate)
    try:
        with caplog.at_level(logging.WARNING, logger="stepwarden.postgres"):
            th.start()
            deadline = time.monotonic() + 10
            while "waiting for another session" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
            assert f"pid {holder.info.backend_pid}" in caplog.text, caplog.text
            assert "'a migration in progress'" in caplog.text
            assert done == [], "the migration did not wait for the lock"
            holder.rollback()
            th.join(timeout=10)
        assert done == [0]
        assert "interrupted" not in caplog.text and "lost" not in caplog.text
    finally:
        holder.close()
        th.join(timeout=10)
        store.close()


def test_a_migration_lock_held_too_long_fails_naming_the_holder_and_leaves_no_waiter(pg_url: str) -> None:
    store = open_store(pg_url)
    assert isinstance(store, PostgresStore)
    holder = _hold_migration_lock(pg_url)
    try:
        started = time.monotonic()
        with pytest.raises(MigrationError) as err:
            store.migrate(lock_wait=0.6)
        assert 0.5 < time.monotonic() - started < 5
        message = str(err.value)
        assert f"pid {holder.info.backend_pid}" in message
        assert "pg_terminate_backend" in message and "0.6 s" in message
        assert "\n" not in message
        with psycopg.connect(pg_url, autocommit=True) as watch:  # our tries left no session waiting
            waiting = watch.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            ).fetchone()
            assert waiting == (0,)
    finally:
        holder.close()
        store.close()


def test_a_lease_connection_killed_between_heartbeats_is_replaced_without_an_error(pg_url: str) -> None:
    """The lease lane's one connection ended by the server (a restart, a killed backend) while
    idle: the next heartbeat and renewal find it dead before COMMIT and run again on a fresh one."""
    store = PostgresStore(pg_url)
    try:
        asyncio.run(store.worker_beat("w1", ["supervisor"], []))
        got = asyncio.run(store.acquire_lease("supervisor", "w1", 10))
        assert got is not None
        with store.lease_pool.connection() as conn:
            pid = conn.info.backend_pid
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        asyncio.run(store.worker_beat("w1", ["supervisor"], []))
        assert asyncio.run(store.renew_lease("supervisor", "w1", got[0], 10))
        with store.lease_pool.connection() as conn:
            assert conn.info.backend_pid != pid
    finally:
        store.close()


def test_a_store_whose_migration_fails_at_open_leaves_no_pool_behind(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An application that catches the error and goes on keeps no connections or pool threads."""
    monkeypatch.setattr("stepwarden.store.pg_migrate.MIGRATION_LOCK_WAIT", 0.3)
    holder = _hold_migration_lock(pg_url)
    before = set(threading.enumerate())
    try:
        with pytest.raises(MigrationError, match="pg_terminate_backend") as failed:
            PostgresStore(pg_url)
        # The error's traceback still holds the half-opened store, as a caller's would while it
        # logs or handles it: nothing may wait for garbage collection to be closed.
        assert failed.tb is not None
        left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
        assert left == [], left
        # A closed connection's server process leaves pg_stat_activity a moment after the client
        # hangs up (it notices at its next read), later still on a loaded machine: wait for that,
        # with a deadline that a connection the store really kept open never meets.
        with psycopg.connect(pg_url, autocommit=True) as watch:
            deadline = time.monotonic() + 5.0
            while True:
                ours = watch.execute(
                    "SELECT pid, state, query FROM pg_stat_activity WHERE datname = current_database()"
                    " AND pid NOT IN (pg_backend_pid(), %s)",
                    (holder.info.backend_pid,),
                ).fetchall()
                if not ours or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            assert ours == [], f"the failed store left connections open: {ours}"
    finally:
        holder.close()


def test_prune_skips_a_task_another_session_holds_and_does_not_wait(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    """An operator retrying an old cancelled task holds its row: the prune must neither delete
    its rows under it nor wait for it (the prune is fenced by the lease it must keep renewing)."""
    store = open_store(pg_url, clock=clock)
    try:
        wf = make_workflow("a", budget=5)
        ids = _submit(store, wf, 2)
        for task_id in ids:
            store.transact_sync(t.cancel_task, task_id, "operator")
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 2  # both end cancelled
        term, _ = asyncio.run(store.acquire_lease("supervisor", "sup", 1e6)) or (0, 0.0)
        clock.advance(100)
        with psycopg.connect(pg_url) as other:
            other.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", (ids[0],))
            started = time.monotonic()
            assert store.transact_sync(t.prune, "sup", "supervisor", term, 10.0, 100) == 1
            assert time.monotonic() - started < 3, "the prune waited for the locked row"
            other.rollback()
        left = store.transact_sync(lambda tx: tx.sql("SELECT id FROM tasks ORDER BY id"))
        assert [r["id"] for r in left] == [ids[0]]
        assert store.transact_sync(
            lambda tx: tx.sql("SELECT count(*) AS n FROM steps WHERE task_id = ?", (ids[0],))
        )[0]["n"] == len(wf.steps)
        assert store.transact_sync(t.prune, "sup", "supervisor", term, 10.0, 100) == 1  # next round
    finally:
        store.close()


def test_prune_neither_waits_for_nor_deadlocks_with_a_reply_batch_holding_a_late_reply(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    """A late reply (here a duplicate of an applied one) for a finished task: a reply batch locks
    the reply first, then waits for the task. A prune that has locked the task must not then
    wait for the reply: that was a deadlock, broken by PostgreSQL after a second by failing one
    of the two. The prune leaves that task for a later round and prunes the rest."""
    from test_store import ME, run, send, take

    store = open_store(pg_url, clock=clock)
    try:
        wf = make_workflow("a", budget=5)
        ids = _submit(store, wf, 2)
        assert store.transact_sync(t.claim_and_dispatch, ME, 10) == 2
        msgs = take(store, 10, "svc")
        for m in msgs:
            send(store, m.id, "ok", None, None)
        run(store.schedule(ME, 10))
        late = next(m for m in msgs if m.task_id == ids[0])
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, sent_by,"
                " received_at) VALUES (%s, %s, 0, %s, 'do', 'ok', 'a late duplicate', 0)",
                (late.id, late.task_id, late.attempt),
            )
        term, _ = asyncio.run(store.acquire_lease("supervisor", "sup", 1e6)) or (0, 0.0)
        clock.advance(100)

        batch = psycopg.connect(pg_url)  # a reply batch: the late reply first, then its task
        batch.execute("SELECT id FROM replies WHERE status = 'new' FOR UPDATE")
        batch_pid = batch.info.backend_pid
        waited: list[BaseException | None] = []

        def lock_the_task() -> None:
            try:
                batch.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", (ids[0],))
                waited.append(None)
            except BaseException as e:
                waited.append(e)

        waiter = threading.Thread(target=lock_the_task)

        def prune_with_the_batch_waiting(tx: Any) -> int:
            real_all = tx.all

            def all_(query: str, /, **params: Any) -> Any:
                rows = real_all(query, **params)
                if query == "prunable_tasks":  # the prune holds the tasks: now the batch asks for one
                    waiter.start()
                    with psycopg.connect(pg_url, autocommit=True) as watch:
                        deadline = time.monotonic() + 5
                        while time.monotonic() < deadline:
                            row = watch.execute(
                                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (batch_pid,)
                            ).fetchone()
                            if row and row[0] == "Lock":
                                break
                            time.sleep(0.01)
                        else:
                            raise AssertionError("the reply batch never waited for the task")
                return rows

            tx.all = all_
            return t.prune(tx, "sup", "supervisor", term, 10.0, 100)

        pruned = store.transact_sync(prune_with_the_batch_waiting)  # a deadlock fails one of the two
        waiter.join(timeout=10)
        batch.rollback()
        batch.close()
        assert waited == [None], f"the reply batch failed: {waited}"
        assert pruned == 1
        left = store.transact_sync(lambda tx: tx.sql("SELECT id FROM tasks ORDER BY id"))
        assert [r["id"] for r in left] == [ids[0]]
        assert (
            store.transact_sync(
                lambda tx: tx.sql("SELECT count(*) AS n FROM replies WHERE task_id = ?", (ids[0],))
            )[0]["n"]
            == 2
        ), "the held task's replies are kept with it"
    finally:
        store.close()


def test_a_held_task_in_a_full_prune_batch_does_not_stop_the_backlog(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    """A prune batch that leaves a task behind (its late reply held by a reply batch) prunes fewer
    than a batch: that must not read as "the backlog is done" while more finished tasks wait."""
    from test_store import ME, run, send, take

    from stepwarden.supervisor import LEASE, Supervisor, SupervisorSettings

    store = open_store(pg_url, clock=clock)
    try:
        ids = _submit(store, make_workflow("a", budget=5), 5)
        assert store.transact_sync(t.claim_and_dispatch, ME, 10) == 5
        msgs = take(store, 10, "svc")
        for m in msgs:
            send(store, m.id, "ok", None, None)
        run(store.schedule(ME, 10))
        first = next(m for m in msgs if m.task_id == ids[0])  # finished first: in the first batch
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, sent_by,"
                " received_at) VALUES (%s, %s, 0, %s, 'do', 'ok', 'a late duplicate', 0)",
                (first.id, first.task_id, first.attempt),
            )
        term, _ = asyncio.run(store.acquire_lease(LEASE, "sup", 1e6)) or (0, 0.0)
        clock.advance(100)
        settings = SupervisorSettings(retention=10.0, prune_batch=2)
        sup = Supervisor(store, "sup", clock=clock, settings=settings)
        with psycopg.connect(pg_url) as batch:  # a reply batch holding the late reply
            batch.execute("SELECT id FROM replies WHERE status = 'new' FOR UPDATE")
            assert asyncio.run(sup.prune(term)) == 4
            batch.rollback()
        left = store.transact_sync(lambda tx: tx.sql("SELECT id FROM tasks ORDER BY id"))
        assert [r["id"] for r in left] == [ids[0]]
    finally:
        store.close()


def test_an_own_reply_is_recorded_as_received_when_the_batch_read_it_not_when_it_committed(
    pg_url: str, make_workflow: Any
) -> None:
    """A worker's own reply is checked against complete-by at the moment its batch reads it; the
    stored ``received_at`` must be that moment, not the commit's, which comes after any wait for
    the task's lock (here another session holds it 0.4 s)."""
    store = open_store(pg_url)  # the database's own clock: statement times differ
    try:
        [task_id] = _submit(store, make_workflow("a", budget=30), 1)
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 1
        [msg] = asyncio.run(store.claim_requests("agent", ["svc"], 10))
        with psycopg.connect(pg_url) as other:
            other.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", (task_id,))
            done: list[Any] = []
            th = threading.Thread(
                target=lambda: done.append(
                    asyncio.run(store.send_replies("agent", [(msg.id, "ok", None, None)], apply=True))
                )
            )
            th.start()
            wait_for_lock_waiter(pg_url)  # the batch waits for the task's lock
            time.sleep(0.4)  # the batch keeps waiting while the other session holds the task
            other.rollback()
            th.join(timeout=10)
        assert done and done[0].accepted == 1
        with psycopg.connect(pg_url) as conn:
            row = conn.execute(
                "SELECT received_at, applied_at FROM replies WHERE request_id = %s", (msg.id,)
            ).fetchone()
            assert row is not None
            received, applied = row
        assert applied - received >= 0.3, (received, applied)
    finally:
        store.close()
