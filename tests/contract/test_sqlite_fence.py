"""``tx.fence(lead)`` on the caller's own ``sqlite3`` connection (LEAD4, LEAD7, SUB2): from the
fence on, no successor can take the lease until the block's transaction ends, so a deposed
leader's writes never commit after its successor took over. ``sqlite3`` in its default mode
begins a transaction only before the first write: the fence's check used to run outside any
transaction, and the block's writes in one begun after a successor's acquire.

SQLite only: on PostgreSQL the fence share-locks the lease row, on any connection (the same
contract test in ``test_transactions.py`` runs there)."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_transactions import make_app  # the same one-step order app

from stepwarden import App, Leadership, LostOwnership, StoreError
from stepwarden.clock import FakeClock
from stepwarden.store import Store, open_store

LEASE = "nightly"


def default_mode(path: str) -> sqlite3.Connection:
    """``sqlite3.connect(path)`` as the docs of ``sqlite3`` show it: no transaction until a write."""
    return sqlite3.connect(path)


def deferred(path: str) -> sqlite3.Connection:
    """A transaction begun with a plain ``BEGIN``: it reads a snapshot and writes nothing yet."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    return conn


CONNECTIONS: list[Callable[[str], sqlite3.Connection]] = [default_mode, deferred]
if sys.version_info >= (3, 12):

    def pep249(path: str) -> sqlite3.Connection:
        """Python 3.12's ``autocommit=False``: a deferred transaction is always open."""
        return sqlite3.connect(path, autocommit=False)

    CONNECTIONS.append(pep249)


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "store.db")


@pytest.fixture
def app(path: str, clock: FakeClock) -> Iterator[App]:
    """The order app on ``path``, its database clock the test's, with the business table ``orders``."""
    a = make_app(f"sqlite:///{path}")
    a.use_store(open_store(f"sqlite:///{path}", clock=clock))
    with a.transaction() as tx:
        tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)")
    yield a
    a.close()


@pytest.fixture
def successor(path: str, clock: FakeClock) -> Iterator[Store]:
    """Another process's store on the same file, giving up on a taken write lock after 0.2 s."""
    s = open_store(f"sqlite:///{path}?busy_timeout=0.2", clock=clock)
    yield s
    s.close()


def acquire(store: Store, holder: str) -> int | None:
    got = asyncio.run(store.acquire_lease(LEASE, holder, 5.0))
    return None if got is None else int(got[0])


def orders(path: str) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [r[0] for r in conn.execute("SELECT id FROM orders ORDER BY total")]
    finally:
        conn.close()


def commit(conn: sqlite3.Connection) -> None:
    """The caller's commit; on the ``deferred`` connection, the next transaction begun too (as
    ``autocommit=False`` does), since one in autocommit mode outside a transaction is refused."""
    if conn.isolation_level is None:
        conn.execute("COMMIT")
        conn.execute("BEGIN")
    else:
        conn.commit()


@pytest.mark.parametrize("connect", CONNECTIONS, ids=lambda f: f.__name__)
def test_no_successor_takes_the_lease_between_the_fence_and_the_blocks_commit(
    app: App, successor: Store, clock: FakeClock, path: str, connect: Callable[[str], sqlite3.Connection]
) -> None:
    """A leader fences its block, then pauses past its lease's end: the successor's acquire waits
    for the block's write lock (and gives up here), so the block's write commits under the term
    it checked; the successor leads once the block has committed, and the old term's next block
    raises LostOwnership, writes nothing, and leaves no lock held."""
    term = acquire(app.store, "A")
    assert term is not None
    lead = Leadership(LEASE, "A", term, clock)
    conn = connect(path)
    try:
        with app.transaction(conn) as tx:
            tx.fence(lead)
            clock.advance(10)  # A's lease has ended: only the fenced block stands in the way
            with pytest.raises(StoreError, match="stayed locked by another writer"):
                acquire(successor, "B")
            tx.execute("INSERT INTO orders VALUES (?, ?)", ("by-a", 1))
        commit(conn)
        assert acquire(successor, "B") == term + 1, "the successor takes over once the block is over"
        with pytest.raises(LostOwnership, match="term 1 is no longer held by A"), app.transaction(conn) as tx:
            tx.fence(lead)
            tx.execute("INSERT INTO orders VALUES (?, ?)", ("late", 2))
        commit(conn)
        with app.transaction(conn) as tx:  # the failed fence left no write lock taken
            tx.fence(Leadership(LEASE, "B", term + 1, clock))
            tx.execute("INSERT INTO orders VALUES (?, ?)", ("by-b", 3))
        commit(conn)
    finally:
        conn.close()
    assert orders(path) == ["by-a", "by-b"]


def test_a_fence_after_the_transaction_read_an_older_state_is_refused(
    app: App, successor: Store, clock: FakeClock, path: str
) -> None:
    """A deferred transaction that read before another connection's write can never take the
    write lock (SQLite writes only from the newest state): the fence says so, at once, instead
    of passing on the old snapshot while a successor takes the lease, and the write failing later
    with "database is locked"."""
    term = acquire(app.store, "A")
    assert term is not None
    conn = deferred(path)
    try:
        conn.execute("SELECT COUNT(*) FROM orders").fetchone()  # the transaction's snapshot
        other = sqlite3.connect(path)
        other.execute("INSERT INTO orders VALUES ('elsewhere', 0)")
        other.commit()
        other.close()
        with (
            pytest.raises(
                StoreError, match=r"read the SQLite store .* before another connection's last write"
            ),
            app.transaction(conn) as tx,
        ):
            tx.fence(Leadership(LEASE, "A", term, clock))
            tx.execute("INSERT INTO orders VALUES (?, ?)", ("by-a", 1))
        conn.execute("ROLLBACK")
    finally:
        conn.close()
    assert orders(path) == ["elsewhere"]


def test_a_failed_fence_on_the_callers_connection_holds_no_lock(
    app: App, path: str, clock: FakeClock
) -> None:
    """The fence begins the transaction to take the write lock; a check that fails rolls that
    back, holding nothing: a deposed leader that catches LostOwnership must not keep the lock
    from the new leader. (Broken for a while when the block began a transaction of its own.)"""
    conn = default_mode(path)
    other = sqlite3.connect(path, timeout=0.5, isolation_level=None)
    try:
        with pytest.raises(LostOwnership), app.transaction(conn) as tx:
            tx.fence(Leadership(LEASE, "A", 7, clock))  # a term this process never held
        assert not conn.in_transaction
        other.execute("BEGIN IMMEDIATE")  # another writer gets the lock at once
        other.execute("ROLLBACK")
    finally:
        other.close()
        conn.close()


def test_a_block_that_reads_first_then_writes_after_another_connections_commit(app: App, path: str) -> None:
    """sqlite3's default mode begins the transaction at the first write: a block's first read
    takes no snapshot, so another connection's commit before the block's first write is fine.
    (A BEGIN of the block's own made that read a snapshot, and the write failed: locked.)"""
    conn = default_mode(path)
    other = sqlite3.connect(path, timeout=2)
    try:
        with app.transaction(conn) as tx:
            tx.execute("SELECT COUNT(*) FROM orders").fetchone()
            other.execute("INSERT INTO orders (id) VALUES ('x')")
            other.commit()
            tx.execute("INSERT INTO orders (id) VALUES ('y')")
            tx.submit("order", {"order": "y"})
        conn.commit()
    finally:
        other.close()
        conn.close()


def test_a_submit_after_the_transaction_read_an_older_state_says_why_it_cannot_write(
    app: App, path: str
) -> None:
    """Found by review (SUB2, SUB3): the same snapshot as above, without a fence. tx.submit let the
    driver's "database is locked" out, which reads as "wait and try again"; inside that
    transaction no wait helps. Nothing is written either way."""
    conn = deferred(path)
    try:
        conn.execute("SELECT COUNT(*) FROM tasks").fetchone()  # the transaction's snapshot
        other = app.submit("order", {"order": "elsewhere"}, idempotency_key="K")
        with (
            pytest.raises(
                StoreError,
                match=r"tx.submit: .* before another connection's last write.*run the block again",
            ),
            app.transaction(conn) as tx,
        ):
            tx.submit("order", {"order": "mine"}, idempotency_key="K")
        conn.execute("ROLLBACK")
    finally:
        conn.close()
    tasks = app.store.transact_sync(lambda tx: tx.sql("SELECT id, idempotency_key FROM tasks"))
    assert tasks == [{"id": other, "idempotency_key": "K"}]
