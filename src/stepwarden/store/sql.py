"""Loading named SQL: ``-- name: x`` blocks in ``sql/<dialect>/queries.sql``, migrations beside them."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from importlib import resources
from typing import Any

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.M)


def load_queries(dialect: str, now: str) -> dict[str, str]:
    """Parse the ``*.sql`` files of ``sql/common`` (the queries every dialect shares), then those of
    the dialect's folder, whose queries replace common ones of the same name (claims with SKIP
    LOCKED, row locks); ``{now}`` becomes the dialect's expression for the database clock."""
    out: dict[str, str] = {}
    for layer in ("common", dialect):
        seen: set[str] = set()
        folder = resources.files(__package__).joinpath("sql", layer)
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if not entry.name.endswith(".sql"):
                continue
            parts = _NAME.split(entry.read_text())
            for name, body in zip(parts[1::2], parts[2::2], strict=True):
                if name in seen:
                    raise ValueError(f"query {name!r} is defined twice in sql/{layer}/*.sql")
                seen.add(name)
                out[name] = body.strip().rstrip(";").replace("{now}", now)
    return out


def load_migrations(dialect: str) -> list[tuple[int, str, str]]:
    """``[(version, name, sql), ...]`` sorted by version, from files named ``NNNN_name.sql``."""
    folder = resources.files(__package__).joinpath("sql", dialect, "migrations")
    found = []
    for entry in folder.iterdir():
        m = re.match(r"^(\d{4})_(\w+)\.sql$", entry.name)
        if m:
            found.append((int(m.group(1)), m.group(2), entry.read_text()))
    return sorted(found)


def split_statements(script: str) -> list[str]:
    """Split a migration into statements (our migrations keep ';' out of literals)."""
    lines = [ln for ln in script.splitlines() if not ln.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def pending_migrations(
    dialect: str, current: int, target: int | None = None
) -> list[tuple[int, str, list[str]]]:
    """The migrations to apply to a store at version ``current`` (up to ``target``), as
    ``(version, name, statements)``; a store newer than this code is refused."""
    from ..errors import MigrationError

    known = load_migrations(dialect)
    if known and current > known[-1][0]:
        raise MigrationError(
            f"the store's schema is version {current}, newer than this stepwarden knows "
            f"({known[-1][0]}); upgrade stepwarden"
        )
    return [
        (version, name, split_statements(script))
        for version, name, script in known
        if version > current and (target is None or version <= target)
    ]


_CREATED = re.compile(r"\bCREATE TABLE (?:IF NOT EXISTS )?(\w+)", re.I)


def our_tables(dialect: str) -> list[str]:
    """The tables stepwarden's migrations create, ``schema_migrations`` first: the names a
    database must not already use for something else."""
    names = ["schema_migrations"]
    for _, _, script in load_migrations(dialect):
        names += [n for n in _CREATED.findall(script) if n not in names]
    return names


def check_history(dialect: str, recorded: Sequence[tuple[Any, Any]] | None, existing: Collection[str]) -> int:
    """The store's schema version, from the ``(version, name)`` rows of its ``schema_migrations``
    (None: the table has no such columns), once it is clear that the database's tables named as
    ours are ours. The names are plain (SUB2 puts the store in the application's own database),
    and ``schema_migrations`` is also what Rails, golang-migrate and dbmate call their own table:
    read as ours, its highest version would have made stepwarden skip migrations it never
    applied, and a fresh install stopped at the first table of ours the database already had.
    ``existing``: the database's tables whose names are ours (migrations not yet applied)."""
    from ..errors import MigrationError

    known = {version: name for version, name, _ in load_migrations(dialect)}
    foreign = recorded is None or any(
        not isinstance(v, int)
        or (v in known and known[v] != n)
        or (v <= max(known, default=0) and v not in known)
        for v, n in recorded
    )
    if foreign:
        raise MigrationError(
            "this database has a table schema_migrations that stepwarden did not write (another"
            " migration tool's, such as Rails', golang-migrate's or dbmate's): stepwarden's tables"
            " have plain names and cannot share a database with it; give stepwarden a database"
            " of its own"
        )
    version = max((int(v) for v, _ in recorded or ()), default=0)
    made = {t for v, _, script in load_migrations(dialect) if v <= version for t in _CREATED.findall(script)}
    clash = [t for t in our_tables(dialect) if t in existing and t not in made and t != "schema_migrations"]
    if clash:
        raise MigrationError(
            f"this database already has table(s) named {', '.join(clash)}, which stepwarden's own"
            " tables are called: rename yours, or give stepwarden a database of its own (nothing"
            " was changed)"
        )
    return version


# Per dialect: the tables of the schema the store's SQL uses, and the columns of schema_migrations.
_CATALOGUE = {
    "sqlite": (
        "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')",
        "SELECT name FROM pragma_table_info('schema_migrations')",
    ),
    # The tables an unqualified name finds (the search_path), as the store's statements do: a
    # store in a later schema of the path still reads as the store, not as none.
    "postgres": (
        "SELECT c.relname FROM pg_catalog.pg_class c"
        " WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f') AND pg_catalog.pg_table_is_visible(c.oid)",
        "SELECT attname FROM pg_catalog.pg_attribute"
        " WHERE attrelid = to_regclass('schema_migrations') AND attnum > 0 AND NOT attisdropped",
    ),
}


def schema_version(dialect: str, rows: Callable[[str], list[tuple[Any, ...]]]) -> int:
    """The store's schema version (0: none), read through ``rows`` (run a query, return its rows
    as tuples) in the transaction that will migrate it, after :func:`check_history`."""
    tables_sql, columns_sql = _CATALOGUE[dialect]
    existing = {str(r[0]) for r in rows(tables_sql)} & set(our_tables(dialect))
    recorded: list[tuple[Any, ...]] | None = []
    if "schema_migrations" in existing:
        columns = {str(r[0]) for r in rows(columns_sql)}
        recorded = (
            rows("SELECT version, name FROM schema_migrations") if {"version", "name"} <= columns else None
        )
    return check_history(dialect, recorded, existing)
