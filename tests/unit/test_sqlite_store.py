"""SQLite-only store behaviour: migrations of an existing file and where the file may live."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from stepwarden.clock import FakeClock
from stepwarden.errors import MigrationError
from stepwarden.store import SQLiteStore, Store, open_store
from stepwarden.store import transitions as t
from stepwarden.store.sql import load_migrations


def q(store: Store, sql: str) -> list[dict[str, Any]]:
    return store.transact_sync(lambda tx: tx.sql(sql))


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "sw.db"


def test_migrations_are_idempotent_and_keep_data(db_path: Path, clock: FakeClock, make_workflow: Any) -> None:
    first = open_store(f"sqlite:///{db_path}", clock=clock)
    task_id, _ = first.transact_sync(
        t.submit, make_workflow(), "{}", correlation_id=None, idempotency_key=None, priority=0, reply_to=None
    )
    first.close()
    again = open_store(f"sqlite:///{db_path}", clock=clock)
    try:
        assert isinstance(again, SQLiteStore)
        assert again.migrate() == 0
        known = [{"version": v} for v, _, _ in load_migrations("sqlite")]
        assert q(again, "SELECT version FROM schema_migrations ORDER BY version") == known
        assert q(again, f"SELECT state FROM tasks WHERE id = {task_id}") == [{"state": "pending"}]
    finally:
        again.close()


def test_a_store_with_a_newer_schema_is_refused(db_path: Path, clock: FakeClock) -> None:
    s = open_store(f"sqlite:///{db_path}", clock=clock)
    q(s, "INSERT INTO schema_migrations VALUES (99, 'future', 0)")
    s.close()
    with pytest.raises(MigrationError, match="schema is version 99, newer than this stepwarden knows"):
        open_store(f"sqlite:///{db_path}", clock=clock)


def test_a_store_in_a_missing_directory_is_refused(tmp_path: Path, clock: FakeClock) -> None:
    with pytest.raises(MigrationError, match="does not exist"):
        open_store(f"sqlite:///{tmp_path}/nope/sw.db", clock=clock)


def test_the_url_can_ask_for_synchronous_normal_and_nothing_else(tmp_path: Path) -> None:
    from stepwarden.errors import InputError

    store = open_store(f"sqlite:///{tmp_path / 'a.db'}?synchronous=normal")
    try:
        assert isinstance(store, SQLiteStore) and store.synchronous == "NORMAL"
        assert store.url.endswith("a.db?synchronous=NORMAL")  # workers started from it get it too
        conn = store.connect()
        assert conn.execute("PRAGMA synchronous").fetchone()["synchronous"] == 1  # NORMAL
        conn.close()
    finally:
        store.close()
    default = open_store(f"sqlite:///{tmp_path / 'b.db'}")
    assert default.synchronous == "FULL" and "?" not in default.url  # type: ignore[attr-defined]
    default.close()
    with pytest.raises(InputError, match="synchronous must be FULL"):
        open_store(f"sqlite:///{tmp_path / 'c.db'}?synchronous=OFF")
    with pytest.raises(InputError, match="unknown sqlite URL option"):
        open_store(f"sqlite:///{tmp_path / 'c.db'}?journal=off")
    assert not (tmp_path / "c.db").exists()  # bad input writes nothing


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "1e9", ""])
def test_a_busy_timeout_that_is_no_number_of_seconds_is_refused_writing_nothing(
    tmp_path: Path, value: str
) -> None:
    from stepwarden.errors import InputError

    with pytest.raises(InputError, match="busy_timeout must be a number of seconds from 0 to 86400"):
        open_store(f"sqlite:///{tmp_path / 'c.db'}?busy_timeout={value}")
    assert not (tmp_path / "c.db").exists()


def test_the_url_sets_the_busy_timeout_and_passes_it_on(tmp_path: Path) -> None:
    """How long a writer waits for the write lock (30 s by default); workers started from the
    store's URL (the demo's, the CLI's) get the same."""
    store = open_store(f"sqlite:///{tmp_path / 'a.db'}?busy_timeout=2.5&synchronous=normal")
    try:
        assert isinstance(store, SQLiteStore)
        assert (store.busy_timeout, store.synchronous) == (2.5, "NORMAL")
        assert store.url.endswith("a.db?synchronous=NORMAL&busy_timeout=2.5")
        conn = store.connect()
        assert conn.execute("PRAGMA busy_timeout").fetchone()["timeout"] == 2500
        conn.close()
        again = open_store(store.url)
        assert again.busy_timeout == 2.5 and again.url == store.url  # type: ignore[attr-defined]
        again.close()
    finally:
        store.close()
    zero = open_store(f"sqlite:///{tmp_path / 'b.db'}?busy_timeout=0")
    assert zero.busy_timeout == 0 and zero.url.endswith("b.db?busy_timeout=0")  # type: ignore[attr-defined]
    zero.close()
