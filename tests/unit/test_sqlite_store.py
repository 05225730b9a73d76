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
