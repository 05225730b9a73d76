"""State stores: one database holds tasks, steps, messages, leases and events.

``open_store(url)`` picks the dialect from the URL: ``sqlite:///path.db`` (the embedded default).
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import InputError, MigrationError, StoreError, StoreUnreachable
from .base import (
    FINAL_TASK_STATES,
    STEP_STATES,
    TASK_STATES,
    ApplyResult,
    RequestMsg,
    SweepResult,
    Tx,
    redact_url,
    shorten,
)
from .core import Store
from .sql import our_tables, pending_migrations, schema_version
from .sqlite import SQLiteStore
from .sqlite_files import damaged_text, disk_full, primary_code, refuse_foreign_read
from .sqlite_files import sqlite_why as _sqlite_why

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
    """Open a store that must exist already, for commands that read it or act on its tasks.

    It writes nothing on opening: a mistyped path or database name is an error, never a new
    store (only ``init``, a worker and ``submit --app`` create one), and a store of an older
    schema is not upgraded behind the operator's back (``init`` or a worker does that), so a
    read-only database role can run the read commands."""
    url = resolve_url(url)
    if url.startswith("sqlite:///"):
        path, _ = _sqlite_url(url)  # a malformed URL is bad input before it is a missing store
        where = shorten(repr(path))
        if os.path.isdir(path):
            raise StoreMissing(f"{where} is a directory, not a stepwarden store: {_create_hint(url)}")
        if not os.path.isfile(path):
            raise StoreMissing(f"no stepwarden store at {where}: {_create_hint(url)}")
        refuse_foreign_read(path)  # before the probe's connection, which would create files
        _check_version(*_sqlite_version(path, where), "sqlite", url, where)
        return open_store(url, clock=clock, migrate=False)
    store = open_store(url, clock=clock, migrate=False)
    try:
        _check_version(*store.transact_sync(_pg_version), "postgres", url, "the database")
    except BaseException:
        store.close()
        raise
    return store


def _init_command(url: str) -> str:
    return f"`stepwarden --db {shorten(redact_url(url))} init`"


def _create_hint(url: str) -> str:
    return f"run {_init_command(url)}, or start a worker, to create one"


def _check_version(version: int | None, clash: list[str], dialect: str, url: str, where: str) -> None:
    """A store this code can read as it is, or :class:`StoreMissing` / :class:`MigrationError`.
    ``clash``: the tables of the database named as stepwarden's, when it has no schema of ours."""
    if not version and clash:
        # `init` would refuse it (check_history): its hint led nowhere (found by review).
        raise StoreMissing(
            f"{where} holds no stepwarden schema, and has table(s) named {', '.join(clash)}, which"
            " stepwarden's own tables are called: give stepwarden a database of its own, or rename"
            " yours"
        )
    if not version:  # no table of migrations, or an empty one: nothing was ever migrated
        raise StoreMissing(f"{where} holds no stepwarden schema: {_create_hint(url)}")
    todo = pending_migrations(dialect, version)  # raises for a schema newer than this code
    if todo:
        raise MigrationError(
            f"the store's schema is version {version}, older than this stepwarden's {todo[-1][0]}: "
            f"run {_init_command(url)} to upgrade it (a worker also does, on start)"
        )


def _sqlite_version(path: str, where: str) -> tuple[int | None, list[str]]:
    """The schema version, read through a read-only connection: opening the store itself would
    set the journal mode, writing to a file that may be anything.

    Only a file that is no database, or one whose tables are not ours (``SQLITE_NOTADB``, a
    plain SQL error such as a missing column), is "not a stepwarden store": a store that this user
    may not read as it stands (its permissions, its folder's, a lock) is one, and the line says
    why it cannot be read instead.

    A read-only connection to a file in WAL mode creates its ``-wal`` and ``-shm`` files and
    cannot remove them as it closes: when it made them, a plain connection reads the schema and
    closes, the last one on the file, which removes them as it would have (nothing is written:
    the log is empty). A store that is refused (another schema version) is left as it was found."""
    sides = [Path(path + suffix) for suffix in ("-wal", "-shm")]
    had = [side.exists() for side in sides]
    try:
        return _read_sqlite_version(path, where)
    finally:
        if any(side.exists() and not existed for side, existed in zip(sides, had, strict=True)):
            with contextlib.suppress(sqlite3.Error):
                tidy = sqlite3.connect(path)
                try:
                    tidy.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
                finally:
                    tidy.close()


def _read_sqlite_version(path: str, where: str) -> tuple[int | None, list[str]]:
    try:
        conn = sqlite3.connect(Path(path).absolute().as_uri() + "?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise StoreError(f"cannot open the SQLite store {where}: {_sqlite_why(path, e)}") from None
    try:
        names = {
            str(r[0]) for r in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")
        }
        if "schema_migrations" not in names:
            return None, [t for t in our_tables("sqlite") if t in names]
        return schema_version("sqlite", lambda q: [tuple(r) for r in conn.execute(q).fetchall()]), []
    except sqlite3.OperationalError as e:
        if primary_code(e) in (sqlite3.SQLITE_ERROR, None):
            raise StoreError(f"{where} is not a stepwarden store: {e}") from None
        raise StoreError(f"cannot read the SQLite store {where}: {_sqlite_why(path, e)}") from None
    except sqlite3.DatabaseError as e:
        if primary_code(e) == sqlite3.SQLITE_CORRUPT:  # a store, damaged: not "not a store"
            raise StoreError(damaged_text(where, e)) from None
        raise StoreError(f"{where} is not a stepwarden store: {e}") from None
    finally:
        conn.close()


def _pg_version(tx: Tx) -> tuple[int | None, list[str]]:
    if not tx.sql("SELECT to_regclass('schema_migrations') IS NOT NULL AS present")[0]["present"]:
        from .pg_migrate import elsewhere_text, stores_elsewhere

        elsewhere = stores_elsewhere(tx.sql)
        if elsewhere[1]:  # "run init" would create a second store, not reach this one
            raise StoreMissing(elsewhere_text(elsewhere))
        ours = our_tables("postgres")
        found = tx.sql(
            "SELECT n FROM unnest(CAST(? AS text[])) AS n WHERE to_regclass(quote_ident(n)) IS NOT NULL",
            (ours,),
        )
        present = {str(r["n"]) for r in found}
        return None, [t for t in ours if t in present]
    return schema_version("postgres", lambda q: [tuple(r.values()) for r in tx.sql(q)]), []


MAX_BUSY_TIMEOUT = 86400.0


def _sqlite_url(url: str) -> tuple[str, dict[str, Any]]:
    """``sqlite:///PATH[?synchronous=MODE&busy_timeout=SECONDS]``: the path and the
    :class:`SQLiteStore` keywords its options give, or :class:`InputError`."""
    path, _, query = url[len("sqlite:///") :].partition("?")
    if not path:
        raise InputError("sqlite URL has no path: use sqlite:///relative.db or sqlite:////absolute.db")
    if path == ":memory:" or path.startswith("file:"):
        raise InputError(
            "sqlite URL must name a file: an in-memory database is private to one connection, and "
            "stepwarden's processes and threads share the store"
        )
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - {"synchronous", "busy_timeout"})
    if unknown:
        raise InputError(
            f"unknown sqlite URL option(s) {', '.join(repr(k)[:40] for k in unknown)}:"
            " only synchronous and busy_timeout"
        )
    sync = options.get("synchronous", "FULL").upper()
    if sync not in ("FULL", "NORMAL", "EXTRA"):
        raise InputError("sqlite URL option synchronous must be FULL (the default), NORMAL or EXTRA")
    keywords: dict[str, Any] = {"synchronous": sync}
    if "busy_timeout" in options:
        keywords["busy_timeout"] = _busy_timeout(options["busy_timeout"])
    return path, keywords


def _busy_timeout(text: str) -> float:
    """Seconds a writer waits for the write lock before failing (the default is 30)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_BUSY_TIMEOUT:  # NaN and infinity fail this too
        raise InputError(
            f"sqlite URL option busy_timeout must be a number of seconds from 0 to"
            f" {MAX_BUSY_TIMEOUT:g}, not {text[:40]!r}"
        )
    return seconds


def open_store(
    url: str | None = None, *, clock: Clock = SYSTEM_CLOCK, migrate: bool = True, beside: bool = False
) -> Store:
    """The store at ``url`` (``STEPWARDEN_DB`` or the default file when None), migrated unless
    ``migrate`` is False. ``beside`` (``init``): on PostgreSQL, create a store where the
    search_path points even when another schema of the database holds one, which a worker or an
    application refuses (:func:`~stepwarden.store.pg_migrate.stores_elsewhere`)."""
    url = resolve_url(url)
    if url.startswith("sqlite:///"):
        path, options = _sqlite_url(url)
        started = time.monotonic()
        try:
            return SQLiteStore(path, clock=clock, migrate=migrate, **options)
        except sqlite3.Error as e:  # sqlite3 names neither the file nor what to do about it
            code = primary_code(e)
            locked = code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
            where = shorten(repr(path))
            if code in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR) and disk_full(path):
                # A worker starting waits it out, as it does a store locked by another process
                # (it exited at once: a crash loop under a service manager; found by review).
                raise StoreUnreachable(
                    f"cannot open the SQLite store {where}: the disk holding it is full ({e}); free space"
                ) from None
            kind = StoreUnreachable if locked else StoreError  # locked: another process's, for now
            waited = (
                f" (another process kept it locked for {time.monotonic() - started:.1f} s, the busy"
                " timeout; the URL's busy_timeout=SECONDS sets it)"
                if locked
                else ""
            )
            raise kind(f"cannot open the SQLite store {where}: {_sqlite_why(path, e)}{waited}") from None
    if url.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresStore

        return PostgresStore(url, clock=clock, migrate=migrate, beside=beside)
    raise InputError(f"unsupported store URL {url[:80]!r}: expected sqlite:///PATH or postgresql://...")
