"""PostgreSQL-only failure modes of the fenced supervisor: a task row held by another session must
not stall the sweep (and with it the leader's own renewal), and a migration interrupted by a lost
connection is retried instead of failing a worker's start, while one that waits for another
session's migration says whose and gives up, naming it, after a bound."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import Any

import psycopg
import pytest
from pg_threads import ends_before_it_waits, in_thread

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

    def flaky(s: PostgresStore, target: int | None, lock_wait: float, beside: bool) -> int:
        calls.append(1)
        if len(calls) == 1:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return real(s, target, lock_wait, beside)

    monkeypatch.setattr(pg_migrate, "_migrate_once", flaky)
    monkeypatch.setattr("stepwarden.store.pg_migrate.time.sleep", lambda s: None)  # no real back-off wait
    try:
        assert store.migrate() == 0
        assert len(calls) == 2
    finally:
        store.close()


def test_a_migration_statement_the_server_cancelled_is_not_retried_as_a_lost_connection(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancelled statement (57014) fails again if run again: raised at once, not retried four
    times with a "connection lost" warning each."""
    store = open_store(pg_url)
    calls: list[int] = []

    def cancelled(*args: Any) -> int:
        calls.append(1)
        raise psycopg.errors.QueryCanceled("canceling statement due to user request")

    monkeypatch.setattr(pg_migrate, "_migrate_once", cancelled)
    monkeypatch.setattr("stepwarden.store.pg_migrate.time.sleep", lambda s: None)
    try:
        with pytest.raises(psycopg.errors.QueryCanceled):
            store.migrate()
        assert len(calls) == 1
        assert "connection lost" not in caplog.text
    finally:
        store.close()


def _hold_migration_lock(pg_url: str) -> psycopg.Connection[Any]:
    holder = psycopg.connect(pg_url, application_name="a migration in progress")
    holder.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))  # held until rollback
    return holder


def _migration_thread(store: Any) -> tuple[threading.Thread, list[int | BaseException]]:
    """``store.migrate()`` on a thread of its own (not started yet), and the list that gets what
    it returned or raised."""
    assert isinstance(store, PostgresStore)
    done: list[int | BaseException] = []

    def migrate() -> None:
        try:
            done.append(store.migrate())
        except BaseException as e:
            done.append(e)

    return threading.Thread(target=migrate), done


def test_a_migration_waits_for_another_sessions_migration_and_says_who_holds_it(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two processes starting at once on a fresh database: the second waits for the first's
    migration, names it while waiting, and goes on once it ends (no lock-timeout error lines)."""
    store, holder = open_store(pg_url), _hold_migration_lock(pg_url)
    th, done = _migration_thread(store)

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


def test_a_short_wait_for_another_sessions_migration_is_not_reported(
    pg_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes starting together wait for each other's migration, well under a second; each used
    to log a WARNING at its first failed try (and, when the holder had just committed, one naming
    "a session this role cannot see"). The first report comes after a second of waiting."""
    store, holder = open_store(pg_url), _hold_migration_lock(pg_url)
    th, done = _migration_thread(store)

    # Each failed try for the lock looks up its holder: counted, it says the waiter has tried.
    # (pg_stat_activity names the try only for about a millisecond of each quarter second, which
    # a busy machine's polls missed.)
    tries = threading.Event()
    look_up = pg_migrate._migration_lock_holder

    def counted(conn: Any) -> str:
        tries.set()
        return look_up(conn)

    monkeypatch.setattr(pg_migrate, "_migration_lock_holder", counted)
    try:
        with caplog.at_level(logging.WARNING, logger="stepwarden.postgres"):
            th.start()
            assert tries.wait(10), "the migration never tried for the lock"
            holder.rollback()
            th.join(timeout=10)
        assert done == [0]
        assert "waiting for another session" not in caplog.text, caplog.text
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


# -- the leader's fenced transactions never wait on another transaction's rows ---------------------
# A fenced transaction share-locks the lease row until it ends (supervision.fence): the holder's
# own renewal, an UPDATE of that row, waits for it, and so does the heartbeat queued behind the
# renewal on the lease lane. A fenced transaction that waits on a row lock costs the leader its
# lease (trust ends 3-4 s after a renewal is sent, with the default settings) and gets its process
# presumed dead (3 s without a heartbeat).

SUP = "sup-1:1:c"
AGENT = "agent-1:1:x"
REPLIED = "UPDATE requests SET state = 'replied' WHERE id = %s AND state = 'taken'"  # request_replied


def test_migration_9_lets_reads_of_tasks_go_on_while_it_waits_for_a_writer(pg_url: str) -> None:
    """Migration 9 (tasks_correlation made partial) builds the new index before it drops the old
    one. Waiting for a writer's lock on tasks, it asks for CREATE INDEX's SHARE lock, which reads
    do not queue behind. Dropping first would have queued an ACCESS EXCLUSIVE request, and every
    read of tasks behind it (claims, the dashboard, `tasks`) until the writer ended."""
    store: Any = open_store(pg_url, migrate=False)
    store.transact_sync(lambda tx: (tx.sql("DROP SCHEMA public CASCADE"), tx.sql("CREATE SCHEMA public")))
    writer = psycopg.connect(pg_url)
    try:
        assert store.migrate(target=8) == 8  # the schema as the previous release left it
        writer.execute("LOCK TABLE tasks IN ROW EXCLUSIVE MODE")  # a writer's transaction, held
        th, out = in_thread(store.migrate)
        wait_for_lock_waiter(pg_url)  # the migration waits for the writer
        with psycopg.connect(pg_url, autocommit=True) as reader:
            reader.execute("SET statement_timeout = '2s'")
            row = reader.execute("SELECT count(*) FROM tasks").fetchone()
            assert row is not None and row[0] == 0
        assert th.is_alive() and out == [], "the migration did not wait for the writer"
        writer.rollback()
        th.join(timeout=20)
        assert out == [1]
        index = store.transact_sync(
            lambda tx: tx.sql("SELECT indexdef FROM pg_indexes WHERE indexname = 'tasks_correlation'")
        )
        assert [r["indexdef"].endswith("WHERE (correlation_id IS NOT NULL)") for r in index] == [True]
    finally:
        writer.close()
        store.close()


def _lease_work_is_prompt(store: Any, term: int) -> None:
    """The leader's renewal and its process's heartbeat each answer within 2 s."""
    for what, call in (
        ("renewal", lambda: asyncio.run(store.renew_lease("supervisor", SUP, term, 1e6))),
        ("heartbeat", lambda: asyncio.run(store.worker_beat(SUP, ["supervisor"], []))),
    ):
        th, out = in_thread(call)
        th.join(2.0)
        assert not th.is_alive(), f"the leader's {what} waited for its own fenced transaction"
        assert not isinstance(out[0], BaseException), out


def _two_taken_attempts(store: Any, clock: FakeClock, wf: Any) -> tuple[list[int], int, Any, float]:
    """Two one-step tasks whose requests agent ``AGENT`` has taken, then let their attempts
    expire; the supervisor's lease and heartbeat. Returns the task ids, the term, the request of
    the first task and its attempt's complete-by."""
    ids = _submit(store, wf, 2)
    assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 2
    taken = asyncio.run(store.claim_requests(AGENT, ["svc"], 10))
    first = next(m for m in taken if m.task_id == ids[0])
    term, _ = asyncio.run(store.acquire_lease("supervisor", SUP, 1e6)) or (0, 0.0)
    asyncio.run(store.worker_beat(SUP, ["supervisor"], []))
    [row] = store.transact_sync(
        lambda tx: tx.sql("SELECT complete_by FROM steps WHERE task_id = ?", (ids[0],))
    )
    complete_by = float(row["complete_by"])
    clock.advance(6)  # both attempts are past complete-by (budget 5 s)
    return ids, term, first, complete_by


def _rescue(kind: str, term: int) -> Any:
    """The supervisor's transition that closes an attempt: the sweep of expired attempts, or the
    rescue of those of a worker presumed dead (``AGENT``)."""
    if kind == "sweep_expired":
        return lambda tx: t.sweep_expired(tx, SUP, "supervisor", term, 10, random.Random(0))
    return lambda tx: t.rescue_orphans(tx, SUP, "supervisor", term, AGENT, "gone", 10, random.Random(0))


@pytest.mark.parametrize("kind", ["sweep_expired", "rescue_orphans"])
def test_a_reply_being_recorded_holds_up_neither_the_sweep_nor_the_leader_s_renewal_and_heartbeat(
    pg_url: str, clock: FakeClock, make_workflow: Any, kind: str
) -> None:
    """An agent's reply transaction has marked its request replied and not committed yet (a
    paused agent, a slow commit). The sweep (and the rescue of a dead worker's attempts) waited
    for that request row inside its fenced transaction: the leader's renewal and heartbeat
    waited behind it, for as long as the agent took (up to the 5-10 s session limits). Now the
    attempt is passed by at once, the other one rescued, and the next sweep takes it if the
    reply never commits."""
    store = open_store(pg_url, clock=clock)
    th: threading.Thread | None = None
    try:
        ids, term, first, _ = _two_taken_attempts(store, clock, make_workflow("a", budget=5))
        with psycopg.connect(pg_url) as agent:
            agent.execute(REPLIED, (first.id,))
            th, out = in_thread(lambda: store.transact_sync(_rescue(kind, term)))
            ended = ends_before_it_waits(pg_url, th)
            _lease_work_is_prompt(store, term)
            assert ended, "the rescue waited for the request row an agent holds"
            [done] = out
            assert not isinstance(done, BaseException), done
            assert done.rescued == 1  # the other task's attempt
            agent.rollback()  # the reply never commits (the agent died)
        held = store.transact_sync(
            lambda tx: tx.sql("SELECT state, failure_count FROM steps WHERE task_id = ?", (ids[0],))
        )
        assert [(r["state"], r["failure_count"]) for r in held] == [("running", 0)], "left untouched"
        assert store.transact_sync(_rescue(kind, term)).rescued == 1, "the next round takes it"
    finally:
        if th is not None:
            th.join(15)
        store.close()


def test_a_reply_received_in_time_and_committed_during_the_sweep_is_accepted_not_made_stale(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    """The reply is inserted a second before complete-by, and its transaction commits while the
    sweep runs. The sweep's re-check ran before it waited for the request row, so once the reply
    committed it expired the attempt anyway: the reply was recorded stale, FailureCount rose to
    1 and the step ran again. Now the sweep passes the attempt by, and the reply completes it."""
    store = open_store(pg_url, clock=clock)
    th: threading.Thread | None = None
    try:
        ids, term, first, complete_by = _two_taken_attempts(store, clock, make_workflow("a", budget=5))
        with psycopg.connect(pg_url) as agent:  # the agent's reply transaction, its commit delayed
            agent.execute(
                "INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, result, sent_by,"
                " received_at) VALUES (%s, %s, 0, 1, 'do', 'ok', '{\"paid\": true}', %s, %s)",
                (first.id, ids[0], AGENT, complete_by - 1),
            )
            agent.execute(REPLIED, (first.id,))
            th, out = in_thread(
                lambda: store.transact_sync(t.sweep_expired, SUP, "supervisor", term, 10, random.Random(0))
            )
            ends_before_it_waits(pg_url, th)
            agent.commit()  # while the sweep runs, or once it has passed the attempt by
            th.join(15)
        assert not isinstance(out[0], BaseException), out
        applied = store.transact_sync(t.apply_replies, "sched", 50, random.Random(0))
        assert (applied.accepted, applied.stale) == (1, 0)
        rows = store.transact_sync(
            lambda tx: tx.sql("SELECT state, attempt, failure_count FROM steps WHERE task_id = ?", (ids[0],))
        )
        assert [(r["state"], r["attempt"], r["failure_count"]) for r in rows] == [("completed", 1, 0)]
    finally:
        if th is not None:
            th.join(15)
        store.close()


def test_a_task_held_in_a_full_batch_does_not_end_the_sweep_with_a_backlog_left(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    """Eight expired attempts, a batch of five, one task held by another transaction (a reply
    being applied). The first batch rescued four of five; the sweep took that for the end of
    the backlog and left three expired attempts for the next interval (250 expired, batch 200:
    51 left). Now it goes on while a batch reads a full batch, and leaves only the held one."""
    from stepwarden.supervisor import Supervisor, SupervisorSettings

    store = open_store(pg_url, clock=clock)
    try:
        wf = make_workflow("a", budget=5)
        ids = _submit(store, wf, 8)
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 8
        term, _ = asyncio.run(store.acquire_lease("supervisor", SUP, 1e6)) or (0, 0.0)
        clock.advance(6)
        sup = Supervisor(store, SUP, clock=clock, settings=SupervisorSettings(batch=5))
        with psycopg.connect(pg_url) as other:
            other.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", (ids[3],))
            assert asyncio.run(sup.sweep(term)).rescued == 7
            other.rollback()
        running = store.transact_sync(lambda tx: tx.sql("SELECT task_id FROM steps WHERE state = 'running'"))
        assert [r["task_id"] for r in running] == [ids[3]]
    finally:
        store.close()


def test_a_sweep_whose_batch_is_all_held_ends_instead_of_reading_it_again(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    """The first expired attempts (by complete-by) fill a batch and every task of it is held:
    going on while batches are full must not read the same held rows over and over. The sweep
    ends after that batch; the next one, once they are free, rescues them and the rest."""
    from stepwarden.supervisor import Supervisor, SupervisorSettings

    store = open_store(pg_url, clock=clock)
    try:
        wf = make_workflow("a", budget=5)
        first = _submit(store, wf, 2)
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 2
        clock.advance(1)
        later = _submit(store, wf, 2)
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 2
        term, _ = asyncio.run(store.acquire_lease("supervisor", SUP, 1e6)) or (0, 0.0)
        clock.advance(6)
        sup = Supervisor(store, SUP, clock=clock, settings=SupervisorSettings(batch=2))
        batches: list[int] = []
        real = store.sweep_expired

        async def counted(*args: Any) -> Any:
            batches.append(1)
            assert len(batches) <= 5, "the sweep keeps reading the held batch"
            return await real(*args)

        store.sweep_expired = counted  # type: ignore[method-assign,assignment]
        with psycopg.connect(pg_url) as other:
            other.execute("SELECT id FROM tasks WHERE id = ANY (%s) FOR UPDATE", (first,))
            assert asyncio.run(sup.sweep(term)).rescued == 0 and len(batches) == 1
            other.rollback()
        assert asyncio.run(sup.sweep(term)).rescued == 4
        running = store.transact_sync(lambda tx: tx.sql("SELECT task_id FROM steps WHERE state = 'running'"))
        assert running == [] and len(first + later) == 4
    finally:
        store.close()


def test_prune_skips_a_task_whose_messages_a_reply_queue_reader_holds(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    """A reader numbering a reply queue's messages (``reply_sequence``) holds them until it
    commits. The prune of their finished task waited for it in its DELETE, inside its fenced
    transaction. Now the task is left for a later round, and the others are pruned at once."""
    store = open_store(pg_url, clock=clock)
    try:
        wf = make_workflow("a", budget=5)
        ids = [
            store.transact_sync(
                t.submit, wf, "{}", correlation_id=None, idempotency_key=None, priority=0, reply_to="orders"
            )[0]
            for _ in range(2)
        ]
        for task_id in ids:
            store.transact_sync(t.cancel_task, task_id, "operator")
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 2  # both end cancelled
        term, _ = asyncio.run(store.acquire_lease("supervisor", SUP, 1e6)) or (0, 0.0)
        clock.advance(100)
        with psycopg.connect(pg_url) as reader:
            reader.execute("UPDATE messages SET seq = id WHERE task_id = %s", (ids[0],))
            th, out = in_thread(lambda: store.transact_sync(t.prune, SUP, "supervisor", term, 10.0, 100))
            ended = ends_before_it_waits(pg_url, th)
            _lease_work_is_prompt(store, term)
            assert ended, "the prune waited for the messages a reader holds"
            assert out == [1]
            reader.rollback()
        left = store.transact_sync(lambda tx: tx.sql("SELECT id FROM tasks ORDER BY id"))
        assert [r["id"] for r in left] == [ids[0]]
        assert store.transact_sync(t.prune, SUP, "supervisor", term, 10.0, 100) == 1  # next round
    finally:
        store.close()


def test_a_lock_wait_left_in_a_leader_s_transaction_is_cut_at_a_second(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    """The net under any wait the leader's transactions still have: the alert dispatcher's record
    of a delivery holds the alert against the prune, and waits if the prune has it. With a prune
    paused there, the record waited the session's lock_timeout (10 s), and the dispatcher's
    renewal with it. Now the record fails after 1 s, writing nothing (the next round sends the
    alert again), and the renewal goes through."""
    from stepwarden.alerts import ALERT_LEASE, Fence, record_delivered
    from stepwarden.store.records import alert

    store = open_store(pg_url, clock=clock)
    th: threading.Thread | None = None
    try:
        made = store.transact_sync(lambda tx: alert(tx, "task_error", None, "charge", "declined"))
        store.transact_sync(lambda tx: tx.run("alert_sink_register", name="pager"))
        term, _ = asyncio.run(store.acquire_lease(ALERT_LEASE, SUP, 1e6)) or (0, 0.0)
        fence = Fence(ALERT_LEASE, SUP, term)
        with psycopg.connect(pg_url) as prune:
            prune.execute("SELECT id FROM alerts WHERE id = %s FOR UPDATE", (made["id"],))
            started = time.monotonic()
            record = lambda: store.transact_sync(record_delivered, "pager", made["id"], SUP, fence)  # noqa: E731
            th, out = in_thread(record)
            th.join(4.0)
            assert not th.is_alive(), "the record still waits for the alert the prune holds"
            assert 0.9 < time.monotonic() - started < 4.0
            assert isinstance(out[0], psycopg.errors.LockNotAvailable), out
            renewed = asyncio.run(store.renew_lease(ALERT_LEASE, SUP, term, 1e6))
            assert renewed
            prune.rollback()
        [left] = store.transact_sync(lambda tx: tx.sql("SELECT count(*) AS n FROM alert_deliveries"))
        assert left["n"] == 0
    finally:
        if th is not None:
            th.join(15)
        store.close()


def test_a_reply_recorded_while_the_sweep_runs_locks_its_request_before_it_is_stamped(
    pg_url: str, clock: FakeClock, make_workflow: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent's reply (a worker with no scheduler role: recorded, not applied) is a request
    marked replied and a reply row stamped with its arrival. The stamp went first: a sweep that
    came between the two statements saw the request free, expired the attempt, and the reply,
    stamped before complete-by, was then recorded stale and a failure counted. The request is
    now locked first: the sweep passes the attempt by, and the reply completes it."""
    from stepwarden.store.pg_tx import PgTx

    store = open_store(pg_url, clock=clock)
    first_sent, go = threading.Event(), threading.Event()
    send = PgTx._send_deferred

    def paused(self: Any) -> None:
        """The reply transaction's first deferred statement, then a pause, then the rest."""
        if "insert_reply" not in self.deferred or len(self.deferred) < 2:
            return send(self)
        rest = dict(self.deferred)
        head = next(iter(rest))
        self.deferred = {head: rest.pop(head)}
        send(self)
        self._sync()
        first_sent.set()
        assert go.wait(15)
        self.deferred = rest
        send(self)

    monkeypatch.setattr(PgTx, "_send_deferred", paused)
    threads: list[threading.Thread] = []
    try:
        [task_id] = _submit(store, make_workflow("a", budget=5), 1)
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 1
        [taken] = asyncio.run(store.claim_requests(AGENT, ["svc"], 10))
        term, _ = asyncio.run(store.acquire_lease("supervisor", SUP, 1e6)) or (0, 0.0)
        asyncio.run(store.worker_beat(SUP, ["supervisor"], []))
        clock.advance(4)  # the reply arrives a second before complete-by
        th, replied = in_thread(
            lambda: asyncio.run(store.send_replies(AGENT, [(taken.id, "ok", {"paid": True}, None)]))
        )
        threads.append(th)
        assert first_sent.wait(15)
        clock.advance(2)  # the sweep runs past complete-by, between the reply's two statements
        sweep, swept = in_thread(
            lambda: store.transact_sync(t.sweep_expired, SUP, "supervisor", term, 10, random.Random(0))
        )
        threads.append(sweep)
        assert ends_before_it_waits(pg_url, sweep), "the sweep waited for the reply's transaction"
        go.set()
        th.join(15)
        assert not isinstance(replied[0], BaseException), replied
        assert not isinstance(swept[0], BaseException), swept
        applied = store.transact_sync(t.apply_replies, "sched", 50, random.Random(0))
        assert (applied.accepted, applied.stale) == (1, 0)
        rows = store.transact_sync(
            lambda tx: tx.sql("SELECT state, attempt, failure_count FROM steps WHERE task_id = ?", (task_id,))
        )
        assert [(r["state"], r["attempt"], r["failure_count"]) for r in rows] == [("completed", 1, 0)]
    finally:
        go.set()
        for th in threads:
            th.join(15)
        store.close()
