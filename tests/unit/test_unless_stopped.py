"""``unless_stopped``: a wait on the store that a stop cuts short, shared by the lease keeper's
campaign and the starting worker. Its answer tells "stopped" from a call that returned None
(``register_workflows`` always does, a refused ``acquire_lease`` too)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from stepwarden.clock import STOPPED, unless_stopped
from stepwarden.leader import Leadership, LeaseKeeper, LeaseSettings
from stepwarden.store import open_store


def test_the_result_comes_back_and_none_is_not_stopped() -> None:
    async def none() -> None:
        await asyncio.sleep(0)

    async def body() -> None:
        stop = asyncio.Event()
        assert await unless_stopped(asyncio.sleep(0, "x"), stop) == "x"
        got = await unless_stopped(none(), stop)
        assert got is None and got is not STOPPED

    asyncio.run(body())


def test_a_stop_cancels_the_wait_and_answers_stopped() -> None:
    async def body() -> None:
        stop = asyncio.Event()
        cancelled = asyncio.Event()

        async def hangs() -> int:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return 1

        waiting = asyncio.create_task(unless_stopped(hangs(), stop))
        await asyncio.sleep(0.01)
        stop.set()
        assert await asyncio.wait_for(waiting, 5) is STOPPED
        await asyncio.wait_for(cancelled.wait(), 5)

    asyncio.run(body())


def test_a_stop_already_set_answers_stopped_for_a_call_that_waits() -> None:
    async def body() -> None:
        stop = asyncio.Event()
        stop.set()
        assert await asyncio.wait_for(unless_stopped(asyncio.sleep(30), stop), 5) is STOPPED

    asyncio.run(body())


def test_an_error_of_the_call_is_raised() -> None:
    async def fails() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("the store is down")

    async def body() -> None:
        await unless_stopped(fails(), asyncio.Event())

    with pytest.raises(RuntimeError, match="the store is down"):
        asyncio.run(body())


class HungAcquire:
    """``store.acquire_lease`` on a connection gone dark: it never answers; ``entered`` once
    called, ``cancelled`` once the call was cancelled."""

    def __init__(self, store: Any) -> None:
        self.entered, self.cancelled = asyncio.Event(), asyncio.Event()
        store.acquire_lease = self

    async def __call__(self, name: str, holder: str, ttl: float) -> tuple[int, float] | None:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return None


async def never_leads(ctx: Leadership) -> None:
    raise AssertionError("no lease was acquired")


async def keeper_in_its_acquire(store: Any, hung: HungAcquire) -> tuple[asyncio.Event, asyncio.Task[None]]:
    """A keeper that never leads, started, once its acquire hangs in the store: its stop event
    and its running task."""
    stop = asyncio.Event()
    keeper = LeaseKeeper(store, "probe", "me:1:abc", never_leads, settings=LeaseSettings())
    running = asyncio.create_task(keeper.run(stop))
    await asyncio.wait_for(hung.entered.wait(), 5)
    return stop, running


def test_a_keeper_stopped_while_it_campaigns_logs_no_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The keeper's own copy of this helper asked a cancelled-but-not-yet-done task for its result
    at a stop: ``acquire failed: Result is not set.`` was logged as a store failure."""
    caplog.set_level(logging.WARNING, logger="stepwarden")
    store = open_store(f"sqlite:///{tmp_path / 'lease.db'}")
    hung = HungAcquire(store)

    async def body() -> None:
        stop, running = await keeper_in_its_acquire(store, hung)
        stop.set()
        await asyncio.wait_for(running, 5)

    try:
        asyncio.run(body())
    finally:
        store.close()
    assert [r.getMessage() for r in caplog.records] == []


def test_a_lease_granted_as_its_keeper_stops_is_resigned_not_left_to_its_ttl(tmp_path: Path) -> None:
    """Stopped while its acquire waited for SQLite's write lock (another process's long write),
    the keeper returned; the acquire committed afterwards in the store's thread, and the lease,
    never resigned, kept every other keeper out until its TTL (10 s measured, against a retry of
    0.5 s). The keeper now waits a brief bound for a grant still pending, and resigns it."""
    import sqlite3
    import threading

    path = tmp_path / "lease.db"
    store = open_store(f"sqlite:///{path}")
    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")  # another process's write, holding the lock

    async def work(ctx: Leadership) -> None:
        raise AssertionError("a stopping keeper must not start leading")

    async def body() -> None:
        stop = asyncio.Event()
        settings = LeaseSettings(ttl=10.0, renew_every=1.0, retry_every=0.5, margin=2.0)
        keeper = LeaseKeeper(store, "report", "A:1:aa", work, settings=settings)
        running = asyncio.create_task(keeper.run(stop))
        await asyncio.sleep(0.3)  # its acquire waits for the lock
        stop.set()
        threading.Timer(0.3, lambda: blocker.execute("COMMIT")).start()  # released meanwhile
        await asyncio.wait_for(running, 10)

    try:
        asyncio.run(body())
        kinds = [
            r["kind"] for r in store.transact_sync(lambda tx: tx.sql("SELECT kind FROM events ORDER BY id"))
        ]
        assert kinds == ["lease_acquired", "lease_resigned"]
        [lease] = store.transact_sync(lambda tx: tx.sql("SELECT holder, expires_at FROM leases"))
        now = store.transact_sync(lambda tx: tx.all("now"))[0]["now"]
        assert lease["expires_at"] <= now, "resigned: free for the next keeper at once"
    finally:
        blocker.close()
        store.close()


@pytest.mark.parametrize("when", ["campaigning", "stopping"])
def test_a_keeper_cancelled_while_its_grant_is_pending_cancels_the_grant(tmp_path: Path, when: str) -> None:
    """The grant is awaited through a shield (a stop lets it finish, to resign what it got); a
    keeper cancelled meanwhile (asyncio.run ending, a caller cancelling run_while_leader) left it
    running, never awaited: a lease it then got was never resigned."""
    store = open_store(f"sqlite:///{tmp_path / 'lease.db'}")
    hung = HungAcquire(store)

    async def body() -> None:
        stop, running = await keeper_in_its_acquire(store, hung)
        if when == "stopping":
            stop.set()  # the keeper now waits a brief bound for the grant
            await asyncio.sleep(0.1)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        await asyncio.wait_for(hung.cancelled.wait(), 5)

    try:
        asyncio.run(body())
    finally:
        store.close()
