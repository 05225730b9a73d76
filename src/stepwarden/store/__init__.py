"""State stores: one database holds tasks, steps, messages, leases and events.

``open_store(url)`` picks the dialect from the URL: ``sqlite:///path.db`` (the embedded default).
"""

from __future__ import annotations

import os
import sqlite3
from urllib.parse import parse_qsl

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import InputError, StoreError
from .base import (
    FINAL_TASK_STATES,
    STEP_STATES,
    TASK_STATES,
    ApplyResult,
    RequestMsg,
    SweepResult,
    Tx,
    redact_url,
)
from .core import Store
from .sqlite import SQLiteStore

DEFAULT_URL = "sqlite:///stepwarden.db"

__all__ = [
    "DEFAULT_URL",
    "FINAL_TASK_STATES",
    "STEP_STATES",
    "TASK_STATES",
    "ApplyResult",
    "RequestMsg",
    "SQLiteStore",
    "Store",
    "StoreMissing",
    "SweepResult",
    "Tx",
    "open_existing",
    "open_store",
    "resolve_url",
]


def resolve_url(url: str | None) -> str:
    """``--db``, else ``STEPWARDEN_DB``, else the default file in the working directory (DEP5)."""
    return url or os.environ.get("STEPWARDEN_DB") or DEFAULT_URL


class StoreMissing(StoreError):
    """The store a read or operator command names has not been created: no file, or no schema."""


def open_existing(url: str | None = None, *, clock: Clock = SYSTEM_CLOCK) -> Store:
    """Open a store that must exist already, for commands that read it or act on its tasks: a
    mistyped path or database name is an error, never a new store (only ``init``, a worker and
    ``submit`` create one). A store of an older schema version is upgraded as on any open."""
    url = resolve_url(url)
    hint = f"run `stepwarden --db {redact_url(url)} init`, or start a worker, to create one"
    if url.startswith("sqlite:///"):
        path, _ = _sqlite_url(url)  # a malformed URL is bad input before it is a missing store
        if os.path.isdir(path):
            raise StoreMissing(f"{path!r} is a directory, not a stepwarden store: {hint}")
        if not os.path.isfile(path):
            raise StoreMissing(f"no stepwarden store at {path!r}: {hint}")
        if not _sqlite_has_schema(path):
            raise StoreMissing(f"{path!r} holds no stepwarden store (no schema): {hint}")
        return open_store(url, clock=clock)
    store = open_store(url, clock=clock, migrate=False)
    try:
        if not store.transact_sync(_pg_has_schema):
            raise StoreMissing(f"the database has no stepwarden schema: {hint}")
        store.migrate()
    except BaseException:
        store.close()
        raise
    return store


def _sqlite_has_schema(path: str) -> bool:
    """Read through a read-only connection: opening the store itself would set the journal mode,
    writing to a file that may be anything."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise StoreError(f"cannot open {path!r}: {e}") from None
    try:
        row = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
        ).fetchone()
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path!r} is not a stepwarden store: {e}") from None
    finally:
        conn.close()
    return row is not None


def _sqlite_url(url: str) -> tuple[str, str]:
    """``sqlite:///PATH[?synchronous=MODE]``: the path and the mode, or :class:`InputError`."""
    path, _, query = url[len("sqlite:///") :].partition("?")
    if not path:
        raise InputError("sqlite URL has no path: use sqlite:///relative.db or sqlite:////absolute.db")
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - {"synchronous"})
    if unknown:
        raise InputError(
            f"unknown sqlite URL option(s) {', '.join(repr(k)[:40] for k in unknown)}: only synchronous"
        )
    sync = options.get("synchronous", "FULL").upper()
    if sync not in ("FULL", "NORMAL", "EXTRA"):
        raise InputError("sqlite URL option synchronous must be FULL (the default), NORMAL or EXTRA")
    return path, sync


def _pg_has_schema(tx: Tx) -> bool:
    return bool(tx.sql("SELECT to_regclass('schema_migrations') IS NOT NULL AS present")[0]["present"])


def open_store(url: str | None = None, *, clock: Clock = SYSTEM_CLOCK, migrate: bool = True) -> Store:
    url = resolve_url(url)
    if url.startswith("sqlite:///"):
        path, sync = _sqlite_url(url)
        return SQLiteStore(path, clock=clock, migrate=migrate, synchronous=sync)
    if url.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresStore

        return PostgresStore(url, clock=clock, migrate=migrate)
    raise InputError(f"unsupported store URL {url[:80]!r}: expected sqlite:///PATH or postgresql://...")
