"""Where a worker transaction on PostgreSQL loses its connection decides what happens next.

Before the last round trip nothing is committed, so the transaction runs again on a fresh
connection. The last round trip carries the writes kept for commit (events, status messages) and
COMMIT together: a connection lost there leaves the outcome unknown, so it is raised and never run
again. Both are driven by ending the transaction's own backend for real (``pg_terminate_backend``)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from test_store import q

from stepwarden.store import open_store
from stepwarden.store.postgres import PgTx, PostgresStore


@pytest.fixture
def store(pg_url: str) -> Iterator[PostgresStore]:
    s = open_store(pg_url)
    assert isinstance(s, PostgresStore)
    yield s
    s.close()


def _end_backend(url: str, pid: int) -> None:
    with psycopg.connect(url, autocommit=True) as admin:
        # the timeout waits until the backend has exited, so the next message meets a dead session
        row = admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,)).fetchone()
    assert row is not None and row[0] is True


def _events(store: PostgresStore, kind: str) -> int:
    return int(q(store, "SELECT COUNT(*) AS n FROM events WHERE kind = ?", kind)[0]["n"])


def _later_event(tx: PgTx, kind: str) -> None:
    tx.later("insert_event", task_id=None, idx=None, attempt=None, kind=kind, actor="t", detail=None)


def test_a_connection_lost_before_the_last_round_trip_runs_the_transaction_again(
    store: PostgresStore, pg_url: str
) -> None:
    calls: list[int] = []

    def fn(tx: PgTx) -> int:
        calls.append(tx.conn.info.backend_pid)
        _later_event(tx, "before")
        if len(calls) == 1:
            _end_backend(pg_url, tx.conn.info.backend_pid)
        row = tx.one("now")  # a read: its round trip meets the dead session
        assert row is not None
        return len(calls)

    assert store.transact_sync(fn) == 2
    assert calls[0] != calls[1], "the second run is on a fresh connection"
    assert _events(store, "before") == 1, "written once, by the run that committed"


def test_a_connection_lost_in_the_round_trip_that_carries_commit_is_raised_not_run_again(
    store: PostgresStore, pg_url: str
) -> None:
    """The session ends while the last round trip is being processed: the server never reaches
    COMMIT here, but the client cannot tell that from a COMMIT whose answer was lost. (psycopg
    may send the kept statements as soon as they are queued: the server waits a moment before
    ending the session, so that COMMIT is on its way by then.)"""
    calls: list[int] = []

    def fn(tx: PgTx) -> None:
        calls.append(tx.conn.info.backend_pid)
        tx.one("now")
        end = "SELECT pg_sleep(0.5), pg_terminate_backend(pg_backend_pid())"
        tx.q = {**tx.q, "end_session": end}
        _later_event(tx, "at-commit")
        tx.later("end_session")  # kept, like the event: it runs in the round trip with COMMIT

    with pytest.raises(psycopg.OperationalError):
        store.transact_sync(fn)
    assert len(calls) == 1, "an unknown outcome is not retried"
    assert _events(store, "at-commit") == 0, "the session ended before COMMIT ran"
    # The broken connection is not handed out again: the next transactions go through.
    for _ in range(5):
        assert store.transact_sync(lambda tx: tx.one("now")) is not None


def test_a_connection_found_dead_while_sending_the_last_writes_runs_again(
    store: PostgresStore, pg_url: str
) -> None:
    """Ended before the last round trip goes out, the session fails the send itself: COMMIT was
    never sent, so the transaction runs again on a fresh connection."""
    calls: list[int] = []

    def fn(tx: PgTx) -> None:
        calls.append(tx.conn.info.backend_pid)
        tx.one("now")
        _later_event(tx, "resent")
        if len(calls) == 1:
            _end_backend(pg_url, tx.conn.info.backend_pid)

    store.transact_sync(fn)
    assert len(calls) == 2 and calls[0] != calls[1]
    assert _events(store, "resent") == 1


def test_a_lock_timeout_is_raised_once_not_taken_for_a_lost_connection(
    store: PostgresStore, pg_url: str
) -> None:
    """A statement stopped by the server in a live session (here by lock_timeout) is the
    transaction's failure to report, not a lost connection to retry on a fresh one."""
    calls: list[int] = []
    with psycopg.connect(pg_url) as holder:
        holder.execute("SELECT pg_advisory_xact_lock(4242)")  # held until this connection's tx ends

        def fn(tx: PgTx) -> None:
            calls.append(tx.conn.info.backend_pid)
            tx.sql("SELECT set_config('lock_timeout', '200ms', true)")
            tx.sql("SELECT pg_advisory_xact_lock(4242)")

        with pytest.raises(psycopg.errors.LockNotAvailable):
            store.transact_sync(fn)
    assert len(calls) == 1
    assert store.transact_sync(lambda tx: tx.one("now")) is not None  # and the pool goes on


def test_a_wait_for_a_pooled_connection_that_runs_out_is_raised_once_not_retried(
    store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    """No connection to be had (the server down, or every one lent): PoolTimeout lost no session,
    so it is raised after one wait, not taken for a lost connection and waited for again (a
    round of a worker whose server is down took two pool timeouts, 10 s, and a stop waited on it)."""
    from psycopg_pool import PoolTimeout

    held = [store.pool.getconn() for _ in range(store.pool.max_size)]
    store.pool.timeout = 0.2
    before = store.pool.get_stats().get("requests_errors", 0)
    ran: list[int] = []
    try:
        with pytest.raises(PoolTimeout):
            store.transact_sync(lambda tx: ran.append(1))
    finally:
        for conn in held:
            store.pool.putconn(conn)
    assert ran == []
    assert store.pool.get_stats().get("requests_errors", 0) - before == 1, "waited for a connection twice"
    assert "retrying the transaction" not in caplog.text
