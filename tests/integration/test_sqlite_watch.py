"""SQLite's wake-up watch (``PRAGMA data_version``, see ``SQLiteStore.listen``) survives an error:
it says so once, comes back on a fresh connection, and goes on waking the roles for commits of
other connections. Before, one error ended its thread for good, quietly, and every pickup after
that waited for a role's idle poll."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest

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
    at its third read."""

    def __init__(self, path: str, refuse: int = 0, breaks: bool = True) -> None:
        super().__init__(path)
        self.refuse, self.breaks = refuse, breaks
        self.attempts = 0
        self.watches: list[_Watched] = []

    def _watch_connection(self) -> Any:
        self.attempts += 1
        if self.attempts <= self.refuse:
            raise sqlite3.OperationalError("unable to open database file")
        first = not self.watches
        self.watches.append(_Watched(super()._watch_connection(), 3 if self.breaks and first else None))
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


@pytest.mark.parametrize("refuse", [0, 2], ids=["fails-mid-watch", "cannot-connect-then-fails"])
def test_the_watch_comes_back_after_an_error_and_wakes_for_the_next_commit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, refuse: int
) -> None:
    path = tmp_path / "store.db"
    store = _store(_FlakyStore(str(path), refuse))
    woken: list[str] = []

    async def main() -> None:
        stop = asyncio.Event()
        listening = asyncio.create_task(store.listen(woken.append, stop))
        # it fails (at connect `refuse` times, then at its third read) and reconnects
        await _until(
            lambda: len(store.watches) == 2 and store.watches[1].reads >= 2, 10, "the watch never came back"
        )
        woken.clear()
        _commit_elsewhere(path)
        await _until(lambda: woken, 2, "a commit after the error woke nobody")
        assert set(woken) == set(WORK_CHANNELS)
        stop.set()
        await listening

    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            asyncio.run(main())
    finally:
        store.close()
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    # once per outage, not per retry: two refused connects are one outage, the broken read another
    assert len(warnings) == (1 if refuse == 0 else 2), [r.getMessage() for r in warnings]
    assert len(store.watches) == 2 and store.attempts == refuse + 2
    assert all("data_version watcher failed" in r.getMessage() for r in warnings)
    assert any("working again" in r.getMessage() for r in caplog.records if r.name == LOGGER)


def test_a_watch_that_works_wakes_once_per_commit_and_stops_with_its_worker(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    store = _store(_FlakyStore(str(path), breaks=False))
    woken: list[str] = []

    async def main() -> None:
        stop = asyncio.Event()
        listening = asyncio.create_task(store.listen(woken.append, stop, ["stepwarden_tasks"]))
        await _until(lambda: store.watches and store.watches[0].reads >= 2, 10, "the watch never read")
        assert woken == []  # nothing committed yet
        _commit_elsewhere(path)
        await _until(lambda: woken, 2, "a commit woke nobody")
        reads = store.watches[0].reads
        await _until(lambda: store.watches[0].reads >= reads + 3, 10, "the watch stopped reading")
        assert woken == ["stepwarden_tasks"]  # a few more reads: still one wake-up for one commit
        stop.set()
        await asyncio.wait_for(listening, 2)

    try:
        asyncio.run(main())
    finally:
        store.close()
