"""SQLite runs the hot path's transactions on the event loop's own thread (SQLiteStore.transact):
what that must not change. A wait for the write lock never freezes the loop, and it is bounded
as on the store's thread; an error rolls back; a cancelled wait leaves nothing open; a block of
``app.transaction()`` in the same thread is waited for, not refused."""

from __future__ import annotations

import asyncio
import itertools
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwarden.errors import StoreError
from stepwarden.store import SQLiteStore
from stepwarden.store.base import Tx, hot


@pytest.fixture
def store(marks_store: SQLiteStore) -> SQLiteStore:
    return marks_store


@pytest.fixture
def holder(store: SQLiteStore) -> Iterator[sqlite3.Connection]:
    """Another connection to the file, as another process would have, that can hold the lock."""
    conn = sqlite3.connect(store.path, isolation_level=None, check_same_thread=False)
    yield conn
    if conn.in_transaction:
        conn.execute("ROLLBACK")
    conn.close()


@hot
def mark(tx: Tx, value: str) -> int:
    """Writes a row and says on which thread it ran."""
    tx.sql("INSERT INTO marks (v) VALUES (?)", (value,))
    return threading.get_ident()


def mark_cold(tx: Tx, value: str) -> int:
    """:func:`mark`, not marked hot: it runs on the store's thread."""
    tx.sql("INSERT INTO marks (v) VALUES (?)", (value,))
    return threading.get_ident()


def not_hot(tx: Tx) -> int:
    return threading.get_ident()


def marks(store: SQLiteStore) -> list[str]:
    return [r["v"] for r in store.transact_sync(lambda tx: tx.sql("SELECT v FROM marks ORDER BY rowid"))]


async def ticking(until: asyncio.Event, ticks: list[float]) -> None:
    while not until.is_set():
        ticks.append(time.monotonic())
        await asyncio.sleep(0.005)


def test_a_hot_transaction_runs_on_the_loop_thread_and_others_on_the_store_thread(store: SQLiteStore) -> None:
    async def main() -> tuple[int, int, int]:
        return threading.get_ident(), await store.transact(mark, "a"), await store.transact(not_hot)

    loop_thread, hot_thread, other_thread = asyncio.run(main())
    assert hot_thread == loop_thread
    assert other_thread != loop_thread
    assert marks(store) == ["a"]


def test_with_inline_off_every_transaction_runs_on_the_store_thread(tmp_path: Path) -> None:
    s = SQLiteStore(str(tmp_path / "off.db"), inline=False)
    try:
        s.transact_sync(lambda tx: tx.sql("CREATE TABLE marks (v TEXT)"))

        async def main() -> tuple[int, int]:
            return threading.get_ident(), await s.transact(mark, "a")

        loop_thread, ran_on = asyncio.run(main())
        assert ran_on != loop_thread
    finally:
        s.close()


def test_waiting_for_a_lock_another_process_holds_does_not_freeze_the_loop(
    store: SQLiteStore, holder: sqlite3.Connection
) -> None:
    holder.execute("BEGIN IMMEDIATE")

    async def main() -> tuple[list[float], float, float]:
        ticks: list[float] = []
        done = asyncio.Event()
        ticker = asyncio.create_task(ticking(done, ticks))
        started = time.monotonic()
        tx = asyncio.create_task(store.transact(mark, "after"))
        await asyncio.sleep(0.4)
        assert not tx.done(), "the transaction ran while another connection held the write lock"
        released = time.monotonic()
        holder.execute("COMMIT")
        await asyncio.wait_for(tx, 5)
        done.set()
        await ticker
        return [t for t in ticks if started <= t <= released], released - started, time.monotonic()

    during, waited, _ = asyncio.run(main())
    # The loop ran its other work every ~5 ms while the transaction waited (it spins blocked
    # for at most INLINE_SPIN, 2 ms, then polls between the loop's turns).
    assert waited >= 0.4
    # (A frozen loop ticks not at all for the 0.4 s; bounds loose for a loaded machine.)
    assert len(during) >= 10, f"the loop ticked {len(during)} times in {waited:.2f} s of waiting"
    assert max(b - a for a, b in itertools.pairwise(during)) < 0.25
    assert marks(store) == ["after"]


def test_a_lock_held_past_busy_timeout_is_a_store_error_and_writes_nothing(
    tmp_path: Path,
) -> None:
    s = SQLiteStore(str(tmp_path / "short.db"), busy_timeout=0.3)
    other = sqlite3.connect(s.path, isolation_level=None)
    try:
        s.transact_sync(lambda tx: tx.sql("CREATE TABLE marks (v TEXT)"))
        other.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(StoreError, match="stayed locked by another writer"):
            asyncio.run(s.transact(mark, "never"))
        assert 0.25 <= time.monotonic() - started < 3
        other.execute("COMMIT")
        assert marks(s) == []
    finally:
        other.close()
        s.close()


def test_a_stopping_worker_bound_cuts_a_wait_in_progress(
    store: SQLiteStore, holder: sqlite3.Connection
) -> None:
    holder.execute("BEGIN IMMEDIATE")

    async def main() -> float:
        tx = asyncio.create_task(store.transact(mark, "never"))
        await asyncio.sleep(0.1)
        cut = time.monotonic()
        store.limit_lock_waits(0.2)  # busy_timeout is 5 s: the bound, not the timeout, ends it
        with pytest.raises(StoreError, match="stayed locked"):
            await asyncio.wait_for(tx, 3)
        return time.monotonic() - cut

    assert asyncio.run(main()) < 1.0
    holder.execute("COMMIT")
    assert marks(store) == []


def test_an_error_in_a_hot_transaction_rolls_it_back_and_the_next_one_runs(store: SQLiteStore) -> None:
    @hot
    def half(tx: Tx) -> None:
        tx.sql("INSERT INTO marks (v) VALUES ('half')")
        raise ValueError("boom")

    async def main() -> None:
        with pytest.raises(ValueError, match="boom"):
            await store.transact(half)
        await store.transact(mark, "next")

    asyncio.run(main())
    assert marks(store) == ["next"]


def test_a_wait_cancelled_leaves_no_transaction_open(store: SQLiteStore, holder: sqlite3.Connection) -> None:
    holder.execute("BEGIN IMMEDIATE")

    async def main() -> bool:
        tx = asyncio.create_task(store.transact(mark, "cancelled"))
        await asyncio.sleep(0.1)
        tx.cancel()
        with pytest.raises(asyncio.CancelledError):
            await tx
        with store._inline_use() as conn:
            left_open = conn.in_transaction  # checked while the other writer still holds the lock
        holder.execute("COMMIT")
        await store.transact(mark, "later")
        return left_open

    assert asyncio.run(main()) is False
    assert marks(store) == ["later"]


def test_inside_an_app_transaction_block_in_the_same_thread_it_waits_for_the_block(tmp_path: Path) -> None:
    from stepwarden import App

    app = App(f"sqlite:///{tmp_path / 'app.db'}")
    store = app.store
    assert isinstance(store, SQLiteStore)
    store.transact_sync(lambda tx: tx.sql("CREATE TABLE marks (v TEXT)"))

    async def main() -> tuple[int, int]:
        with app.transaction() as block:
            block.execute("INSERT INTO marks (v) VALUES ('block')")
            tx = asyncio.create_task(store.transact(mark, "after block"))
            await asyncio.sleep(0.2)
            assert not tx.done()  # waiting for the block's lock on the store's thread, not refused
        return threading.get_ident(), await asyncio.wait_for(tx, 5)

    try:
        loop_thread, ran_on = asyncio.run(main())
        assert ran_on != loop_thread
        assert marks(store) == ["block", "after block"]
    finally:
        app.close()


def test_coroutines_of_one_loop_share_its_connection_without_mixing_transactions(
    store: SQLiteStore, holder: sqlite3.Connection
) -> None:
    holder.execute("BEGIN IMMEDIATE")

    async def main() -> list[Any]:
        waiting = [asyncio.create_task(store.transact(mark, str(i))) for i in range(20)]
        await asyncio.sleep(0.05)
        holder.execute("COMMIT")
        return await asyncio.gather(*waiting)

    asyncio.run(main())
    assert sorted(marks(store), key=int) == [str(i) for i in range(20)]


def test_close_from_another_thread_waits_for_a_hot_transaction_running_on_a_loop(tmp_path: Path) -> None:
    """Closing a connection under a running statement can crash the process: close() waits for
    the loop's transaction as it waits for the store's threads."""
    s = SQLiteStore(str(tmp_path / "close.db"))
    s.transact_sync(lambda tx: tx.sql("CREATE TABLE marks (v TEXT)"))
    running = threading.Event()
    outcome: list[Any] = []

    @hot
    def slow(tx: Tx) -> str:
        running.set()
        time.sleep(0.3)  # the loop's thread is inside the transaction
        tx.sql("INSERT INTO marks (v) VALUES ('slow')")
        return "committed"

    def loop_thread() -> None:
        try:
            outcome.append(asyncio.run(s.transact(slow)))
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=loop_thread)
    t.start()
    assert running.wait(5)
    began = time.monotonic()
    s.close()
    waited = time.monotonic() - began
    t.join(5)
    assert outcome == ["committed"]
    assert waited >= 0.15, "close() returned while the transaction was still running"
    again = SQLiteStore(str(tmp_path / "close.db"))
    try:
        assert marks(again) == ["slow"]
    finally:
        again.close()


@pytest.mark.parametrize("path", ["inline", "store thread"])
def test_a_commit_that_fails_leaves_no_transaction_open_and_writes_nothing(
    store: SQLiteStore, path: str
) -> None:
    """A deferred foreign key is checked at COMMIT, which fails and leaves SQLite's transaction
    open: it must be rolled back, or the connection would hold the write lock for good."""
    store.transact_sync(lambda tx: tx.sql("CREATE TABLE parent (id INTEGER PRIMARY KEY)"))
    store.transact_sync(
        lambda tx: tx.sql(
            "CREATE TABLE child (pid INTEGER REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED)"
        )
    )

    @hot
    def orphan(tx: Tx) -> None:
        tx.sql("INSERT INTO marks (v) VALUES ('orphan')")
        tx.sql("INSERT INTO child (pid) VALUES (42)")  # no parent 42: refused at COMMIT

    async def main() -> None:
        with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
            if path == "inline":
                await store.transact(orphan)
            else:
                store.transact_sync(orphan)
        await store.transact(mark, "next")  # inline: the connection is free again
        store.transact_sync(mark, "sync")  # and so is the store thread's

    asyncio.run(main())
    assert marks(store) == ["next", "sync"]


@pytest.mark.parametrize("path", ["inline", "store thread"])
def test_a_connection_an_interrupt_left_inside_a_transaction_is_rolled_back_before_the_next(
    store: SQLiteStore, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A KeyboardInterrupt between a BEGIN and the try that ends it leaves the connection in its
    transaction, holding the write lock; the next BEGIN on it would fail for good."""

    async def main() -> None:
        if path == "inline":
            with store._inline_use() as conn:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT INTO marks (v) VALUES ('interrupted')")
            await store.transact(mark, "next")
        else:
            conn = store._conn()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO marks (v) VALUES ('interrupted')")
            store.transact_sync(mark, "next")

    with caplog.at_level("WARNING", logger="stepwarden.sqlite"):
        asyncio.run(main())
    assert marks(store) == ["next"]
    assert any("left inside a transaction" in r.getMessage() for r in caplog.records)


def test_the_roles_transactions_are_the_ones_run_on_the_loop(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's round, the reply batch (with or without the take) and the agent's pull
    are marked hot; losing a mark would quietly put them back on the store's thread."""
    from stepwarden.store import agents

    ran_on: dict[str, int] = {}
    real = SQLiteStore._run

    def recording(self: SQLiteStore, conn: sqlite3.Connection, fn: Any, *a: Any, **k: Any) -> Any:
        ran_on[fn.__name__] = threading.get_ident()
        return real(self, conn, fn, *a, **k)

    monkeypatch.setattr(SQLiteStore, "_run", recording)

    async def main() -> int:
        await store.schedule("me", 10)
        await store.schedule_and_take("me", 10, {})
        await store.send_replies("me", [], apply=True)
        await store.send_replies_and_take("me", [], {})
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert ran_on == {
        "schedule": loop_thread,
        "round_": loop_thread,
        "_record_replies": loop_thread,
        "send_all": loop_thread,
    }
    assert getattr(agents.pull, "stepwarden_hot", False)


@pytest.mark.parametrize("path", ["hot, on the loop", "on the store's thread"])
def test_a_long_wait_for_the_lock_tries_for_it_tens_of_times_a_second_not_hundreds(
    store: SQLiteStore, holder: sqlite3.Connection, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """REL3: while another process holds the write lock for long (a backup, a `sqlite3` shell),
    each waiting transaction tried for it every 1-2 ms: about 500 tries a second, 16 % of a core
    for one idle worker. Past 0.1 s of waiting the tries grow apart to 50 ms; the lock is still
    taken soon after it is freed."""
    tries = 0
    real = store._try_write_lock

    def counted(conn: sqlite3.Connection, started: float) -> bool:
        nonlocal tries
        tries += 1
        return real(conn, started)

    monkeypatch.setattr(store, "_try_write_lock", counted)
    holder.execute("BEGIN IMMEDIATE")

    async def main() -> float:
        tx = asyncio.create_task(store.transact(mark if path.startswith("hot") else mark_cold, "after"))
        await asyncio.sleep(1.0)
        assert not tx.done(), "the transaction ran while another connection held the write lock"
        holder.execute("COMMIT")
        released = time.monotonic()
        await asyncio.wait_for(tx, 5)
        return time.monotonic() - released

    after_release = asyncio.run(main())
    assert marks(store) == ["after"]
    assert tries < 150, f"{tries} tries for the lock in 1 s of waiting"
    assert after_release < 0.5, f"took the freed lock {after_release:.3f} s after it was freed"


@pytest.mark.parametrize("path", ["an agent's pull, hot", "a take on the store's thread"])
def test_a_request_taken_after_a_long_wait_for_the_lock_keeps_the_time_it_had_when_asked_for(
    tmp_path: Path, path: str, dispatch_requests: Callable[..., list[int]]
) -> None:
    """REL3: an agent counts a request's time from just before it asks for the transaction that
    takes it, and the time left comes from the database inside that transaction. A wait for the
    write lock before the transaction began (another process holding it) came off the call's
    time: after a 15 s wait a call with 10 s left was cut short at once, and counted as failed.
    The request's ``remaining`` now includes the wait, so the agent's deadline stays where the
    database's complete-by puts it."""
    from stepwarden.store import agents as sa
    from stepwarden.store import open_store

    store = open_store(f"sqlite:///{tmp_path / 'sw.db'}")  # the wall clock: the wait is real
    assert isinstance(store, SQLiteStore)
    holder = sqlite3.connect(store.path, isolation_level=None)
    try:
        dispatch_requests(store, budget=5.0)
        holder.execute("BEGIN IMMEDIATE")

        async def main() -> tuple[list[Any], float]:
            async def take() -> list[Any]:
                if path.startswith("an agent"):
                    want = {"svc": sa.Want(1, sa.ops_json(["do_s"]))}
                    pulled = await store.transact(sa.pull, "agent-1", want, sa.HealthRules())
                    return list(pulled.requests)
                return list(await store.claim_requests("agent-1", ["svc"], 1))

            asked = time.monotonic()
            got = asyncio.create_task(take())
            await asyncio.sleep(1.5)
            holder.execute("COMMIT")
            return await asyncio.wait_for(got, 10), asked

        msgs, asked = asyncio.run(main())
        [msg] = msgs
        deadline = asked + msg.remaining  # as the agent computes it
        assert msg.remaining > 4.5, f"{msg.remaining:.2f} s left: the 1.5 s wait came off the call's time"
        assert deadline <= time.monotonic() + (msg.complete_by - time.time()) + 0.05, "past complete-by"
    finally:
        if holder.in_transaction:
            holder.execute("ROLLBACK")
        holder.close()
        store.close()


def test_a_long_waiter_keeps_trying_often_while_other_writers_take_turns(tmp_path: Path) -> None:
    """Slowing the tries by time alone (past 0.1 s of waiting) made the waiter that had waited
    longest lose the lock to newer ones, which still tried every 2 ms: with six processes of
    1 ms transactions, waits of up to 1.6 s where they had been 0.3 s. The tries slow down only
    while nobody commits (one long holder); while others commit they stay at most 2 ms apart."""
    from stepwarden.store.sqlite import LOCK_POLL_SLOW, LOCK_WAIT_LONG, _LockWaits

    path = tmp_path / "turns.db"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("CREATE TABLE t (v INTEGER)")
    waiter = sqlite3.connect(path, isolation_level=None)
    try:
        waits = _LockWaits()
        busy: list[float] = []
        end = time.monotonic() + LOCK_WAIT_LONG + 0.3
        while time.monotonic() < end:  # others commit between each of the waiter's tries
            writer.execute("INSERT INTO t VALUES (1)")
            delay = waits.next(waiter)
            busy.append(delay)
            time.sleep(delay)
        assert max(busy) <= 0.002, f"slowed to {max(busy) * 1000:.0f} ms while others committed"
        quiet: list[float] = []
        end = time.monotonic() + 0.6
        while time.monotonic() < end:  # one long holder: nobody commits
            delay = waits.next(waiter)
            quiet.append(delay)
            time.sleep(delay)
        assert quiet[-1] == pytest.approx(LOCK_POLL_SLOW), quiet[-5:]
        writer.execute("INSERT INTO t VALUES (2)")  # the holder is gone; others commit again
        waits.next(waiter)
        assert waits.next(waiter) <= 0.002
    finally:
        waiter.close()
        writer.close()


def test_out_of_wal_mode_a_long_exclusive_holder_slows_the_tries_too(tmp_path: Path) -> None:
    """Out of WAL mode (a file system without shared memory) a holder of the EXCLUSIVE lock keeps
    readers out, so the waiter cannot read ``data_version``; taken for a commit, that kept the
    tries 2 ms apart for as long as a shell's BEGIN EXCLUSIVE or a VACUUM lasted. Two looks in a
    row that cannot read are one long holder."""
    from stepwarden.store.sqlite import LOCK_POLL_SLOW, LOCK_WAIT_LONG, _data_version, _LockWaits

    path = tmp_path / "rollback.db"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("PRAGMA journal_mode=DELETE")
    holder.execute("CREATE TABLE t (v INTEGER)")
    waiter = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("INSERT INTO t VALUES (1)")
        assert _data_version(waiter) is None, "the holder's EXCLUSIVE lock keeps the waiter's read out"
        waits = _LockWaits()
        delays: list[float] = []
        end = time.monotonic() + LOCK_WAIT_LONG + 0.6
        while time.monotonic() < end:
            delay = waits.next(waiter)
            delays.append(delay)
            time.sleep(delay)
        assert delays[-1] == pytest.approx(LOCK_POLL_SLOW), delays[-5:]
    finally:
        if holder.in_transaction:
            holder.execute("ROLLBACK")
        holder.close()
        waiter.close()
