"""SUB2 on every store: a business row and its task commit together, or neither does, both in a
transaction stepwarden opens and in one the caller already has open on their own connection."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import psycopg
import pytest

from stepwarden import App, InputError, Leadership, LostOwnership, Request, Step
from stepwarden.clock import SYSTEM_CLOCK


def make_app(url: str) -> App:
    app = App(url)
    inv = app.agent("inv")

    @inv.operation
    def reserve(req: Request) -> None:
        return None

    app.workflow("order", [Step("reserve", "inv.reserve", complete_by=5)])
    return app


def ph(app: App) -> str:
    return "?" if app.store.dialect == "sqlite" else "%s"


def rows(app: App, sql: str) -> list[dict[str, Any]]:
    return app.store.transact_sync(lambda tx: tx.sql(sql))


@pytest.fixture
def app(store_url: str) -> Any:
    a = make_app(store_url)
    with a.transaction() as tx:
        tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)")
    yield a
    a.close()


def test_row_and_task_commit_together(app: App) -> None:
    with app.transaction() as tx:
        tx.execute(f"INSERT INTO orders VALUES ({ph(app)}, {ph(app)})", ("o-1", 100))
        task_id = tx.submit("order", {"order": "o-1"}, correlation_id="o-1", reply_to="web")
    assert rows(app, "SELECT id, total FROM orders") == [{"id": "o-1", "total": 100}]
    assert app.task(task_id)["state"] == "pending"


def test_an_exception_rolls_back_row_and_task(app: App) -> None:
    with pytest.raises(RuntimeError), app.transaction() as tx:
        tx.execute(f"INSERT INTO orders VALUES ({ph(app)}, {ph(app)})", ("o-2", 5))
        tx.submit("order", {"order": "o-2"}, correlation_id="o-2")
        raise RuntimeError("the handler failed after submitting")
    assert rows(app, "SELECT COUNT(*) AS n FROM orders") == [{"n": 0}]
    assert rows(app, "SELECT COUNT(*) AS n FROM tasks") == [{"n": 0}]
    assert rows(app, "SELECT COUNT(*) AS n FROM steps") == [{"n": 0}]


def test_a_fenced_block_commits_only_under_the_current_term(app: App) -> None:
    """LEAD4 for an application's own leader work (LEAD7): a deposed leader's block raises
    LostOwnership and writes nothing; the new leader's commits."""
    store = app.store
    got = app_lease(app, "A")
    old = Leadership("nightly", "A", got, SYSTEM_CLOCK)
    with app.transaction() as tx:
        tx.fence(old)
        tx.execute(f"INSERT INTO orders VALUES ({ph(app)}, {ph(app)})", ("by-a", 1))
    run_sync(store.resign_lease("nightly", "A", got))
    new = Leadership("nightly", "B", app_lease(app, "B"), SYSTEM_CLOCK)
    assert new.term == old.term + 1
    with (
        pytest.raises(LostOwnership, match="'nightly' term 1 is no longer held by A"),
        app.transaction() as tx,
    ):
        tx.fence(old)  # the paused ex-leader wakes up
        tx.execute(f"INSERT INTO orders VALUES ({ph(app)}, {ph(app)})", ("late", 2))
    with app.transaction() as tx:
        tx.fence(new)
        tx.execute(f"INSERT INTO orders VALUES ({ph(app)}, {ph(app)})", ("by-b", 3))
    assert rows(app, "SELECT id FROM orders ORDER BY total") == [{"id": "by-a"}, {"id": "by-b"}]
    with pytest.raises(InputError, match="fence takes the Leadership"), app.transaction() as tx:
        tx.fence(1)  # type: ignore[arg-type]


def test_a_leader_paused_inside_a_fenced_block_keeps_its_successor_out_only_while_trusted(
    pg_url: str,
) -> None:
    """Found by review (LEAD5, LEAD7): on PostgreSQL the fence share-locks the lease row until the
    block ends, and a block's session may idle in its transaction for 60 s; a leader paused
    inside a fenced block (SIGSTOP) kept its successor out for 60 s instead of the lease's TTL.
    The fence now limits the idle time to the term's trust (ttl - margin): the server ends the
    paused session, the block commits nothing, and the successor takes the lease."""
    import threading
    import time

    from stepwarden.errors import StoreError

    app = make_app(pg_url)  # the lease row lock of a fenced block is PostgreSQL's
    with app.transaction() as tx:
        tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)")
    got = run_sync(app.store.acquire_lease("nightly", "A", 2.0))
    assert got is not None
    lead = Leadership("nightly", "A", int(got[0]), SYSTEM_CLOCK, trust=1.0)
    fenced, outcome = threading.Event(), []

    def paused_leader() -> None:
        try:
            with app.transaction() as tx:
                tx.fence(lead)
                tx.execute(f"INSERT INTO orders VALUES ({ph(app)}, {ph(app)})", ("paused", 1))
                fenced.set()
                time.sleep(6.0)  # paused, idle in its transaction, holding the lease row
        except StoreError as e:
            outcome.append(e)

    t = threading.Thread(target=paused_leader)
    t.start()
    try:
        assert fenced.wait(10)
        started = time.monotonic()
        successor = None
        while successor is None and time.monotonic() - started < 20:
            try:
                successor = run_sync(app.store.acquire_lease("nightly", "B", 2.0))
            except Exception:  # the row lock's wait cut by lock_timeout: try again
                successor = None
            if successor is None:
                time.sleep(0.1)
        took = time.monotonic() - started
    finally:
        t.join(10)
    assert successor is not None and int(successor[0]) == lead.term + 1
    assert took < 4.5, f"the successor waited {took:.1f} s for the paused leader's block"
    assert outcome and "ended the app.transaction() block's session" in str(outcome[0]), outcome
    assert rows(app, "SELECT COUNT(*) AS n FROM orders") == [{"n": 0}]  # nothing of it committed
    app.close()


def test_a_fence_limits_a_blocks_idle_time_to_the_trust_left_and_never_past_postgres_range(
    pg_url: str,
) -> None:
    """Found by review: the idle limit was the whole window (ttl - margin) from the fence, so a
    block fenced late in its window kept the successor out past the lease's expiry (2.9 s with
    ttl 5); and a lease of 40 days asked PostgreSQL for more milliseconds than it takes, which
    failed the caller's own transaction at the fence."""
    from stepwarden.clock import FakeClock

    app = make_app(pg_url)
    clock = FakeClock()
    got = run_sync(app.store.acquire_lease("nightly", "A", 3600.0 * 24 * 40))
    assert got is not None
    late = Leadership("nightly", "A", int(got[0]), clock, trust=4.0)
    late.trusted_until = clock.monotonic() + 0.25  # a quarter second of trust left
    long = Leadership("nightly", "A", int(got[0]), clock, trust=3600.0 * 24 * 40 - 1)

    def limit(tx: Any) -> int:
        sql = "SELECT setting FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'"
        return int(one_value(tx.execute(sql)))  # in milliseconds

    with app.transaction() as tx:
        tx.fence(late)
        assert limit(tx) == 250
    with psycopg.connect(pg_url) as own:  # the caller's own connection: no limit of ours before
        with app.transaction(own) as tx:
            tx.fence(long)  # failed with InvalidParameterValue
            assert limit(tx) == 2_147_483_647
        own.commit()
    app.close()


def one_value(cur: Any) -> str:
    row = cur.fetchone()
    return str(row[0] if isinstance(row, tuple | list) else next(iter(row.values())))


def app_lease(app: App, holder: str) -> int:
    got = run_sync(app.store.acquire_lease("nightly", holder, 60.0))
    assert got is not None
    return int(got[0])


def run_sync(coro: Any) -> Any:
    return asyncio.run(coro)


def test_inside_the_callers_own_connection_and_transaction(app: App, store_url: str) -> None:
    if store_url.startswith("sqlite:///"):
        conn: Any = sqlite3.connect(store_url[len("sqlite:///") :], isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
    else:
        conn = psycopg.connect(store_url)
    try:
        conn.execute(f"INSERT INTO orders VALUES ({ph(app)}, {ph(app)})", ("o-3", 7))
        with app.transaction(conn) as tx:
            first = tx.submit("order", {"order": "o-3"}, correlation_id="o-3")
        conn.execute("ROLLBACK") if isinstance(conn, sqlite3.Connection) else conn.rollback()
        assert rows(app, "SELECT COUNT(*) AS n FROM tasks") == [{"n": 0}], (
            "the caller's rollback undid the task"
        )
        if isinstance(conn, sqlite3.Connection):
            conn.execute("BEGIN IMMEDIATE")
        conn.execute(f"INSERT INTO orders VALUES ({ph(app)}, {ph(app)})", ("o-3", 7))
        with app.transaction(conn) as tx:
            second = tx.submit("order", {"order": "o-3"}, correlation_id="o-3")
        conn.execute("COMMIT") if isinstance(conn, sqlite3.Connection) else conn.commit()
    finally:
        conn.close()
    assert first > 0 and app.task(second)["correlation_id"] == "o-3"
    assert rows(app, "SELECT id FROM orders") == [{"id": "o-3"}]
