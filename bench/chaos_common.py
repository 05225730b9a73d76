"""The chaos harness's shared pieces: its options, constants, small helpers, and plain reads of the
store (``Reader``). See ``chaos.py`` for the harness and ``CHAOS.md`` for what it reports."""

from __future__ import annotations

import contextlib
import math
import sqlite3
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

WORKFLOW = "process-order"
LEASE_NAME = "supervisor"
FINAL = ("processed", "error", "compensated", "cancelled")
FAULT_GROUPS = ("kill", "stop", "term", "proxy", "restart", "services")
ALL_ROLES = "scheduler,agent,supervisor"
LEADER_FAULTS = ("kill_leader", "stop_leader", "term_leader")
DB_FAULTS = ("proxy_reset", "proxy_stall", "pg_restart")
# How often each fault kind is drawn once every enabled kind has been injected at least once.
WEIGHTS = {
    "kill": 2.0,
    "kill_leader": 2.5,
    "stop_leader": 2.0,
    "stop_worker": 1.2,
    "term_leader": 1.2,
    "proxy_reset": 1.0,
    "proxy_stall": 1.0,
    "pg_restart": 0.4,
}


# -- options --------------------------------------------------------------------------------------


@dataclass
class Options:
    store: str = "sqlite"
    db: str | None = None
    workers: int = 5
    duration: float = 60.0  # the injection window, seconds
    tasks: int | None = None  # orders to submit (at most), spread over the window
    rate: float | None = None  # orders per second (default: tasks / duration, else 8)
    seed: int = 1
    faults: tuple[str, ...] = FAULT_GROUPS
    fault_every: float = 4.0  # mean seconds between injected faults
    settle: float = 120.0  # bounded wait for every task to end after the window
    json_path: str | None = None
    workdir: str | None = None
    keep: bool = False
    transient_rate: float = 0.08
    hang_rate: float = 0.02
    permanent_rate: float = 0.02
    hang_seconds: float | None = None  # default: past the longest complete-by, max(5, complete-by + 1)
    # The workers' record retention, seconds (``stepwarden worker --retention``): None keeps the
    # default (7 days: nothing is pruned during a run); a few seconds makes the leader prune the
    # run's finished tasks while it runs, and while leaders are killed.
    retention: float | None = None
    operator_every: float = 0.0  # mean seconds between operator actions (task cancel / retry); 0: none
    quiet: bool = False
    note: str = ""

    def order_plan(self) -> tuple[int, float]:
        """(orders, rate): bounded in count and in time (all submitted within the window)."""
        if self.rate is not None:
            rate = self.rate
            total = self.tasks if self.tasks is not None else max(1, int(rate * self.duration))
        elif self.tasks is not None:
            total = self.tasks
            rate = total / self.duration
        else:
            rate = 8.0
            total = max(1, int(rate * self.duration))
        return total, rate


# -- small helpers -------------------------------------------------------------------------------


def now() -> float:
    """The wall clock: the database clock of SQLite, and of a PostgreSQL server on this host."""
    return time.time()


def pct(xs: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))]


def stats(xs: Sequence[float]) -> dict[str, Any]:
    r3: Callable[[float | None], float | None] = lambda v: None if v is None else round(v, 3)  # noqa: E731
    return {
        "n": len(xs),
        "p50": r3(pct(xs, 50)),
        "p99": r3(pct(xs, 99)),
        "max": r3(max(xs) if xs else None),
        "mean": r3(sum(xs) / len(xs) if xs else None),
    }


def log_line(o: Options, text: str) -> None:
    if not o.quiet:
        print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def pid_of(identity: str | None) -> int | None:
    parts = str(identity or "").split(":")
    return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None


def with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, _, _ = netloc.rpartition("@")
    host = parts.hostname or "127.0.0.1"
    return urlunsplit(parts._replace(netloc=(userinfo + "@" if userinfo else "") + f"{host}:{port}"))


def is_loopback(host: str | None) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


# -- reading the store ----------------------------------------------------------------------------


class Reader:
    """Plain reads for the harness, straight to the database (never through the proxy).

    SQLite: an autocommit connection (WAL readers never wait for writers). PostgreSQL: one
    autocommit connection, reopened after a failure, with a short connect timeout so a restarting
    server never blocks the harness for long. Queries use ``?`` placeholders on both."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sqlite_path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else None
        self._conn: Any = None

    def _connect(self) -> Any:
        if self.sqlite_path is not None:
            conn = sqlite3.connect(self.sqlite_path, timeout=30, isolation_level=None)
            conn.row_factory = lambda cur, row: {d[0]: v for d, v in zip(cur.description, row, strict=True)}
            return conn
        import psycopg
        from psycopg.rows import dict_row

        from stepwarden.store.postgres import parse_url

        conninfo, _ = parse_url(self.url)
        return psycopg.connect(conninfo, autocommit=True, connect_timeout=3, row_factory=dict_row)

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        if self._conn is None:
            self._conn = self._connect()
        try:
            if self.sqlite_path is not None:
                return list(self._conn.execute(sql, tuple(params)).fetchall())
            return list(self._conn.execute(sql.replace("?", "%s"), tuple(params) or None).fetchall())
        except Exception:
            self.close()
            raise

    def try_rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]] | None:
        """The rows, or None if the database cannot answer (tried twice: a restart breaks the first)."""
        for _ in range(2):
            try:
                return self.rows(sql, params)
            except Exception:
                continue
        return None

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def write_lock_free(self, timeout: float = 0.5) -> bool:
        """SQLite only: can a writer take the lock now? (PostgreSQL has no store-wide lock.)"""
        if self.sqlite_path is None:
            return True
        conn = sqlite3.connect(self.sqlite_path, timeout=timeout, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            conn.close()


def pruned_total(reader: Reader) -> int:
    """How many events the leader's prunes have deleted in all, as they count them (``event_totals``,
    written by the deleting transaction)."""
    return int(reader.rows("SELECT COALESCE(SUM(pruned), 0) AS n FROM event_totals")[0]["n"])


def read_lease(reader: Reader) -> tuple[bool, dict[str, Any] | None]:
    """(answered, the supervisor lease row or None): a failed read is not "no leader"."""
    rows = reader.try_rows("SELECT holder, term, expires_at FROM leases WHERE name = ?", (LEASE_NAME,))
    if rows is None:
        return False, None
    return True, (rows[0] if rows and rows[0]["holder"] is not None else None)


def leader_row(reader: Reader) -> dict[str, Any] | None:
    """The lease row if it is held now (not expired), else None."""
    _, row = read_lease(reader)
    if row is None or float(row["expires_at"]) <= now():
        return None
    return row


# The task states that never change again, and the only ones the leader's prune deletes (``error``
# waits for an operator and is kept): a task seen in one of them has its outcome known for good.
TERMINAL = ("processed", "compensated", "cancelled")
