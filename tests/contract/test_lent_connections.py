"""``app.transaction()`` without a connection of the caller's: the store lends one (PostgreSQL:
from a pool of its own; SQLite: the thread's) instead of opening one per block, and a lent
connection carries nothing from one block into the next: not a setting, not a dead session, not
an open transaction."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_transactions import make_app  # the same one-step order app

from stepwarden import App


@pytest.fixture
def pg_app(pg_url: str) -> Iterator[App]:
    app = make_app(pg_url)
    yield app
    app.close()


def one(tx: Any, sql: str) -> Any:
    return tx.execute(sql).fetchone()[0]


def states(app: App) -> list[str]:
    return [
        r["state"] for r in app.store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks ORDER BY id"))
    ]


def test_postgres_lends_the_same_session_block_after_block_with_the_callers_settings(pg_app: App) -> None:
    with pg_app.transaction() as tx:
        first = one(tx, "SELECT pg_backend_pid()")
        tx.execute("SET statement_timeout = '1234ms'")
        tx.execute("SET enable_seqscan = off")
        tx.submit("order", {"n": 1})
    with pg_app.transaction() as tx:
        assert one(tx, "SELECT pg_backend_pid()") == first, "a new server session per block"
        assert one(tx, "SHOW statement_timeout") == "0", "a SET of the previous block outlived it"
        assert one(tx, "SHOW enable_seqscan") == "on"  # the caller's SQL is planned as usual
        assert one(tx, "SHOW lock_timeout") == "10s"  # our limits for a caller's session hold
        assert one(tx, "SHOW idle_in_transaction_session_timeout") == "5s"
        tx.submit("order", {"n": 2})
    assert states(pg_app) == ["pending", "pending"]


def test_postgres_replaces_a_lent_session_the_server_ended(pg_app: App, pg_url: str) -> None:
    with pg_app.transaction() as tx:
        first = one(tx, "SELECT pg_backend_pid()")
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (first,))
        # The session has ended while idle (as a server restart or an idle timeout ends it)
        # before the next block asks for one: wait until its process is gone.
        deadline = time.monotonic() + 10
        while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (first,)).fetchone():
            assert time.monotonic() < deadline, "the terminated backend did not exit in 10 s"
            time.sleep(0.01)
    with pg_app.transaction() as tx:  # the dead session is not lent: no error, a new one
        assert one(tx, "SELECT pg_backend_pid()") != first
        task_id = tx.submit("order", {"n": 1})
    assert pg_app.task(task_id)["state"] == "pending"


def test_postgres_a_failed_block_gives_back_a_usable_session(pg_app: App) -> None:
    with pytest.raises(psycopg.errors.DivisionByZero), pg_app.transaction() as tx:
        tx.submit("order", {"n": 1})
        tx.execute("SELECT 1 / 0")
    with pg_app.transaction() as tx:
        tx.submit("order", {"n": 2})
    assert states(pg_app) == ["pending"]  # the failed block's task rolled back, the next one stands


def test_postgres_closing_the_app_ends_the_lent_sessions(pg_url: str) -> None:
    app = make_app(pg_url)
    with app.transaction() as tx:
        pid = one(tx, "SELECT pg_backend_pid()")
    app.close()
    with psycopg.connect(pg_url, autocommit=True) as admin:
        alive = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert alive is not None and alive[0] == 0


@pytest.fixture
def sqlite_app(tmp_path: Path) -> Iterator[App]:
    app = make_app(f"sqlite:///{tmp_path / 'store.db'}")
    yield app
    app.close()


def test_sqlite_lends_the_threads_connection_and_sets_back_what_the_block_changed(sqlite_app: App) -> None:
    with sqlite_app.transaction() as tx:
        lent = tx.connection
        tx.connection.row_factory = None  # the caller's own change to the connection
        tx.submit("order", {"n": 1})
    with sqlite_app.transaction() as tx:
        assert tx.connection is lent, "a new connection per block"
        assert tx.execute("PRAGMA synchronous").fetchone() == {"synchronous": 2}  # rows as ours, FULL
        tx.submit("order", {"n": 2})
    sqlite_app.submit("order", {"n": 3})  # the same connection, in the same thread
    assert states(sqlite_app) == ["pending"] * 3


def test_sqlite_a_failed_block_leaves_no_transaction_open(sqlite_app: App, tmp_path: Path) -> None:
    with pytest.raises(sqlite3.OperationalError), sqlite_app.transaction() as tx:
        tx.submit("order", {"n": 1})
        tx.execute("SELECT * FROM no_such_table")
    free_write_lock(tmp_path / "store.db")
    assert states(sqlite_app) == []
    with sqlite_app.transaction() as tx:
        tx.submit("order", {"n": 2})
    assert states(sqlite_app) == ["pending"]


def test_sqlite_a_connection_whose_rollback_failed_is_closed_not_lent_again(
    sqlite_app: App, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ROLLBACK that fails (a disk error, say) leaves the transaction open, holding the write
    lock: that connection is closed, so the lock is freed and the next block gets a new one."""

    def failing_rollback(conn: Any) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(sqlite_app.store, "rollback", failing_rollback)
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"), sqlite_app.transaction() as tx:
        lent = tx.connection
        tx.submit("order", {"n": 1})
        raise RuntimeError("the caller's block failed")
    monkeypatch.undo()
    free_write_lock(tmp_path / "store.db")
    with sqlite_app.transaction() as tx:
        assert tx.connection is not lent
        tx.submit("order", {"n": 2})
    assert states(sqlite_app) == ["pending"]


def free_write_lock(path: Path) -> None:
    other = sqlite3.connect(path, timeout=0.5)
    other.execute("BEGIN IMMEDIATE")  # raises "database is locked" if a block still held it
    other.execute("ROLLBACK")
    other.close()
