"""A worker whose first transaction fails (REL3): the store is locked by another process past its
busy timeout, as a PostgreSQL server restarting just after the store opened would fail it. The
worker used to raise out of ``run`` and end the process, which a service manager that restarts it
turns into a crash loop; it now waits the store out with back-off, and stops promptly if asked."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stepwarden import App

CANNOT = "cannot record its workflows in the store yet"


@pytest.fixture
def locked(tmp_path: Path, noop_app: Callable[..., App]) -> Iterator[tuple[App, sqlite3.Connection]]:
    """An app on a new store (busy timeout 0.1 s) and a connection holding its write lock."""
    path = tmp_path / "start.db"
    app = noop_app(f"sqlite:///{path}?busy_timeout=0.1")
    app.store.transact_sync(lambda tx: None)  # created and migrated before the lock is taken
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    yield app, holder
    holder.close()
    app.close()


async def until(pred: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if CANNOT in r.getMessage()]


def test_a_worker_that_cannot_record_its_workflows_waits_for_the_store(
    locked: tuple[App, sqlite3.Connection], caplog: pytest.LogCaptureFixture
) -> None:
    app, holder = locked
    caplog.set_level(logging.WARNING, logger="stepwarden")

    async def body() -> None:
        stop = asyncio.Event()
        run = asyncio.create_task(app.worker(name="starting").run(stop))
        try:
            await until(lambda: len(failures(caplog)) >= 2 or run.done(), "two failed tries")
            assert not run.done(), run.exception()
            assert "trying again in 0.5s" in failures(caplog)[0] and "in 1s" in failures(caplog)[1]
            assert "stayed locked by another writer" in failures(caplog)[0]
            holder.execute("ROLLBACK")
            task_id = await app.submit_async("one", {})
            await until(lambda: app.task(task_id)["state"] == "processed", "the task processed")
        finally:
            stop.set()
            await asyncio.wait_for(run, 30)

    asyncio.run(body())


def test_a_worker_stopped_while_it_waits_for_the_store_stops_at_once(
    locked: tuple[App, sqlite3.Connection], caplog: pytest.LogCaptureFixture
) -> None:
    app, _ = locked
    caplog.set_level(logging.INFO, logger="stepwarden")

    async def body() -> None:
        stop = asyncio.Event()
        run = asyncio.create_task(app.worker(name="starting").run(stop))
        await until(lambda: len(failures(caplog)) >= 1 or run.done(), "a failed try")
        assert not run.done(), run.exception()
        stop.set()
        started = time.monotonic()
        await asyncio.wait_for(run, 5)
        assert time.monotonic() - started < 1.0
        assert run.exception() is None

    asyncio.run(body())
    assert any("stopped before it could start" in r.getMessage() for r in caplog.records)


def test_making_a_worker_opens_no_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noop_app: Callable[..., App]
) -> None:
    """``stepwarden --db URL worker`` makes the worker, then points its app at URL: a worker that
    opened its app's store when made (for its tracer) created ``./stepwarden.db`` beside the store
    the command named. The store is the one ``run`` is given, opened then."""
    from stepwarden.worker import Worker

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STEPWARDEN_DB", raising=False)
    Worker(noop_app())
    assert list(tmp_path.iterdir()) == [], "making the worker opened the app's default store"
