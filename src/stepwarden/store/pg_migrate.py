"""Bringing a PostgreSQL database's schema up to date: the missing migrations applied in one
transaction under an advisory lock that serialises them across processes, with progress reports
while another session holds it and a named holder when it is held too long. Kept apart from the
store because this is a different job from opening, retrying and committing the transitions'
transactions: it runs once when a store opens (or on ``init``), waits for other processes rather
than for rows, and its retry is the whole migration, which commits whole or not at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import MigrationError
from .pg_sessions import read_only_text
from .sql import pending_migrations, schema_version

try:
    import psycopg
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .postgres import PostgresStore

log = logging.getLogger("stepwarden.postgres")

# The advisory lock that serialises migrations across processes; how long a migration waits for
# another session's (ours take well under a second; longer means a stuck session, named in the
# error), how often it tries, and how often it says it is still waiting.
MIGRATION_LOCK = 7413000001
MIGRATION_LOCK_WAIT = 120.0
MIGRATION_LOCK_POLL = 0.25
MIGRATION_LOCK_REPORT = 10.0
MIGRATION_LOCK_FIRST_REPORT = 1.0


def migrate(
    store: PostgresStore, target: int | None = None, lock_wait: float | None = None, beside: bool = False
) -> int:
    """:meth:`PostgresStore.migrate` (its docstring is the contract): :func:`_migrate_once`, with
    ``lock_wait`` (:data:`MIGRATION_LOCK_WAIT` by default), retried with back-off when the
    connection was lost meanwhile (a worker starting while the server restarts) or a statement
    waited ``lock_timeout`` for a table lock: the migration transaction either committed whole or
    not at all. Any other error (a statement the server refused) is raised as it came."""
    wait = MIGRATION_LOCK_WAIT if lock_wait is None else lock_wait
    for delay in (0.5, 1.0, 2.0, 4.0, None):
        try:
            return _migrate_once(store, target, wait, beside)
        except psycopg.OperationalError as e:
            if delay is None or not _worth_again(e):
                raise
            why = str(e).strip()[:200]
            if getattr(e, "sqlstate", None) == "55P03":
                log.warning(
                    "a migration statement waited too long for a table lock (%s); retrying in %.1fs",
                    why,
                    delay,
                )
            else:
                log.warning("connection lost during the migration (%s); retrying in %.1fs", why, delay)
            time.sleep(delay)
            store.pool.check()
    raise AssertionError("unreachable")


def _worth_again(e: BaseException) -> bool:
    """A migration that failed this way may go through if run again: the connection was lost or
    never had (no SQLSTATE: the client's own failure, a pool's timeout), the server was shutting
    down or starting (08, 57P01-57P03), or a table lock waited lock_timeout (55P03). A statement
    the server stopped for another reason (a cancel, 57014) would only fail again, and was
    reported four times as a lost connection (found by review)."""
    state = getattr(e, "sqlstate", None)
    return state is None or state.startswith("08") or state in ("57P01", "57P02", "57P03", "55P03")


def _migrate_once(store: PostgresStore, target: int | None, lock_wait: float, beside: bool) -> int:
    """Take the migration lock without queueing behind it (``pg_try_advisory_xact_lock``, in
    a fresh transaction each try): a plain lock wait would end at ``lock_timeout`` with an
    error that reads like a failure, and would hold a transaction open meanwhile."""
    # The first report after a second of waiting, then every MIGRATION_LOCK_REPORT: processes
    # starting together wait for each other's migration, well under a second, and said so each.
    start = time.monotonic()
    said = start - MIGRATION_LOCK_REPORT + MIGRATION_LOCK_FIRST_REPORT
    deadline = start + lock_wait
    while True:
        with store.pool.connection() as conn, conn.transaction():
            store._begin(conn, clock=False)
            # A DBA's statement_timeout is for the applications' queries: a migration under a
            # 50 ms one was cut short, retried as a lost connection, and failed (found by review).
            # Its waits stay bounded by lock_timeout.
            conn.execute("SET LOCAL statement_timeout = 0")
            row: Any = conn.execute(
                "SELECT pg_try_advisory_xact_lock(%s) AS ok", (MIGRATION_LOCK,)
            ).fetchone()
            if row["ok"]:
                return _apply_migrations(conn, target, beside)
            holder = _migration_lock_holder(conn)
        now = time.monotonic()
        if now >= deadline:
            raise MigrationError(
                f"another session has held the migration lock for longer than {lock_wait:g} s"
                f" ({holder}); if it is stuck, end it with SELECT pg_terminate_backend(PID)"
                " and run init again"
            )
        if now - said >= MIGRATION_LOCK_REPORT:
            log.warning("waiting for another session's migration of this database (%s)", holder)
            said = now
        time.sleep(min(MIGRATION_LOCK_POLL, max(0.0, deadline - now)))


def _apply_migrations(conn: Any, target: int | None, beside: bool) -> int:
    """Nothing pending, nothing run: a role with no right to create in the schema (a worker's or
    an application's, the schema migrated by its owner with ``init``) opens an up-to-date store.
    PostgreSQL checks the schema's CREATE right even for ``CREATE TABLE IF NOT EXISTS`` of a
    table that exists, so that statement runs only when something is to be applied.

    A store to create where the search_path points, while another schema of the database holds
    one, is created only by ``init`` (``beside``): a search_path changed after the store was made
    (by a DBA, for the database or the role) had the next worker create an empty store in the new
    schema and run on it, the tasks of the old one left pending with nothing said (found by
    review). Two stores in one database, a schema each, are made on purpose, with ``init``."""
    version = schema_version("postgres", lambda q: [tuple(r.values()) for r in conn.execute(q).fetchall()])
    todo = pending_migrations("postgres", version, target)
    if not todo:
        return 0
    path = "?"  # the search_path, read where a store is to be created
    if version == 0:
        elsewhere = stores_elsewhere(lambda q: conn.execute(q).fetchall())
        path = elsewhere[0]
        if elsewhere[1] and not beside:
            raise MigrationError(elsewhere_text(elsewhere) + "; nothing was changed")
    try:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
            " name TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"
        )
        for version, name, statements in todo:
            for stmt in statements:
                conn.execute(stmt)
            conn.execute(
                "INSERT INTO schema_migrations VALUES (%s, %s, extract(epoch from now()))",
                (version, name),
            )
    except psycopg.errors.ReadOnlySqlTransaction as e:
        raise MigrationError(read_only_text("the database", e)) from None
    except psycopg.errors.InvalidSchemaName:
        raise MigrationError(
            f"this session's search_path ({path}) names no schema that exists, so there is nowhere"
            " to create the store: create the schema, or set the search_path (the database's or"
            " the role's setting, or options=-csearch_path%3DSCHEMA in the URL); nothing was changed"
        ) from None
    except psycopg.errors.InsufficientPrivilege as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MigrationError(
            f"the schema needs {len(todo)} migration(s) and this role may not apply them ({first}):"
            " run `stepwarden init` with a role that owns the schema, then start this again;"
            " nothing was changed"
        ) from None
    return len(todo)


# The schemas of the database, other than those the search_path reaches, that hold a stepwarden
# store: its table of migrations and the tables every version of it has.
_STORES_ELSEWHERE = """
SELECT n.nspname AS schema FROM pg_catalog.pg_namespace n
WHERE EXISTS (SELECT 1 FROM pg_catalog.pg_class c WHERE c.relnamespace = n.oid
                AND c.relname = 'schema_migrations' AND NOT pg_catalog.pg_table_is_visible(c.oid))
  AND (SELECT count(*) FROM pg_catalog.pg_class c WHERE c.relnamespace = n.oid
         AND c.relkind IN ('r', 'p') AND c.relname IN ('tasks', 'steps', 'requests', 'leases', 'workers')) = 5
ORDER BY 1"""


def stores_elsewhere(rows: Callable[[str], list[Any]]) -> tuple[str, list[str]]:
    """This session's search_path, and the schemas out of its reach that hold a store (none: []);
    ``rows`` runs a query and returns its rows as dicts."""
    path = rows("SELECT current_setting('search_path') AS p")[0]["p"]
    return str(path), [str(r["schema"]) for r in rows(_STORES_ELSEWHERE)]


def elsewhere_text(found: tuple[str, list[str]]) -> str:
    path, schemas = found
    return (
        f"this session's search_path ({path}) reaches no stepwarden store, but schema"
        f"{'s' if len(schemas) > 1 else ''} {', '.join(schemas)} of this database"
        f" hold{'' if len(schemas) > 1 else 's'} one: set the search_path back to reach it (the"
        f" database's or the role's setting, or options=-csearch_path%3D{schemas[0]} in the URL),"
        " or run `stepwarden init` to create another store where the search_path points"
    )


def _migration_lock_holder(conn: Any) -> str:
    """Who holds the migration lock, for the operator: the backend's pid, its application name,
    where from, and for how long (what a role may see of another role's session is less)."""
    row: Any = conn.execute(
        "SELECT a.pid, a.application_name AS app, host(a.client_addr) AS addr, a.state,"
        " extract(epoch FROM now() - a.xact_start)::float8 AS held"
        " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
        " AND l.classid::int8 * 4294967296 + l.objid::int8 = %s LIMIT 1",
        (MIGRATION_LOCK,),
    ).fetchone()
    if row is None or row["pid"] is None:
        return "held by a session this role cannot see"
    parts = [f"pid {row['pid']}"]
    if row["app"]:
        parts.append(f"application {row['app']!r}")
    if row["addr"]:
        parts.append(f"from {row['addr']}")
    if row["state"]:
        parts.append(str(row["state"]))
    if row["held"] is not None:
        parts.append(f"its transaction open {row['held']:.1f} s")
    return "held by " + ", ".join(parts)
