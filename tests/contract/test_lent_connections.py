"""``app.transaction()`` without a connection of the caller's: the store lends one from a few it
keeps for callers (PostgreSQL: a pool of its own; SQLite: a short list apart from its own
connections) instead of opening one per block, and a lent connection carries nothing from one
block into the next: not a setting, a role, a temporary table, a lock, a dead session or an open
transaction."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import psycopg_pool
import pytest
from psycopg.rows import dict_row
from test_transactions import make_app  # the same one-step order app

from stepwarden import App, InputError, StoreError
from stepwarden.store import postgres


def one(tx: Any, sql: str) -> Any:
    return tx.execute(sql).fetchone()[0]


def states(app: App) -> list[str]:
    return [
        r["state"] for r in app.store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks ORDER BY id"))
    ]


def wait_gone(admin: Any, pid: int) -> None:
    """Until the server process ``pid`` has exited (a session ends a moment after it is told to)."""
    deadline = time.monotonic() + 10
    while admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
        assert time.monotonic() < deadline, f"server process {pid} did not exit in 10 s"
        time.sleep(0.01)


def submits_on_another_session(app: App, first: int) -> None:
    """A block that runs on a server session other than ``first`` and submits a task."""
    with app.transaction() as tx:
        assert one(tx, "SELECT pg_backend_pid()") != first
        tx.submit("order", {"n": "next"})


@pytest.fixture
def pg_app(pg_url: str) -> Iterator[App]:
    app = make_app(pg_url)
    yield app
    app.close()


@pytest.fixture
def role(pg_url: str) -> Iterator[str]:
    name = f"sw_probe_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {name}")
        admin.execute(f"GRANT {name} TO CURRENT_USER")
    yield name
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f"DROP ROLE {name}")


def test_postgres_lends_one_session_and_the_next_block_finds_nothing_of_the_last(
    pg_app: App, role: str
) -> None:
    with pg_app.transaction() as tx:
        first = one(tx, "SELECT pg_backend_pid()")
        me = one(tx, "SELECT current_user")
        tx.execute("SET statement_timeout = '1234ms'")
        tx.execute("CREATE TEMP TABLE staging (x int)")
        tx.execute("SELECT pg_advisory_lock(42)")
        tx.connection.row_factory = dict_row
        tx.submit("order", {"n": 1})
        tx.execute(f"SET ROLE {role}")
    with pg_app.transaction() as tx:
        assert one(tx, "SELECT pg_backend_pid()") == first, "a new server session per block"
        assert one(tx, "SELECT current_user") == me
        assert one(tx, "SHOW statement_timeout") == "0"
        assert one(tx, "SELECT to_regclass('pg_temp.staging') IS NULL") is True
        assert (
            one(tx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
            == 0
        )
        assert one(tx, "SHOW enable_seqscan") == "on"  # the caller's SQL is planned as usual
        assert one(tx, "SHOW lock_timeout") == "10s"  # our limits for a caller's session hold
        assert one(tx, "SHOW idle_in_transaction_session_timeout") == "1min"  # a block's, not a role's
        tx.submit("order", {"n": 2})
        tx.execute("LISTEN news")
        tx.execute("NOTIFY news, 'for this block only'")  # delivered to this session at commit
        tx.execute("DECLARE kept CURSOR WITH HOLD FOR SELECT 1")
        tx.execute(f"SET SESSION AUTHORIZATION {role}")
    with pg_app.transaction() as tx:
        assert one(tx, "SELECT pg_backend_pid()") == first
        assert one(tx, "SELECT session_user") == me
        assert one(tx, "SELECT count(*) FROM pg_listening_channels()") == 0
        assert list(tx.connection.notifies(timeout=0)) == []
        assert one(tx, "SELECT count(*) FROM pg_cursors") == 0
    assert states(pg_app) == ["pending", "pending"]


def set_aside_lines(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    """The store's own lines about a connection it closed instead of lending it again, and the
    pool's warnings (which it would log for every closed connection given back)."""
    ours = [r.getMessage() for r in caplog.records if r.name == "stepwarden.postgres"]
    pools = [
        r.getMessage() for r in caplog.records if r.name == "psycopg.pool" and r.levelno >= logging.WARNING
    ]
    return [m for m in ours if "not lent again" in m], pools


def test_the_pools_warning_is_held_back_only_for_a_connection_the_store_set_aside(pg_url: str) -> None:
    """A connection the pool itself finds closed is a fault: its warning goes through."""
    from stepwarden.store import pg_sessions as pg

    def record(conn: Any) -> logging.LogRecord:
        return logging.LogRecord(
            "psycopg.pool", logging.WARNING, __file__, 1, "discarding closed connection: %s", (conn,), None
        )

    with psycopg.connect(pg_url) as mine, psycopg.connect(pg_url) as other:
        pg._set_aside(mine, "a test")
        assert not pg._NOT_FOR_SET_ASIDE.filter(record(mine))
        assert pg._NOT_FOR_SET_ASIDE.filter(record(other))
        assert pg._NOT_FOR_SET_ASIDE.filter(
            logging.LogRecord(
                "psycopg.pool", logging.WARNING, __file__, 1, "something else: %s", (mine,), None
            )
        )


def test_postgres_a_session_with_a_statement_the_caller_prepared_is_not_lent_again(
    pg_app: App, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with pg_app.transaction() as tx:
        first = one(tx, "SELECT pg_backend_pid()")
        tx.execute("PREPARE mine AS SELECT 1")
    with pg_app.transaction() as tx:
        assert one(tx, "SELECT pg_backend_pid()") != first
        tx.execute("PREPARE mine AS SELECT 1")  # the name is free: a session without it
    # said by the store, as a decision, once per block (each PREPAREd): no warning from the pool
    ours, pools = set_aside_lines(caplog)
    assert len(ours) == 2 and all("PREPAREd" in m for m in ours)
    assert pools == []


def test_postgres_replaces_a_lent_session_the_server_ended(pg_app: App, pg_url: str) -> None:
    with pg_app.transaction() as tx:
        first = one(tx, "SELECT pg_backend_pid()")
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (first,))
        wait_gone(admin, first)  # ended while idle, as a server restart or an idle timeout ends it
    started = time.monotonic()
    submits_on_another_session(pg_app, first)  # the dead session is not lent: no error, a new one
    took = time.monotonic() - started
    # ... and is gone from the pool: it was put back (its goodbye unread), met again at every lend
    # until the lend's 0.5 s wait ran out, then a private connection opened, block after block.
    pids, times = [], [took]
    for _ in range(4):
        started = time.monotonic()
        with pg_app.transaction() as tx:
            pids.append(one(tx, "SELECT pg_backend_pid()"))
        times.append(time.monotonic() - started)
    assert len(set(pids)) <= 2, f"a new session per block: {pids}"  # the pool's, lent again
    assert max(times) < 0.4, f"blocks after the server ended a session took {times}"
    assert states(pg_app) == ["pending"]


def test_postgres_a_failed_block_gives_back_its_session_rolled_back(pg_app: App) -> None:
    with pytest.raises(psycopg.errors.DivisionByZero), pg_app.transaction() as tx:
        first = one(tx, "SELECT pg_backend_pid()")
        tx.submit("order", {"n": 1})
        tx.execute("SELECT 1 / 0")
    with pg_app.transaction() as tx:
        assert one(tx, "SELECT pg_backend_pid()") == first
        tx.submit("order", {"n": 2})
    assert states(pg_app) == ["pending"]  # the failed block's task rolled back, the next one stands


def test_postgres_blocks_after_a_refused_submission_find_their_statements(pg_app: App) -> None:
    """Found by the fuzz test: a block that ran none of our statements, then blocks that did.
    When a lent session was set back with DISCARD ALL, psycopg missed one (it looks only at
    statements new to it) and named a statement the server had forgotten ("prepared statement
    _pg3_2 does not exist")."""
    with pytest.raises(InputError), pg_app.transaction() as tx:
        tx.submit("order", {"n": object()})  # refused before any statement: not JSON
    for n in range(1, 8):
        with pg_app.transaction() as tx:
            tx.submit("order", {"n": n}, idempotency_key=f"k{n % 2}")
    assert states(pg_app) == ["pending", "pending"]


def test_postgres_the_callers_sql_meets_no_plan_cached_before_their_schema_changed(
    pg_app: App, pg_url: str
) -> None:
    with pg_app.transaction() as tx:
        tx.execute("CREATE TABLE orders (id int, total int)")
    with pg_app.transaction() as tx:
        first = one(tx, "SELECT pg_backend_pid()")
        for _ in range(8):  # past psycopg's threshold for preparing a statement
            tx.execute("SELECT * FROM orders").fetchall()
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute("ALTER TABLE orders ALTER COLUMN total TYPE bigint")
    with pg_app.transaction() as tx:
        assert one(tx, "SELECT pg_backend_pid()") == first  # the same session, lent again
        assert tx.execute("SELECT * FROM orders").fetchall() == []


def test_postgres_a_session_lost_in_a_block_fails_that_block_only(
    pg_app: App, caplog: pytest.LogCaptureFixture
) -> None:
    """The connection dies under the block (its server process ended mid-transaction): the block
    fails, its task is not written, and the session is not lent again."""
    caplog.set_level(logging.INFO)
    with pytest.raises(psycopg.OperationalError), pg_app.transaction() as tx:
        first = one(tx, "SELECT pg_backend_pid()")
        tx.submit("order", {"n": 1})
        tx.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    submits_on_another_session(pg_app, first)
    assert states(pg_app) == ["pending"]
    ours, pools = set_aside_lines(caplog)  # a fault: said once, as a warning, by the store
    assert len(ours) == 1 and "could not be set back" in ours[0]
    assert [r.levelno for r in caplog.records if "not lent again" in r.getMessage()] == [logging.WARNING]
    assert pools == []


def test_postgres_a_block_that_meets_the_pool_closing_opens_its_own(
    pg_app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pg_app.transaction() as tx:
        first = one(tx, "SELECT pg_backend_pid()")
    pool = pg_app.store._callers()  # type: ignore[attr-defined]

    def closing(timeout: float | None = None) -> Any:
        raise psycopg_pool.PoolClosed("the store is closing")

    monkeypatch.setattr(pool, "getconn", closing)
    submits_on_another_session(pg_app, first)
    assert states(pg_app) == ["pending"]


def test_postgres_a_block_that_finds_every_session_lent_opens_its_own(
    pg_app: App, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(postgres, "CALLER_POOL_MAX", 1)
    monkeypatch.setattr(postgres, "CALLER_POOL_WAIT", 0.05)
    with pg_app.transaction() as outer:
        outer_pid = one(outer, "SELECT pg_backend_pid()")
        outer.submit("order", {"n": 1})
        with pg_app.transaction() as inner:  # a block inside a block: no deadlock, no timeout
            assert one(inner, "SELECT pg_backend_pid()") != outer_pid
            inner.submit("order", {"n": 2})
    assert states(pg_app) == ["pending", "pending"]


def test_postgres_closing_the_app_ends_the_lent_sessions(pg_url: str) -> None:
    app = make_app(pg_url)
    with app.transaction() as tx:
        pid = one(tx, "SELECT pg_backend_pid()")
    with psycopg.connect(pg_url, autocommit=True) as admin:
        assert admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone(), "kept"
        app.close()
        wait_gone(admin, pid)
    with app.transaction() as tx:  # after close, as before: a connection of its own
        tx.submit("order", {"n": 1})


@pytest.fixture
def sqlite_app(tmp_path: Path) -> Iterator[App]:
    app = make_app(f"sqlite:///{tmp_path / 'store.db'}")
    yield app
    app.close()


def test_sqlite_lends_a_kept_connection_apart_from_the_stores_own(sqlite_app: App) -> None:
    with sqlite_app.transaction() as tx:
        lent = tx.connection
        tx.connection.text_factory = bytes  # the caller's own change to the connection
        tx.connection.row_factory = None
        tx.submit("order", {"n": 1})
    sqlite_app.submit("order", {"n": 2})  # the store's own connection never saw the change
    assert states(sqlite_app) == ["pending", "pending"]
    with sqlite_app.transaction() as tx:
        assert tx.connection is lent, "a new connection per block"
        assert tx.execute("PRAGMA synchronous").fetchone() == {"synchronous": 2}  # our rows, FULL
        assert tx.execute("SELECT state FROM tasks LIMIT 1").fetchone() == {"state": "pending"}
        tx.submit("order", {"n": 3})
    assert states(sqlite_app) == ["pending"] * 3


def test_sqlite_a_connection_left_with_a_temporary_table_is_not_lent_again(sqlite_app: App) -> None:
    with sqlite_app.transaction() as tx:
        lent = tx.connection
        tx.execute("CREATE TEMP TABLE staging (x)")
    with sqlite_app.transaction() as tx:
        assert tx.connection is not lent
        tx.execute("CREATE TEMP TABLE staging (x)")  # the name is free: a clean connection


def test_sqlite_a_connection_with_a_setting_changed_is_not_lent_again(sqlite_app: App) -> None:
    with sqlite_app.transaction() as tx:
        tx.execute("CREATE TABLE IF NOT EXISTS paid (amount INTEGER CHECK (amount > 0))")
    with sqlite_app.transaction() as tx:
        lent = tx.connection
        tx.execute("PRAGMA ignore_check_constraints = ON")
    with sqlite_app.transaction() as tx:
        assert tx.connection is not lent
        with pytest.raises(sqlite3.IntegrityError):  # the CHECK holds for the next block
            tx.execute("INSERT INTO paid VALUES (-5)")


def test_sqlite_a_failed_block_leaves_no_transaction_open(sqlite_app: App, tmp_path: Path) -> None:
    with pytest.raises(sqlite3.OperationalError), sqlite_app.transaction() as tx:
        tx.submit("order", {"n": 1})
        tx.execute("SELECT * FROM no_such_table")
    free_write_lock(tmp_path / "store.db")
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


def test_sqlite_a_connection_the_block_closed_is_not_lent_again(sqlite_app: App) -> None:
    with pytest.raises(sqlite3.ProgrammingError), sqlite_app.transaction() as tx:
        lent = tx.connection
        tx.connection.close()
    with sqlite_app.transaction() as tx:
        assert tx.connection is not lent
        tx.submit("order", {"n": 1})
    assert states(sqlite_app) == ["pending"]


def test_sqlite_keeps_a_few_connections_whatever_the_number_of_threads(sqlite_app: App) -> None:
    def block(n: int) -> None:
        with sqlite_app.transaction() as tx:
            tx.submit("order", {"n": n})

    threads = [threading.Thread(target=block, args=(n,)) for n in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert states(sqlite_app) == ["pending"] * 20
    kept = sqlite_app.store._idle  # type: ignore[attr-defined]
    assert 1 <= len(kept) <= 4


def free_write_lock(path: Path) -> None:
    other = sqlite3.connect(path, timeout=0.5)
    other.execute("BEGIN IMMEDIATE")  # raises "database is locked" if a block still held it
    other.execute("ROLLBACK")
    other.close()


def test_sqlite_placeholders_on_postgres_fail_with_a_note_and_write_nothing(pg_app: App) -> None:
    """Code moved from SQLite keeps its ``?``: psycopg's own error, with a note that says what to
    write instead, and the block's submission rolled back with it."""
    with pg_app.transaction() as tx:
        tx.execute("CREATE TABLE orders (id text PRIMARY KEY)")
    with pytest.raises(psycopg.ProgrammingError) as raised, pg_app.transaction() as tx:
        tx.submit("order", {"n": 1})
        tx.execute("INSERT INTO orders (id) VALUES (?)", ("o-1",))
    assert any("%s placeholders" in note for note in getattr(raised.value, "__notes__", [])), raised.value
    assert states(pg_app) == []
    with pg_app.transaction() as tx:
        tx.execute("INSERT INTO orders (id) VALUES (%s)", ("o-1",))
        assert one(tx, "SELECT count(*) FROM orders") == 1


# -- time limits on a block's session ------------------------------------------------------------


def test_postgres_a_block_may_wait_on_the_network_for_a_minute(pg_app: App) -> None:
    """A block's session had the roles' 5 s idle-in-transaction limit: a web handler that called
    a payment service inside its block for more than 5 s lost the block. It has a minute now, and
    keeps it on the session the next block is lent."""
    for _ in range(2):
        with pg_app.transaction() as tx:
            assert one(tx, "SHOW idle_in_transaction_session_timeout") == "1min"
            assert one(tx, "SHOW lock_timeout") == "10s"


@pytest.mark.parametrize("where", ["in-the-block", "at-its-end"])
def test_postgres_a_block_whose_session_the_server_ended_says_why(pg_app: App, where: str) -> None:
    """The server ends a session left idle in its transaction past the limit; the user saw
    psycopg's "the connection is lost" (from the rollback of a connection already dead), the
    real cause hidden in the chain. Now: a StoreError naming the limit, nothing committed, and
    the next block works on a fresh session."""
    idle = "idle inside its transaction past idle_in_transaction"
    with pytest.raises(StoreError, match=idle) as raised, pg_app.transaction() as tx:
        tx.submit("order", {"n": "lost"})
        tx.execute("SET LOCAL idle_in_transaction_session_timeout = '200ms'")
        time.sleep(1.0)  # the server's limit, not a race: five times the 200 ms it is set to
        if where == "in-the-block":
            tx.execute("SELECT 1")
    assert getattr(raised.value.__cause__, "sqlstate", None) == "25P03"
    with pg_app.transaction() as tx:
        tx.submit("order", {"n": "next"})
    assert states(pg_app) == ["pending"]  # the next block's task; nothing of the lost one


def test_postgres_a_submission_that_waited_out_the_lock_timeout_says_it_was_not_written(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another transaction holds the idempotency key (submitted, not committed); a submission of
    the same key waits for it until lock_timeout. That was reported as a lost connection ("may or
    may not have been written"); the statement was stopped in a live session and wrote nothing."""
    monkeypatch.setattr(
        postgres,
        "OUR_SESSIONS",
        tuple((k, "300ms" if k == "lock_timeout" else v) for k, v in postgres.OUR_SESSIONS),
    )
    app = make_app(pg_url)
    try:
        with app.transaction() as tx:
            first = tx.submit("order", {"n": 1}, idempotency_key="order-1")
            with pytest.raises(
                StoreError, match=r"not written: it waited lock_timeout .* same idempotency key"
            ):
                app.submit("order", {"n": 1}, idempotency_key="order-1")
        assert app.submit("order", {"n": 1}, idempotency_key="order-1") == first
    finally:
        app.close()
