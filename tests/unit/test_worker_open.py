"""``Worker.run`` opens its store itself, off the event loop (DEP4): opening may wait long (for
SQLite's write lock, up to the busy timeout, before the migration; for a PostgreSQL server or
another session's migration), and a library user's ``app.worker().run(stop)`` must neither block
its loop for that wait nor sit it out once ``stop`` is set. It used to open ``app.store`` on the
loop, and only the command line, in a thread of its own, could stop while opening."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwarden import App
from stepwarden.clock import FakeClock
from stepwarden.errors import StepwardenError
from stepwarden.store import open_store
from stepwarden.worker import Worker, WorkerSettings

CANNOT = "cannot record its workflows in the store yet"


async def until(pred: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _more_than(tries: list[float], seen: int, run: asyncio.Task[Any]) -> Callable[[], bool]:
    return lambda: len(tries) > seen or run.done()


def opening_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stepwarden-open"]


@pytest.fixture
def migration_locked(tmp_path: Path) -> Iterator[tuple[str, sqlite3.Connection]]:
    """A store's URL (busy timeout 30 s) and a connection holding its write lock: a worker's
    migration waits for it, as for another process's."""
    path = tmp_path / "open.db"
    url = f"sqlite:///{path}?busy_timeout=30"
    open_store(url).close()  # made (WAL) before the lock is taken, as another process would have
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    yield url, holder
    holder.close()


def test_a_worker_stopped_while_it_opens_the_store_stops_at_once_and_never_blocks_the_loop(
    migration_locked: tuple[str, sqlite3.Connection],
    noop_app: Callable[..., App],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stepwarden")
    url, holder = migration_locked
    app = noop_app(url)
    worker = app.worker(name="opening")

    async def body() -> tuple[bool, float, int]:
        stop = asyncio.Event()
        ticks = 0

        async def ticking() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(ticking())
        run = asyncio.create_task(worker.run(stop))
        await until(lambda: bool(opening_threads()), "the store to be opened in its thread")
        await asyncio.sleep(0.5)  # the migration waits for the lock meanwhile
        assert not run.done(), run.exception()
        worker.stopped_by = "SIGTERM"  # as the command line notes the signal that set stop
        stop.set()
        sent = time.monotonic()
        started = await asyncio.wait_for(run, 5)
        took = time.monotonic() - sent
        ticker.cancel()
        return started, took, ticks

    try:
        started, took, ticks = asyncio.run(body())
        assert started is False
        assert took < 1.0, f"run() took {took:.1f}s to return after the stop"
        assert ticks >= 20, f"the event loop ran {ticks} times in 0.5 s: the opening blocked it"
        said = [r.getMessage() for r in caplog.records if "before it could start" in r.getMessage()]
        assert said == [
            f"worker {worker.identity} stopped by SIGTERM before it could start (while opening the"
            " store); it took no work"
        ]
    finally:
        holder.execute("ROLLBACK")
        for t in opening_threads():  # its migration goes through now; then the app's store is set
            t.join(30)
        app.close()
    check = open_store(url)
    try:
        # It took no work and recorded nothing: no worker row, no workflows.
        assert check.transact_sync(lambda tx: tx.sql("SELECT id FROM workers")) == []
        assert check.transact_sync(lambda tx: tx.sql("SELECT name FROM workflows")) == []
    finally:
        check.close()


def test_a_worker_stopped_before_it_runs_opens_nothing_and_says_so(
    tmp_path: Path, noop_app: Callable[..., App], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stepwarden")
    path = tmp_path / "never.db"
    app = noop_app(f"sqlite:///{path}")
    worker = app.worker(name="early")

    async def body() -> bool:
        stop = asyncio.Event()
        stop.set()
        return await asyncio.wait_for(worker.run(stop), 5)

    try:
        assert asyncio.run(body()) is False
        said = [r.getMessage() for r in caplog.records if "before it could start" in r.getMessage()]
        assert said == [
            f"worker {worker.identity} stopped before it could start (while opening the store);"
            " it took no work"
        ]
        assert not path.exists(), "a worker stopped before it ran created its store"
    finally:
        app.close()


def test_an_error_opening_the_store_is_raised_by_run(tmp_path: Path, noop_app: Callable[..., App]) -> None:
    """As ``app.store`` raises it: the command line makes it its one error line, exit 1."""
    app = noop_app(f"sqlite:///{tmp_path / 'no-such-folder' / 'x.db'}")

    async def body() -> None:
        await asyncio.wait_for(app.worker().run(asyncio.Event()), 10)

    with pytest.raises(StepwardenError, match="does not exist"):
        asyncio.run(body())


def test_a_worker_given_a_store_url_runs_on_it_and_the_app_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noop_app: Callable[..., App]
) -> None:
    """``stepwarden --db URL worker``: the worker opens URL, not the app's own store (here the
    default file in the working folder, which must not be created)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STEPWARDEN_DB", raising=False)
    url = f"sqlite:///{tmp_path / 'named.db'}"
    app = noop_app()
    worker = Worker(app, WorkerSettings(roles=("scheduler",)), db=url)

    async def body() -> bool:
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run(stop))
        await until(lambda: worker.scheduler is not None or run.done(), "the worker's roles to start")
        stop.set()
        return await asyncio.wait_for(run, 15)

    try:
        assert asyncio.run(body()) is True
        assert app.store.url == url
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("stepwarden")] == []
        assert [w["id"] for w in app.store.transact_sync(lambda tx: tx.sql("SELECT id FROM workers"))] == [
            worker.identity
        ]
    finally:
        app.close()


def test_the_back_off_between_tries_to_record_the_workflows_waits_on_the_apps_clock(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """DESIGN principle 3: the back-off is time, so it goes through the Clock. On a FakeClock the
    next try waits for ``advance``, however long the wall clock runs."""
    caplog.set_level(logging.WARNING, logger="stepwarden")
    clock = FakeClock()
    app = App(f"sqlite:///{tmp_path / 'clock.db'}", clock=clock)
    tries: list[float] = []

    async def down(*args: Any, **kwargs: Any) -> None:
        tries.append(clock.monotonic())
        raise RuntimeError("the store is down")

    app.store.register_workflows = down  # type: ignore[method-assign]
    start = clock.monotonic()

    async def body() -> bool:
        stop = asyncio.Event()
        run = asyncio.create_task(app.worker(name="backoff").run(stop))
        await until(lambda: len(tries) == 1, "the first try")
        await asyncio.sleep(0.8)  # past the first back-off (0.5 s) on the wall clock
        assert len(tries) == 1, "the back-off waited on the wall clock"
        clock.advance(0.5)
        await until(lambda: len(tries) == 2, "the second try, 0.5 s later on the clock")
        await asyncio.sleep(0.05)
        clock.advance(0.75)  # the second back-off is 1 s
        await asyncio.sleep(0.2)
        assert len(tries) == 2
        clock.advance(0.25)
        await until(lambda: len(tries) == 3, "the third try, 1 s later on the clock")
        stop.set()  # while it backs off: no try waits for it
        return await asyncio.wait_for(run, 5)

    try:
        assert asyncio.run(body()) is False
        assert [t - start for t in tries] == [0.0, 0.5, 1.5]
        said = [r.getMessage() for r in caplog.records if CANNOT in r.getMessage()]
        assert ["in 0.5s" in said[0], "in 1s" in said[1], "in 2s" in said[2]] == [True] * 3, said
    finally:
        app.close()


def test_a_store_that_still_cannot_be_opened_is_warned_about_again_every_few_minutes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker given a URL that never answers (a mistyped host or port) waits for ever, as one
    started before its database must: one warning at the first failure, then silence, and an
    operator reading the log later could not tell it was still waiting. It says so again after
    ``OPEN_STILL_FAILING_EVERY`` on the app's clock, with how long and how many tries, and not
    more often."""
    from stepwarden import worker as worker_module
    from stepwarden.errors import StoreUnreachable

    caplog.set_level(logging.WARNING, logger="stepwarden")
    clock = FakeClock()
    app = App(f"sqlite:///{tmp_path / 'never.db'}", clock=clock)
    tries: list[float] = []

    def unreachable(self: Worker) -> Any:
        tries.append(clock.monotonic())
        raise StoreUnreachable("connection refused at 127.0.0.1:1")

    monkeypatch.setattr(worker_module.Worker, "_open_store", unreachable)
    every = worker_module.OPEN_STILL_FAILING_EVERY
    start = clock.monotonic()

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "open the store" in r.getMessage()]

    async def body() -> bool:
        stop = asyncio.Event()
        run = asyncio.create_task(app.worker(name="unreachable").run(stop))
        # Drive the clock one back-off at a time (each try must have happened before the next
        # advance) until past two reminder periods.
        while clock.monotonic() - start < 2 * every + 5:
            await until(_more_than(tries, len(tries), run), "the next try")
            assert not run.done(), run.exception()
            clock.advance(worker_module.REGISTER_RETRY_MAX)
        stop.set()
        return await asyncio.wait_for(run, 5)

    try:
        assert asyncio.run(body()) is False
        said = warnings()
        assert len(said) == 3, said
        assert "cannot open the store yet" in said[0]
        for text in said[1:]:
            assert "still cannot open the store after" in text and "connection refused" in text, text
        # Tries are 10 s apart here: the reminders come at the first try 300 s on, and 300 s later.
        assert f"after {every:.0f}s" in said[1] and f"after {2 * every:.0f}s" in said[2], said
        assert len(tries) > 50  # it kept trying all along, every 10 s
    finally:
        app.close()


def test_a_run_cancelled_while_it_opens_the_store_leaves_no_try_behind(
    tmp_path: Path, noop_app: Callable[..., App], caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: ``run`` cancelled by its caller (``asyncio.wait_for``) while its first
    try to open a locked store waited left that try running as a task nobody awaited, which
    failed a second later with "Task exception was never retrieved" and a traceback."""
    import gc

    caplog.set_level(logging.ERROR, logger="asyncio")
    path = tmp_path / "locked.db"
    url = f"sqlite:///{path}?busy_timeout=1"
    open_store(url).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    app = noop_app(url)

    async def body() -> list[str]:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(app.worker(name="cancelled").run(asyncio.Event()), 0.3)
        await asyncio.sleep(1.5)  # past the busy timeout: an abandoned try has failed by now
        gc.collect()
        await asyncio.sleep(0.05)
        return [t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    try:
        assert asyncio.run(body()) == []
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        for t in opening_threads():
            t.join(10)
        app.close()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text


def test_roles_that_all_meet_a_misconfigured_store_end_the_worker_with_its_error_and_nothing_more(
    tmp_path: Path, noop_app: Callable[..., App], caplog: pytest.LogCaptureFixture
) -> None:
    """Several roles meet the same StoreMisconfigured at their next round and end with it: the
    worker raised the first, and asyncio logged each other as "Task exception was never
    retrieved", with a traceback, at exit (found by CI, behind a PgBouncer without the option)."""
    import gc

    from stepwarden.errors import StoreMisconfigured

    caplog.set_level(logging.ERROR)

    async def misconfigured(*args: Any, **kwargs: Any) -> Any:
        raise StoreMisconfigured("reached through a transaction-mode pooler: add ?pooler=transaction")

    # Which roles meet it before the worker stops depends on their rounds: a few workers, so that
    # some do (about half of single runs showed the unread errors before the fix).
    for n in range(4):
        app = noop_app(f"sqlite:///{tmp_path / f'store{n}.db'}")
        worker = app.worker(name=f"mis{n}")

        async def body(app: App = app, worker: Worker = worker) -> None:
            run = asyncio.create_task(worker.run(asyncio.Event()))
            await until(lambda: worker.scheduler is not None and worker.agent_role is not None, "the roles")
            app.store.transact = misconfigured  # type: ignore[method-assign]
            await asyncio.wait_for(run, 20)

        try:
            with pytest.raises(StoreMisconfigured, match="pooler=transaction"):
                asyncio.run(body())
            gc.collect()  # asyncio logs an unread task's error when the task is collected
        finally:
            app.close()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text
