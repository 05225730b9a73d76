"""The store's own SQLite connections set the busy handler only when it changes: off to try for the
write lock, left off through write transactions in WAL mode, on again for a reader (which may meet
a recovery and must wait it out) and, out of WAL mode, for the statements after BEGIN (COMMIT waits
for readers there). A caller's lent connection is set back after every block, as before."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from stepwarden.errors import StoreError
from stepwarden.store import SQLiteStore
from stepwarden.store.base import Tx, hot, read_only


@pytest.fixture
def store(marks_store: SQLiteStore) -> SQLiteStore:
    return marks_store


def busy_timeout(tx: Tx) -> int:
    """The busy timeout in force inside the transaction, in ms (written to a row: a write)."""
    tx.sql("INSERT INTO marks (v) VALUES ('w')")
    return int(tx.sql("PRAGMA busy_timeout")[0]["timeout"])


@read_only
def busy_timeout_reading(tx: Tx) -> int:
    return int(tx.sql("PRAGMA busy_timeout")[0]["timeout"])


@hot
def hot_busy_timeout(tx: Tx) -> int:
    return busy_timeout(tx)


def traced(conn: sqlite3.Connection) -> list[str]:
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    return statements


def test_write_transactions_in_wal_mode_set_the_busy_handler_once_not_twice_each(store: SQLiteStore) -> None:
    store.transact_sync(busy_timeout)
    statements = traced(store._conn())
    for _ in range(10):
        assert store.transact_sync(busy_timeout) == 0  # WAL: the lock is held, nothing waits
    assert not [s for s in statements if "busy_timeout =" in s]
    assert statements.count("BEGIN IMMEDIATE") == 10


def test_a_reader_after_a_writer_has_the_busy_handler_back_and_the_next_writer_takes_it_off(
    store: SQLiteStore,
) -> None:
    store.transact_sync(busy_timeout)
    assert store.transact_sync(busy_timeout_reading) == 5000
    assert store.transact_sync(busy_timeout) == 0
    statements = traced(store._conn())
    for _ in range(3):
        store.transact_sync(busy_timeout_reading)
    assert [s for s in statements if "busy_timeout =" in s] == ["PRAGMA busy_timeout = 5000"]  # once


def test_out_of_wal_mode_the_statements_after_begin_have_the_busy_handler(store: SQLiteStore) -> None:
    """A store that could not enter WAL mode (a file system without shared memory): COMMIT waits
    for the readers there, so the handler is on again as soon as the lock is taken."""
    conn = store._conn()
    conn.wal = False
    assert store.transact_sync(busy_timeout) == 5000
    assert store.transact_sync(busy_timeout) == 5000


def test_a_store_that_is_not_in_wal_mode_keeps_the_busy_handler_after_begin() -> None:
    """The same, on a real store out of WAL mode (in memory: its journal mode is ``memory``)."""
    store = SQLiteStore(":memory:", busy_timeout=5)
    try:
        store.transact_sync(lambda tx: tx.sql("CREATE TABLE marks (v TEXT)"))
        assert not store._conn().wal
        assert store.transact_sync(busy_timeout) == 5000
        assert store.transact_sync(busy_timeout_reading) == 5000
    finally:
        store.close()


def test_a_plain_connection_handed_to_transact_on_is_set_back_after_begin(store: SQLiteStore) -> None:
    conn = sqlite3.connect(store.path, isolation_level=None, timeout=5)
    try:
        assert store.transact_on(conn, busy_timeout) == 5000
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    finally:
        conn.close()


def test_the_hot_path_on_the_event_loop_leaves_it_off_too(store: SQLiteStore) -> None:
    async def main() -> list[int]:
        return [await store.transact(hot_busy_timeout) for _ in range(3)]

    assert asyncio.run(main()) == [0, 0, 0]


def test_a_writer_still_waits_for_the_lock_another_process_holds_and_gives_up_at_its_timeout(
    tmp_path: Path,
) -> None:
    """The handler being off must not turn a held lock into an error: the store's own retries
    wait for it, up to busy_timeout, as before."""
    store = SQLiteStore(str(tmp_path / "sw.db"), busy_timeout=0.5)
    try:
        store.transact_sync(lambda tx: tx.sql("CREATE TABLE marks (v TEXT)"))
        other = sqlite3.connect(store.path, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        threading.Timer(0.2, lambda: other.execute("COMMIT")).start()
        assert store.transact_sync(busy_timeout) == 0  # waited ~0.2 s, then took it
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreError, match="stayed locked by another writer"):
            store.transact_sync(busy_timeout)
        other.execute("ROLLBACK")
        other.close()
        assert store.transact_sync(lambda tx: tx.sql("SELECT count(*) AS n FROM marks"))[0]["n"] == 1
    finally:
        store.close()


def test_a_lent_connection_keeps_the_busy_handler_it_was_lent_with(store: SQLiteStore) -> None:
    with store.lend() as conn:
        store.begin(conn)
        assert conn.execute("PRAGMA busy_timeout").fetchone()["timeout"] == 5000
        conn.execute("ROLLBACK")
        assert not getattr(conn, "busy_off", False)
