"""Migrating an old store step by step must give exactly the schema of a fresh install (DEP3).

The schema is read from the database's own catalogue, section by section, on both stores:

* SQLite: every object's SQL in ``sqlite_master`` (whitespace-normalised), and per table its columns
  (``table_xinfo``: name, declared type, NOT NULL, default, key position, hidden), its kind
  (``table_list``: WITHOUT ROWID, STRICT), its indexes (``index_list`` / ``index_xinfo``, with the
  index's SQL and so its partial predicate; the automatic indexes of UNIQUE and PRIMARY KEY too) and
  its foreign keys (``foreign_key_list``: columns, referenced table and columns, ON UPDATE/DELETE);
* PostgreSQL: tables (kind, persistence, options), columns in order (name, type with modifiers, NOT
  NULL, default expression, identity, generated, collation), indexes (``pg_indexes.indexdef``: the
  full definition with UNIQUE, method, columns and WHERE predicate), constraints of every kind
  (primary key, unique, foreign key, check, exclusion, not-null, via ``pg_get_constraintdef``, with
  deferrability), sequences (their parameters, not their position), views, triggers and functions;
* on both, the migrations recorded in ``schema_migrations``.

``test_the_comparison_sees_a_step_that_differs`` keeps the comparison honest: it changes one
migration for the step-by-step run only, and the section that must notice the change has to differ.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepwarden.errors import MigrationError
from stepwarden.store import Store, StoreMissing, open_existing, open_store
from stepwarden.store import sql as store_sql
from stepwarden.store.sql import load_migrations

Schema = dict[str, list[tuple[Any, ...]]]


def _norm(sql: str | None) -> str:
    return re.sub(r"\s+", " ", sql or "").strip()


def _sqlite_schema(tx: Any) -> Schema:
    def rows(query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return [tuple(dict(r).values()) for r in tx.sql(query, params)]

    objects = rows("SELECT type, name, tbl_name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")
    tables = [
        name
        for (name,) in rows(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name"
        )
    ]
    out: Schema = {
        "objects": sorted((t, n, tbl, _norm(sql)) for t, n, tbl, sql in objects),
        "tables": [],
        "columns": [],
        "indexes": [],
        "foreign_keys": [],
    }
    index_sql = {n: _norm(sql) for t, n, _, sql in objects if t == "index"}
    for table in tables:
        out["tables"] += [
            (table, *r)
            for r in rows(
                "SELECT type, ncol, wr, strict FROM pragma_table_list WHERE schema = 'main' AND name = ?",
                (table,),
            )
        ]
        out["columns"] += [
            (table, *r)
            for r in rows(
                'SELECT cid, name, type, "notnull", dflt_value, pk, hidden FROM pragma_table_xinfo(?)',
                (table,),
            )
        ]
        for name, unique, origin, partial in rows(
            'SELECT name, "unique", origin, partial FROM pragma_index_list(?) ORDER BY name', (table,)
        ):
            # Automatic indexes (sqlite_autoindex_<table>_<n>) have no SQL; their columns say it all.
            keys = rows(
                'SELECT seqno, cid, name, "desc", coll, "key" FROM pragma_index_xinfo(?) ORDER BY seqno',
                (name,),
            )
            out["indexes"].append((table, name, unique, origin, partial, index_sql.get(name, ""), keys))
        out["foreign_keys"] += [
            (table, *r)
            for r in rows(
                'SELECT id, seq, "table", "from", "to", on_update, on_delete, "match" '
                "FROM pragma_foreign_key_list(?) ORDER BY id, seq",
                (table,),
            )
        ]
    out["migrations"] = rows("SELECT version, name FROM schema_migrations ORDER BY version")
    return out


# Every query reads the current schema only (the tests' databases use "public").
_PG_QUERIES = {
    "tables": """
        SELECT c.relname, c.relkind, c.relpersistence, COALESCE(array_to_string(c.reloptions, ','), '')
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
        ORDER BY c.relname""",
    "columns": """
        SELECT c.relname,
               row_number() OVER (PARTITION BY c.relname ORDER BY a.attnum),
               a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated,
               COALESCE(co.collname, '')
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 0
        WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
          AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY c.relname, a.attnum""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = current_schema() ORDER BY tablename, indexname""",
    "constraints": """
        SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid, true),
               k.condeferrable, k.condeferred, k.convalidated
        FROM pg_constraint k
        JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = current_schema()
        ORDER BY c.relname, k.conname""",
    "sequences": """
        SELECT sequencename, data_type::text, start_value, min_value, max_value, increment_by, cycle,
               cache_size
        FROM pg_sequences WHERE schemaname = current_schema() ORDER BY sequencename""",
    "views": """
        SELECT viewname, definition FROM pg_views WHERE schemaname = current_schema()
        ORDER BY viewname""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid, true)
        FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = current_schema() AND NOT t.tgisinternal
        ORDER BY c.relname, t.tgname""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = current_schema() AND p.prokind IN ('f', 'p')
        ORDER BY 1, 2""",
    "migrations": "SELECT version, name FROM schema_migrations ORDER BY version",
}


def _postgres_schema(tx: Any) -> Schema:
    return {
        section: [tuple(_norm(v) if isinstance(v, str) else v for v in dict(r).values()) for r in tx.sql(q)]
        for section, q in _PG_QUERIES.items()
    }


def schema(store: Store) -> Schema:
    return store.transact_sync(_sqlite_schema if store.dialect == "sqlite" else _postgres_schema)


def differing_sections(a: Schema, b: Schema) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def assert_same_schema(got: Schema, expected: Schema) -> None:
    """Section by section, so that a failure names what differs."""
    for section in sorted(expected.keys() | got.keys()):
        missing = [r for r in expected.get(section, []) if r not in got.get(section, [])]
        extra = [r for r in got.get(section, []) if r not in expected.get(section, [])]
        assert got.get(section) == expected.get(section), (
            f"{section} differ after migrating step by step\n"
            f"  only in the fresh install: {missing}\n  only after the upgrade: {extra}"
        )


def dialect_of(store_url: str) -> str:
    return "sqlite" if store_url.startswith("sqlite") else "postgres"


def fresh_schema(store_url: str) -> Schema:
    """The fixture's database is a fresh install already (a new file, or a copy of the template)."""
    fresh = open_store(store_url)
    try:
        return schema(fresh)
    finally:
        fresh.close()


def migrate_step_by_step(store_url: str, tmp_path: Path) -> Schema:
    """An empty store taken from nothing to version 1, then up one version at a time, as upgrades do."""
    versions = [v for v, _, _ in load_migrations(dialect_of(store_url))]
    assert versions == sorted(versions) and versions[0] == 1
    if store_url.startswith("sqlite"):
        old_url = f"sqlite:///{tmp_path / 'old.db'}"
    else:
        old_url = store_url  # the same database, emptied: its fresh schema was read before
        empty = open_store(old_url, migrate=False)
        empty.transact_sync(lambda tx: (tx.sql("DROP SCHEMA public CASCADE"), tx.sql("CREATE SCHEMA public")))
        empty.close()
    old: Any = open_store(old_url, migrate=False)  # migrate(target=) is on the concrete stores
    try:
        for v in versions:
            assert old.migrate(target=v) == 1  # one version at a time, as an upgrade would
        assert old.migrate() == 0  # idempotent
        return schema(old)
    finally:
        old.close()


def test_step_by_step_migration_equals_fresh_install(store_url: str, tmp_path: Path) -> None:
    expected = fresh_schema(store_url)
    # The reading itself must see the schema, or equal schemas would prove nothing.
    assert {"tasks", "steps", "workers"} <= {r[0] for r in expected["tables"]}
    sections = ("columns", "indexes", "migrations")
    assert all(expected[s] for s in sections), {s: len(expected[s]) for s in sections}
    if store_url.startswith("sqlite"):
        assert expected["foreign_keys"], "steps.task_id REFERENCES tasks (id) is not seen"
    else:
        assert {r[2] for r in expected["constraints"]} >= {"p", "u", "f"}, expected["constraints"]
    assert_same_schema(migrate_step_by_step(store_url, tmp_path), expected)


# (migration version, pattern, replacement, the section that must notice on SQLite, on PostgreSQL)
MUTATIONS: dict[str, tuple[int, str, str, str, str]] = {
    "foreign-key-dropped": (1, r" REFERENCES tasks \(id\)", "", "foreign_keys", "constraints"),
    "foreign-key-on-delete": (
        1,
        r"REFERENCES tasks \(id\)",
        "REFERENCES tasks (id) ON DELETE CASCADE",
        "foreign_keys",
        "constraints",
    ),
    "partial-index-predicate": (4, r"WHERE state = 'taken'", "WHERE state = 'queued'", "indexes", "indexes"),
    "index-columns": (
        2,
        r"messages_task ON messages \(task_id, id\)",
        "messages_task ON messages (task_id)",
        "indexes",
        "indexes",
    ),
    "index-not-unique": (
        2,
        r"CREATE UNIQUE INDEX messages_seq",
        "CREATE INDEX messages_seq",
        "indexes",
        "indexes",
    ),
    "unique-dropped": (1, r"idempotency_key  TEXT UNIQUE", "idempotency_key  TEXT", "indexes", "constraints"),
    "check-added": (
        3,
        r"opens      INTEGER NOT NULL,",
        "opens INTEGER NOT NULL CHECK (opens >= 0),",
        "objects",
        "constraints",
    ),
    "column-default": (1, r"DEFAULT 'new'", "DEFAULT 'old'", "columns", "columns"),
    "column-nullable": (2, r"(last_seq \w+) NOT NULL", r"\1", "columns", "columns"),
    "column-type": (3, r"cool_off(\s+)(REAL|DOUBLE PRECISION)", r"cool_off\1INTEGER", "columns", "columns"),
    "column-missing": (4, r"ALTER TABLE workers ADD COLUMN proc_start TEXT;", "", "columns", "columns"),
}


def _mutated(version: int, pattern: str, replacement: str) -> Callable[[str], list[tuple[int, str, str]]]:
    real = store_sql.load_migrations

    def load(dialect: str) -> list[tuple[int, str, str]]:
        out = []
        for v, name, script in real(dialect):
            if v == version:
                script, n = re.subn(pattern, replacement, script)
                assert n == 1, f"the mutation {pattern!r} matches {n} places in migration {v} ({dialect})"
            out.append((v, name, script))
        return out

    return load


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_comparison_sees_a_step_that_differs(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutation: str
) -> None:
    """One migration step gives a different schema when applied on its own (the fresh install is
    read first, unchanged): the comparison must fail, in the section that describes the change."""
    version, pattern, replacement, on_sqlite, on_postgres = MUTATIONS[mutation]
    expected = fresh_schema(store_url)
    monkeypatch.setattr(store_sql, "load_migrations", _mutated(version, pattern, replacement))
    got = migrate_step_by_step(store_url, tmp_path)
    section = on_sqlite if store_url.startswith("sqlite") else on_postgres
    assert section in differing_sections(got, expected), differing_sections(got, expected)
    with pytest.raises(AssertionError, match="differ after migrating step by step"):
        assert_same_schema(got, expected)


def test_a_store_newer_than_the_code_is_refused(store_url: str) -> None:
    s = open_store(store_url)
    try:
        s.transact_sync(lambda tx: tx.sql("INSERT INTO schema_migrations VALUES (9999, 'future', 0)"))
    finally:
        s.close()
    with pytest.raises(MigrationError, match="newer"):
        open_store(store_url)


def empty_database(store_url: str, tmp_path: Path) -> str:
    """A database with no table at all: a new SQLite file, or the fixture's PostgreSQL database
    with its schema dropped."""
    if store_url.startswith("sqlite"):
        return f"sqlite:///{tmp_path / 'empty.db'}"
    empty = open_store(store_url, migrate=False)
    empty.transact_sync(lambda tx: (tx.sql("DROP SCHEMA public CASCADE"), tx.sql("CREATE SCHEMA public")))
    empty.close()
    return store_url


def raw(url: str, *statements: str) -> list[tuple[Any, ...]]:
    """Run the application's own SQL on ``url`` outside stepwarden; the last statement's rows."""
    if url.startswith("sqlite"):
        import sqlite3

        conn = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            out: list[tuple[Any, ...]] = []
            for s in statements:
                out = conn.execute(s).fetchall()
            conn.commit()
            return out
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        rows: list[tuple[Any, ...]] = []
        for s in statements:
            cur = pg.execute(s)
            rows = cur.fetchall() if cur.description else []
        return rows


def tables_of(url: str) -> set[str]:
    if url.startswith("sqlite"):
        return {r[0] for r in raw(url, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    return {
        r[0]
        for r in raw(url, "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")
    }


@pytest.mark.parametrize(
    "foreign",
    [
        # golang-migrate's table: its version would have read as "schema 20240101, newer than this code"
        (
            "CREATE TABLE schema_migrations (version BIGINT PRIMARY KEY, dirty BOOLEAN NOT NULL)",
            "INSERT INTO schema_migrations VALUES (20240101, false)",
        ),
        # Rails' and dbmate's: a text version
        (
            "CREATE TABLE schema_migrations (version VARCHAR(128) PRIMARY KEY)",
            "INSERT INTO schema_migrations VALUES ('3')",
        ),
        # our columns, another tool's rows: its version 2 would have skipped our migrations 1 and 2
        (
            "CREATE TABLE schema_migrations"
            " (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL)",
            "INSERT INTO schema_migrations VALUES (2, 'add_users', 0)",
        ),
    ],
    ids=["golang-migrate", "rails", "same-columns"],
)
def test_another_tools_schema_migrations_is_not_read_as_ours(
    store_url: str, tmp_path: Path, foreign: tuple[str, str]
) -> None:
    url = empty_database(store_url, tmp_path)
    raw(url, *foreign)
    before = raw(url, "SELECT * FROM schema_migrations")

    with pytest.raises(MigrationError, match="schema_migrations that stepwarden did not write"):
        open_store(url)

    assert tables_of(url) == {"schema_migrations"}, "nothing of stepwarden's was created"
    assert raw(url, "SELECT * FROM schema_migrations") == before, "the other tool's table is as it was"


def test_a_database_with_a_table_of_one_of_our_names_is_refused_whole(store_url: str, tmp_path: Path) -> None:
    url = empty_database(store_url, tmp_path)
    raw(
        url,
        "CREATE TABLE events (id INTEGER PRIMARY KEY, what TEXT)",
        "INSERT INTO events VALUES (7, 'signup')",
    )
    raw(url, "CREATE TABLE orders (id INTEGER PRIMARY KEY)")  # a name of the application's own: fine

    with pytest.raises(MigrationError, match=r"already has table\(s\) named events, which"):
        open_store(url)
    # A read command (open_existing) says the same, not "run init", which would refuse it (found
    # by review: its hint led nowhere).
    with pytest.raises(StoreMissing, match=r"no stepwarden schema, and has table\(s\) named events, which"):
        open_existing(url)

    assert tables_of(url) == {"events", "orders"}, "nothing of stepwarden's was created"
    assert raw(url, "SELECT id, what FROM events") == [(7, "signup")]
    raw(url, "DROP TABLE events")
    open_store(url).close()  # once the name is free, the store installs beside the application's tables
    assert {"tasks", "events", "orders", "schema_migrations"} <= tables_of(url)


@pytest.mark.parametrize(
    "theirs",
    ["CREATE TABLE tasks (x TEXT)", "CREATE TABLE schema_migrations (version TEXT PRIMARY KEY)"],
    ids=["a table of our name", "another tool's schema_migrations"],
)
def test_a_sqlite_database_refused_is_left_byte_for_byte_as_it_was(tmp_path: Path, theirs: str) -> None:
    """Another application's SQLite file, in its own journal mode: the refusal said "nothing was
    changed", but the store's first connection had already switched the file to WAL for good
    (its header rewritten, -wal and -shm files beside it). It is now checked read-only first."""
    path = tmp_path / "theirs.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute(theirs)
        conn.commit()
    before = path.read_bytes()

    with pytest.raises(MigrationError):
        open_store(f"sqlite:///{path}")

    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs.db"]
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)


# Every store records the names of the migrations it applied, and a recorded name that differs
# from the file's is read as another tool's table (``sql.check_history``): a migration, once
# released, is never renamed, renumbered or removed. Add new ones after these.
RELEASED = [
    (1, "initial"),
    (2, "replies_and_alert_delivery"),
    (3, "agents"),
    (4, "liveness_and_pruning"),
    (5, "record_retention"),
    (6, "waiting_tasks"),
    (7, "exact_metrics"),
    (8, "store_identity"),
    (9, "partial_correlation_index"),
]


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_released_migrations_keep_their_numbers_and_names(dialect: str) -> None:
    known = [(version, name) for version, name, _ in load_migrations(dialect)]
    assert known[: len(RELEASED)] == RELEASED


def test_a_store_in_a_later_schema_of_the_search_path_is_still_read_as_the_store(pg_url: str) -> None:
    """PostgreSQL: the store's tables in ``public``, then a schema named after the user created,
    which comes first in the default search_path (``"$user", public``). The store's statements
    still find its tables by the path; reading its version only in the first schema took it for
    no store at all."""
    from stepwarden.store import open_existing

    raw(pg_url, "CREATE SCHEMA IF NOT EXISTS AUTHORIZATION CURRENT_USER")
    try:
        store = open_existing(pg_url)
        store.close()
    finally:
        raw(pg_url, "DROP SCHEMA IF EXISTS " + raw(pg_url, "SELECT current_user")[0][0] + " CASCADE")


# Indexes that a migration redefined although a released query names them in INDEXED BY, and the
# migration that did: a worker from before it stops claiming ("no query solution") once a newer
# process migrates its SQLite store (deploying.md says so). No other may be added.
REDEFINED_INDEXED_BY = {("tasks_claimable", 6)}


def test_no_sqlite_migration_redefines_an_index_a_query_names_in_indexed_by() -> None:
    """A query that says ``INDEXED BY name`` fails outright when the index ``name`` exists but no
    longer fits it (another predicate, other columns): SQLite does not fall back to a scan. A
    worker of the previous version still runs the previous queries against the migrated schema,
    so an index named that way must keep its definition; a changed one gets a new name."""
    from stepwarden.store.sql import load_migrations, load_queries

    named = set()
    for text in load_queries("sqlite", "0").values():
        named |= set(re.findall(r"INDEXED\s+BY\s+(\w+)", text, flags=re.IGNORECASE))
    assert named, "no INDEXED BY found: has the query loader changed?"
    redefined = set()
    for version, _name, script in load_migrations("sqlite"):
        for index in re.findall(r"DROP\s+INDEX\s+(?:IF\s+EXISTS\s+)?(\w+)", script, flags=re.IGNORECASE):
            if index in named or (index, version) in REDEFINED_INDEXED_BY:
                redefined.add((index, version))
    assert redefined == REDEFINED_INDEXED_BY, (
        "a migration drops an index that a query names in INDEXED BY: give the new definition a new"
        f" name and leave the old one to a major version ({sorted(redefined - REDEFINED_INDEXED_BY)})"
    )
