"""SQLite's wake-up watch (``PRAGMA data_version``, see ``SQLiteStore.listen``) survives an error:
it says so once, comes back on a fresh connection, and goes on waking the roles for commits of
other connections. Before, one error ended its thread for good, quietly, and every pickup after
that waited for a role's idle poll."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwarden.store import sqlite_watch
from stepwarden.store.base import WORK_CHANNELS
from stepwarden.store.sqlite import SQLiteStore

LOGGER = "stepwarden.sqlite"


class _Watched:
    """A watch connection that counts its reads; with ``fail_at``, that read fails as a dying disk
    would."""

    def __init__(self, conn: sqlite3.Connection, fail_at: int | None) -> None:
        self.conn, self.fail_at, self.reads = conn, fail_at, 0

    def execute(self, sql: str) -> Any:
        self.reads += 1
        if self.reads == self.fail_at:
            raise sqlite3.OperationalError("disk I/O error")
        return self.conn.execute(sql)

    def close(self) -> None:
        self.conn.close()


class _FlakyStore(SQLiteStore):
    """Its first ``refuse`` watch connections fail at connect; with ``breaks``, the next one fails
    at its third read; with ``flaps``, every one does."""

    def __init__(self, path: str, refuse: int = 0, breaks: bool = True, flaps: bool = False) -> None:
        super().__init__(path)
        self.refuse, self.breaks, self.flaps = refuse, breaks, flaps
        self.attempts = 0
        self.watches: list[_Watched] = []

    def _watch_connection(self) -> Any:
        self.attempts += 1
        if self.attempts <= self.refuse:
            raise sqlite3.OperationalError("unable to open database file")
        fails = self.flaps or (self.breaks and not self.watches)
        self.watches.append(_Watched(super()._watch_connection(), 3 if fails else None))
        return self.watches[-1]


def _commit_elsewhere(path: Path) -> None:
    """One commit of another connection (the table is made before the watch starts)."""
    other = sqlite3.connect(path)
    try:
        with other:
            other.execute("INSERT INTO poke VALUES (1)")
    finally:
        other.close()


def _store(store: _FlakyStore) -> _FlakyStore:
    with sqlite3.connect(store.path) as conn:
        conn.execute("CREATE TABLE poke (n INTEGER)")
    conn.close()
    return store


async def _until(what: Any, seconds: float, why: str) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not what():
        assert asyncio.get_running_loop().time() < deadline, why
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def _listening(
    store: SQLiteStore, woken: list[str], channels: list[str] | None = None
) -> AsyncIterator[None]:
    """The store's watch running for the block; stopped (and waited for, bounded) after it."""
    stop = asyncio.Event()
    listening = asyncio.create_task(store.listen(woken.append, stop, channels))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(listening, 5)


def _run(store: SQLiteStore, main: Coroutine[Any, Any, None], caplog: pytest.LogCaptureFixture) -> None:
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            asyncio.run(main)
    finally:
        store.close()


def _logged(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in list(caplog.records)
        if r.name == LOGGER and r.levelno == level and text in r.getMessage()
    ]


@pytest.mark.parametrize("refuse", [0, 2], ids=["fails-mid-watch", "cannot-connect-then-fails"])
def test_the_watch_comes_back_after_an_error_and_wakes_for_the_next_commit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, refuse: int
) -> None:
    monkeypatch.setattr(sqlite_watch, "WATCH_SETTLED", 0.2)
    path = tmp_path / "store.db"
    store = _store(_FlakyStore(str(path), refuse))
    woken: list[str] = []

    async def main() -> None:
        async with _listening(store, woken):
            # it fails (at connect `refuse` times, then at its third read), reconnects, and wakes the
            # roles once, for whatever was committed while it was down
            await _until(
                lambda: len(store.watches) == 2 and store.watches[1].reads >= 2, 10, "never came back"
            )
            # (one round of wake-ups per connection opened during the outage: with refused connects
            # first, the one that broke was one of them)
            rounds = 1 if refuse == 0 else 2
            await _until(lambda: len(woken) == rounds * len(WORK_CHANNELS), 2, "no wake-up once back")
            woken.clear()
            _commit_elsewhere(path)
            await _until(lambda: woken, 2, "a commit after the error woke nobody")
            assert set(woken) == set(WORK_CHANNELS)
            await _until(lambda: _logged(caplog, logging.INFO, "working again"), 5, "never said it is back")

    _run(store, main(), caplog)
    # once per outage, not per retry: refused connects and the connection that broke after them
    # (before it had worked for WATCH_SETTLED) are one outage
    warnings = _logged(caplog, logging.WARNING, "")
    assert len(warnings) == 1, warnings
    assert "data_version watcher failed" in warnings[0]
    assert len(store.watches) == 2 and store.attempts == refuse + 2


def test_a_watch_that_keeps_breaking_backs_off_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each new connection reads, then fails (a damaged -shm file, say): that is one outage, with
    a growing pause between tries, not a warning, a wake-up and a retry every 50 ms for ever."""
    path = tmp_path / "store.db"
    store = _store(_FlakyStore(str(path), flaps=True))
    woken: list[str] = []

    async def main() -> None:
        async with _listening(store, woken, ["stepwarden_tasks"]):
            await _until(lambda: store.attempts >= 4, 10, "it stopped trying")
            await asyncio.sleep(1.0)  # the span that is checked: pauses of 0.4 s and more by now

    _run(store, main(), caplog)
    assert len(_logged(caplog, logging.WARNING, "")) == 1
    assert not _logged(caplog, logging.INFO, "working again")
    # pauses of 0.05, 0.1, 0.2, 0.4, 0.8, 1.6 s: in the ~1.4 s after the 4th try, 2 or 3 more
    assert 4 <= store.attempts <= 7, store.attempts
    assert len(woken) <= store.attempts  # one wake-up per reconnection at most


def test_the_watch_never_creates_a_store_file_that_is_gone(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = SQLiteStore(str(path))
    store.close()
    for leftover in tmp_path.glob("store.db*"):
        leftover.unlink()
    with pytest.raises(sqlite3.OperationalError):
        store._watch_connection()
    assert list(tmp_path.iterdir()) == []


def test_a_watch_that_works_wakes_once_per_commit_and_stops_with_its_worker(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = _store(_FlakyStore(str(path), breaks=False))
    woken: list[str] = []

    async def main() -> None:
        async with _listening(store, woken, ["stepwarden_tasks"]):
            await _until(lambda: store.watches and store.watches[0].reads >= 2, 10, "the watch never read")
            assert woken == []  # nothing committed yet
            _commit_elsewhere(path)
            await _until(lambda: woken, 2, "a commit woke nobody")
            reads = store.watches[0].reads
            await _until(lambda: store.watches[0].reads >= reads + 3, 10, "the watch stopped reading")
            assert woken == ["stepwarden_tasks"]  # a few more reads: still one wake-up for one commit

    try:
        asyncio.run(main())
    finally:
        store.close()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_worker_whose_store_file_is_deleted_or_replaced_stops_instead_of_working_on_the_old_one(
    tmp_path: Path, how: str
) -> None:
    """Found by review (REL1, DEP1): a store file deleted, or replaced by a restored backup, under
    a running worker left its connections on the old file: it went on claiming and writing
    there, silently, where no other process looks, while new tasks in the file now at the path
    stayed pending for good. It now stops within a heartbeat or two, exit 1, one line saying why."""
    import os
    import time

    from harness import Cluster

    db = tmp_path / "s.db"
    cluster = Cluster(tmp_path, f"sqlite:///{db}")
    try:
        w = cluster.start("w1")
        if how == "replaced":
            backup = tmp_path / "backup.db"
            src = sqlite3.connect(db)
            dst = sqlite3.connect(backup)
            src.backup(dst)
            dst.close()
            src.close()
            os.replace(backup, db)
        else:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{db}{suffix}")
        w.expect_alive = False
        started = time.monotonic()
        code = w.popen.wait(timeout=15)
        took = time.monotonic() - started
        assert code == 1, w.log_text()
        assert took < 10, took
        assert f"was {how}" in w.log_text() and "it stops" in w.log_text(), w.log_text()
    finally:
        cluster.close()


def test_a_worker_started_while_its_store_stays_locked_waits_for_it_instead_of_exiting(
    tmp_path: Path,
) -> None:
    """Found by review (REL3): a worker started while another process kept the SQLite file locked
    past the busy timeout (or, on PostgreSQL, while the server was down) exited 1 after the
    wait, and a fleet started before its database crash-looped under a service manager. It now
    waits on, with one warning, and starts once the store answers."""
    import time

    with _worker_on_a_locked_store(tmp_path, 0.5, "cannot open the store yet") as (cluster, holder, w):
        time.sleep(2.0)  # several tries, each refused after the busy timeout: the worker waits on
        assert w.alive(), w.log_text()
        holder.execute("ROLLBACK")
        cluster.identity(w)  # it starts and registers once the lock is gone
        text = w.log_text()
        assert text.count("cannot open the store yet") == 1, text
        assert "the store answers, opened after" in text, text


def test_a_worker_whose_first_try_to_open_the_store_waits_long_says_so_while_it_waits(
    tmp_path: Path,
) -> None:
    """Found by review: with the file locked, the first try waits SQLite's busy timeout (30 s by
    default) in the driver, and the worker said nothing until it failed. A warning now comes
    after 2 s of that wait, while it goes on; the worker starts once the lock is gone."""
    with _worker_on_a_locked_store(tmp_path, 60, "the store has not answered for 2s") as (cluster, holder, w):
        assert "cannot open the store yet" not in w.log_text()  # its first try still waits
        holder.execute("ROLLBACK")
        cluster.identity(w)  # it starts and registers once the lock is gone


def test_a_store_opened_by_a_relative_path_is_the_same_file_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: a store opened as `b.db` was reported deleted once the process changed its
    working folder (a handler or a library may), and its worker would have stopped."""
    import os

    monkeypatch.chdir(tmp_path)
    store = SQLiteStore("b.db")
    try:
        (tmp_path / "sub").mkdir()
        os.chdir(tmp_path / "sub")
        assert store.replaced() is None
        os.replace(tmp_path / "b.db", tmp_path / "moved.db")
        assert "b.db" in (store.replaced() or "") and "deleted" in (store.replaced() or "")
    finally:
        store.close()


def test_a_worker_stopped_while_it_waits_for_a_locked_store_exits_at_once_having_taken_nothing(
    tmp_path: Path,
) -> None:
    """The wait at start (above) is cut by a stop: SIGTERM between two tries to open the store ends
    the worker at once, exit 0, saying it stopped before it could start."""
    import signal

    with _worker_on_a_locked_store(tmp_path, 0.5, "cannot open the store yet") as (cluster, _holder, w):
        code, took = w.stop(signal.SIGTERM, within=10)
        assert code == 0, w.log_text()
        assert took < 3, (took, w.log_text())
        assert "before it could start" in w.log_text(), w.log_text()
        assert cluster.sql("SELECT id FROM workers") == []  # it took nothing, registered nothing


@contextlib.contextmanager
def _worker_on_a_locked_store(
    tmp_path: Path, busy_timeout: float, says: str
) -> Iterator[tuple[Any, sqlite3.Connection, Any]]:
    """A worker started on a store another connection keeps locked (``holder``, in an exclusive
    transaction: another process's long write), once its log ``says`` the line; stopped after."""
    import time

    from harness import Cluster

    db = tmp_path / "s.db"
    cluster = Cluster(tmp_path, f"sqlite:///{db}")
    holder = sqlite3.connect(db, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        w = cluster.start("w1", db=f"sqlite:///{db}?busy_timeout={busy_timeout:g}", wait=False)
        deadline = time.monotonic() + 20
        while says not in w.log_text():
            assert w.alive(), w.log_text()
            assert time.monotonic() < deadline, w.log_text()
            time.sleep(0.05)
        yield cluster, holder, w
    finally:
        holder.close()
        cluster.close()
