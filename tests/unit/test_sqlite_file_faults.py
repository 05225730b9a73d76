"""An SQLite store's files misbehaving under a running application (found by a review that made
each happen on a real file system): its writes say what happened, write nothing, and never
acknowledge a task where no worker looks. The worker's side (it stops) is in
``tests/integration/test_sqlite_watch.py``."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stepwarden import App
from stepwarden.errors import StoreError, StoreMisconfigured
from stepwarden.store import SQLiteStore, open_store


@pytest.fixture
def app(tmp_path: Path, noop_app: Callable[..., App]) -> Iterator[App]:
    a = noop_app(f"sqlite:///{tmp_path / 'store.db'}")
    a.submit("one", {})  # the store open, its connection and its -wal and -shm made
    yield a
    a.close()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_submission_into_a_store_file_deleted_or_replaced_under_the_app_is_refused(
    app: App, tmp_path: Path, how: str
) -> None:
    """It was acknowledged, with an id, in the old file, where no worker would ever look: 31
    tasks left pending in a review's run. Now StoreError, and nothing written."""
    db = tmp_path / "store.db"
    if how == "replaced":
        other = tmp_path / "other.db"
        open_store(f"sqlite:///{other}").close()
        os.replace(other, db)
    else:
        os.unlink(db)
    with pytest.raises(StoreError, match=rf"was {how}.*nothing was written: start this process again"):
        app.submit("one", {})
    with pytest.raises(StoreError, match=rf"was {how}"), app.transaction() as tx:  # a block too
        tx.submit("one", {})
    store = app.store
    assert isinstance(store, SQLiteStore)
    # The file the app has open still holds the first task only. (Not read through the path: a
    # new connection there applies the old file's -wal, still at the path, to the new file; the
    # reason every process must stop before a backup is restored.)
    assert store._conn().execute("SELECT count(*) AS n FROM tasks").fetchone()["n"] == 1


@pytest.mark.parametrize("side", ["-wal", "-shm"])
def test_a_submission_after_the_stores_wal_or_shm_was_deleted_is_refused(
    app: App, tmp_path: Path, side: str
) -> None:
    """A clean-up script deleting the -wal or -shm under running processes: the others then use a
    new log, the store gets damaged, and an acknowledged task was lost. Said as what it is."""
    os.unlink(f"{tmp_path / 'store.db'}{side}")
    with pytest.raises(StoreError, match=rf"{side} file was deleted or replaced.*PRAGMA integrity_check"):
        app.submit("one", {})


def test_a_full_store_is_said_as_a_full_disk_and_nothing_is_written(app: App) -> None:
    """``database or disk is full`` came up as sqlite3's own OperationalError, which callers who
    catch StoreError (as documented) did not catch. The disk is made full for this connection
    with ``max_page_count``, which fails a write the way a full disk does (SQLITE_FULL)."""
    store = app.store
    assert isinstance(store, SQLiteStore)
    conn = store._conn()
    pages = conn.execute("PRAGMA page_count").fetchone()["page_count"]
    conn.execute(f"PRAGMA max_page_count = {pages}")
    before = _count(store)
    with pytest.raises(StoreError, match=r"is full .*so nothing was written: free space") as met:
        for i in range(200):  # until a page more is needed
            app.submit("one", {"n": i, "pad": "x" * 2000})
    assert isinstance(met.value.__cause__, sqlite3.OperationalError)
    conn.execute("PRAGMA max_page_count = 1073741823")
    written = _count(store) - before
    app.submit("one", {})  # space again: it goes on
    assert _count(store) == before + written + 1


def _count(store: SQLiteStore) -> int:
    return int(store.transact_sync(lambda tx: tx.sql("SELECT count(*) AS n FROM tasks"))[0]["n"])


def test_a_store_opened_read_only_and_writable_since_is_said_as_such(app: App) -> None:
    """SQLite opens a file it cannot write read-only and keeps it so for every connection of the
    process: once the permissions were mended a worker warned every 10 s for ever, an
    application failed every submission, with the first cause no longer shown. A read-only error
    on a file this user may write now is StoreMisconfigured, which ends a worker with one line.
    (As root, permissions do not stop a write: the error is made here as SQLite raises it.)"""
    store = app.store
    assert isinstance(store, SQLiteStore)
    e = sqlite3.OperationalError("attempt to write a readonly database")
    e.sqlite_errorcode = sqlite3.SQLITE_READONLY
    said = store._explained(e, 0.0)
    assert isinstance(said, StoreMisconfigured)
    assert "opened it while it could not be written" in str(said) and "start the process again" in str(said)


def test_a_store_opened_on_a_full_disk_is_unreachable_for_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a store must make its -shm file; on a full disk SQLite says only "disk I/O error"
    (SQLITE_IOERR_SHMSIZE), and a worker started then exited at once: a crash loop under a
    service manager. It is now StoreUnreachable naming the full disk, which a starting worker waits
    out (``Worker._open``). The error is made here as SQLite raises it, the disk full by statvfs."""
    import stepwarden.store as store_module
    from stepwarden.errors import StoreUnreachable

    def full_disk(*args: object, **kwargs: object) -> None:
        e = sqlite3.OperationalError("disk I/O error")
        e.sqlite_errorcode = sqlite3.SQLITE_IOERR_SHMSIZE
        raise e

    monkeypatch.setattr(store_module, "SQLiteStore", full_disk)
    monkeypatch.setattr(store_module, "disk_full", lambda path: True)
    with pytest.raises(StoreUnreachable, match=r"the disk holding it is full \(disk I/O error\); free space"):
        open_store(f"sqlite:///{tmp_path / 'store.db'}")
    monkeypatch.setattr(store_module, "disk_full", lambda path: False)
    with pytest.raises(StoreError) as other:  # an I/O error with space left stays what it was
        open_store(f"sqlite:///{tmp_path / 'store.db'}")
    assert not isinstance(other.value, StoreUnreachable)


def test_a_damaged_store_is_said_to_be_damaged_not_to_be_no_store(tmp_path: Path) -> None:
    """Read commands called a damaged store "not a stepwarden store" (after its -wal was deleted
    under running processes, in a review's run): it is one, to check and restore."""
    from stepwarden.store import open_existing

    db = tmp_path / "store.db"
    open_store(f"sqlite:///{db}").close()  # closed whole: its log checkpointed into the file
    with sqlite3.connect(db) as conn:
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'schema_migrations'").fetchone()[
            0
        ]
    with open(db, "r+b") as f:  # the table's page overwritten: its header no longer a b-tree's
        f.seek((root - 1) * page)
        f.write(b"\xff" * 64)
    with pytest.raises(StoreError, match=r"is damaged .*malformed.*PRAGMA integrity_check"):
        open_existing(f"sqlite:///{db}")
