"""Migrating an old store step by step must give exactly the schema of a fresh install (DEP3)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from stepwarden.errors import MigrationError
from stepwarden.store import open_store
from stepwarden.store.sql import load_migrations


def schema(store: Any) -> list[tuple[Any, ...]]:
    if store.dialect == "sqlite":
        rows = store.transact_sync(
            lambda tx: tx.sql(
                "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
            )
        )
        return sorted(
            (r["type"], r["name"], r["tbl_name"], re.sub(r"\s+", " ", r["sql"] or "")) for r in rows
        )
    cols = store.transact_sync(
        lambda tx: tx.sql(
            "SELECT table_name, column_name, data_type, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_schema = 'public'"
        )
    )
    idx = store.transact_sync(
        lambda tx: tx.sql("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'")
    )
    return sorted(tuple(str(v) for v in r.values()) for r in cols + idx)


def test_step_by_step_migration_equals_fresh_install(store_url: str, tmp_path: Path) -> None:
    versions = [v for v, _, _ in load_migrations("sqlite" if store_url.startswith("sqlite") else "postgres")]
    assert versions == sorted(versions) and versions[0] == 1
    fresh = open_store(store_url)  # the fixture's database is already migrated (template or new file)
    try:
        expected = schema(fresh)
    finally:
        fresh.close()
    if store_url.startswith("sqlite"):
        old_url = f"sqlite:///{tmp_path / 'old.db'}"
    else:
        old_url = store_url  # the same database, emptied: its fresh schema is captured above
        empty = open_store(old_url, migrate=False)
        empty.transact_sync(lambda tx: (tx.sql("DROP SCHEMA public CASCADE"), tx.sql("CREATE SCHEMA public")))
        empty.close()
    old = open_store(old_url, migrate=False)
    try:
        for v in versions:
            assert old.migrate(target=v) == 1  # one version at a time, as an upgrade would
        assert old.migrate() == 0  # idempotent
        assert schema(old) == expected
    finally:
        old.close()


def test_a_store_newer_than_the_code_is_refused(store_url: str) -> None:
    s = open_store(store_url)
    try:
        s.transact_sync(lambda tx: tx.sql("INSERT INTO schema_migrations VALUES (9999, 'future', 0)"))
    finally:
        s.close()
    with pytest.raises(MigrationError, match="newer"):
        open_store(store_url)
