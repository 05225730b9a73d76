"""Incremental event counts: totals by kind (the store's counters), per-minute counts for the
dashboard's throughput, and the replies new since the last refresh. Each refresh reads only the
rows added since the previous one, and counts each row exactly once, however late it commits.

**When is a range of rows settled?** The reader walks the append-only ``events`` and ``replies``
tables and must never pass a row that may still appear behind it:

- SQLite commits one writer at a time, and its ``AUTOINCREMENT`` ids are never reused: a row
  appears in id order, so every id up to the highest one read is settled (:class:`_IdTail`).
- PostgreSQL gives a row its id when it is inserted, and the row appears when its transaction
  commits, which may be any time later: a caller's ``app.transaction()`` block that stays open, a
  worker's transaction waiting out ``lock_timeout``. Ids say nothing about what may still appear
  below them. The reader used to treat ids as settled once a later row was 5 seconds old; a
  transaction that committed later than that was skipped for good. So each row records the
  transaction that wrote it (``xact_id``, ``pg_current_xact_id()``, migration 0007), and the reader
  takes its snapshot's ``xmin`` (``pg_snapshot_xmin(pg_current_snapshot())``): the oldest
  transaction still running. Every transaction below it has committed or rolled back, so the rows
  whose ``xact_id`` is below it are final, visible now or never. The reader walks the final rows
  once, in ``(xact_id, id)`` order (an index), and moves its cursor to ``xmin`` (:class:`_XactTail`).
  Rows above ``xmin`` that are already visible have committed: they are counted at once, and their
  ids kept until the cursor passes them, so a long transaction delays no one else's counts.

Why not a longer lag, or re-reading gaps in the ids for a while: both guess how long a transaction
may stay open, and lose its rows when it stays longer; gaps also come from rollbacks and sequence
caches and need never fill. Visibility by transaction is exact and costs one ``BIGINT`` column and
one index per table (appended at its right edge, as transaction ids rise). The one price: while a
write transaction stays open (an idle-in-transaction session, on any database of the server, since
transaction ids are the server's), the reader remembers the ids of the rows committed after it,
:data:`SEEN_MAX` at most: beyond those, counts wait for that transaction to end, and are then exact.

**Totals survive a prune.** The leader's prune deletes old events; it adds what it deletes, by kind,
to ``event_totals`` in the same transaction. A reader starts from ``event_totals`` plus the events
stored, in one statement, so a dashboard restarted after a prune reports the same totals as before,
never lower (Prometheus would take a lower total for a counter reset). A reader that is running
has counted the pruned events already, as it read them; one exception: events pruned before the
running reader read them (a retention shorter than the scrape interval) are counted from the next
restart on, which raises the counter, never lowers it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..store import Tx

# Events whose counts per minute the dashboard draws (throughput) -- the finished states and arrivals.
PER_MINUTE = ("received", "processed", "error", "compensated", "cancelled")
BATCH = 20_000  # rows per read
ROUNDS = 20  # reads per refresh at most: bounded work; the rest waits for the next refresh
# PostgreSQL: rows committed above the oldest running transaction that are remembered as counted,
# at most (about 10 MB). While one write transaction stays open, the rows committed after it are
# counted at once up to this many; the rest when it ends.
SEEN_MAX = 100_000

EVENT_COLUMNS = "x.id, x.kind, x.at"
REPLY_COLUMNS = "x.id, x.outcome, x.received_at AS at, q.agent, q.dispatched_at, q.taken_at"
REPLY_JOIN = "replies x JOIN requests q ON q.id = x.request_id"


def db_now(tx: Tx) -> float:
    row = tx.one("now")
    return float(row["now"]) if row else time.time()


class _Tail(Protocol):
    def read(self, tx: Tx) -> list[dict[str, Any]]:
        """The rows not read before, each once; bounded work (the rest at the next call)."""
        ...

    def settle(self, tx: Tx) -> tuple[str, tuple[Any, ...]]:
        """Start after the rows final now: the condition (on the table's own columns) and its
        parameters that select them, for a reader to count them in one statement."""
        ...

    def skip(self, tx: Tx) -> None:
        """Start after every row stored now (replies are observed from the start on)."""
        ...


class _IdTail:
    """Reads rows of one append-only SQLite table by id, each once: ids appear in commit order."""

    def __init__(self, table: str, columns: str, source: str) -> None:
        self.select = f"SELECT {columns} FROM {source} WHERE x.id > ? ORDER BY x.id LIMIT ?"
        self.table = table  # the table read (``source`` names it as x, perhaps with a join)
        self.horizon = 0  # every row with id <= horizon has been read

    def read(self, tx: Tx) -> list[dict[str, Any]]:
        fresh: list[dict[str, Any]] = []
        for _ in range(ROUNDS):
            rows = tx.sql(self.select, (self.horizon, BATCH))
            fresh.extend(rows)
            if rows:
                self.horizon = int(rows[-1]["id"])
            if len(rows) < BATCH:
                break
        return fresh

    def settle(self, tx: Tx) -> tuple[str, tuple[Any, ...]]:
        self.horizon = int(tx.sql(f"SELECT COALESCE(MAX(id), 0) AS m FROM {self.table}")[0]["m"])
        return "id <= ?", (self.horizon,)

    def skip(self, tx: Tx) -> None:
        self.settle(tx)


class _XactTail:
    """Reads rows of one append-only PostgreSQL table each once, by the transaction that wrote them
    (see the module's docstring): the final rows in ``(xact_id, id)`` order behind a cursor, and
    the committed rows above it at once, remembered until the cursor passes them."""

    def __init__(self, table: str, columns: str, source: str) -> None:
        self.final = (
            f"SELECT x.xact_id, {columns} FROM {source} WHERE (x.xact_id, x.id) > (?, ?) AND x.xact_id < ? "
            "ORDER BY x.xact_id, x.id LIMIT ?"
        )
        self.above = (
            f"SELECT x.xact_id, {columns} FROM {source} WHERE (x.xact_id, x.id) > (?, ?) "
            "ORDER BY x.xact_id, x.id LIMIT ?"
        )
        # What skip() records: the ids alone, of the table alone (no join, no columns to carry).
        self.above_ids = (
            f"SELECT xact_id, id FROM {table} WHERE (xact_id, id) > (?, ?) ORDER BY xact_id, id LIMIT ?"
        )
        self.cursor = (0, 0)  # (xact_id, id): every final row at or below it has been read
        self.seen: dict[int, int] = {}  # id -> xact_id of the rows above the cursor already read

    def read(self, tx: Tx) -> list[dict[str, Any]]:
        xmin = snapshot_xmin(tx)
        fresh: list[dict[str, Any]] = []
        after = self.cursor
        for _ in range(ROUNDS):
            rows = tx.sql(self.final, (*after, xmin, BATCH))
            fresh.extend(r for r in rows if int(r["id"]) not in self.seen)
            if len(rows) < BATCH:
                after = (xmin, 0)  # every final row read: the cursor moves to the oldest running
                break
            after = (int(rows[-1]["xact_id"]), int(rows[-1]["id"]))
        self.cursor = after
        self.seen = {i: x for i, x in self.seen.items() if (x, i) > after}
        if after[0] == xmin and len(self.seen) < SEEN_MAX:
            # The backlog is read: now the rows committed above the cursor, from past the last
            # one read (one below it that commits later is read when the cursor passes it).
            top = max(((x, i) for i, x in self.seen.items()), default=after)
            for r in tx.sql(self.above, (*top, min(BATCH, SEEN_MAX - len(self.seen)))):
                rid = int(r["id"])
                if rid not in self.seen:
                    self.seen[rid] = int(r["xact_id"])
                    fresh.append(r)
        return fresh

    def settle(self, tx: Tx) -> tuple[str, tuple[Any, ...]]:
        xmin = snapshot_xmin(tx)
        self.cursor = (xmin, 0)  # the rows above it are read (and counted) by the next read
        return "(xact_id IS NULL OR xact_id < ?)", (xmin,)  # NULL: written before migration 0007

    def skip(self, tx: Tx) -> None:
        self.settle(tx)
        for r in tx.sql(self.above_ids, (*self.cursor, SEEN_MAX)):  # committed already: as good as read
            self.seen[int(r["id"])] = int(r["xact_id"])


def snapshot_xmin(tx: Tx) -> int:
    """The oldest transaction still running as of this statement's snapshot: every one below it
    has ended. It never goes back (new transaction ids are always higher than the running ones)."""
    row = tx.sql("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin")[0]
    return int(row["xmin"])


@dataclass
class EventTally:
    """Totals of events by kind, per-minute counts, and new replies, read incrementally from a store."""

    dialect: str
    window_minutes: int = 15
    totals: Counter[str] = field(default_factory=Counter)
    minutes: dict[int, Counter[str]] = field(default_factory=dict)
    started: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    copies: int = 0  # copies of ``totals`` taken for snapshots, numbered under ``lock``

    def __post_init__(self) -> None:
        tail = _XactTail if self.dialect == "postgres" else _IdTail
        self.events: _Tail = tail("events", EVENT_COLUMNS, "events x")
        self.replies: _Tail = tail("replies", REPLY_COLUMNS, REPLY_JOIN)

    def _start(self, tx: Tx, now: float) -> None:
        """Totals up to now with one GROUP BY (plus what prunes deleted, in the same statement, so
        a prune committing meanwhile is counted once); per-minute counts of the window; replies
        from now on."""
        low = _first_id_at_or_after(tx, "events", now - 60 * self.window_minutes)
        final, params = self.events.settle(tx)
        for r in tx.sql(
            "SELECT kind, SUM(n) AS n FROM (SELECT kind, pruned AS n FROM event_totals UNION ALL "
            f"SELECT kind, COUNT(*) AS n FROM events WHERE {final} GROUP BY kind) t GROUP BY kind",
            params,
        ):
            self.totals[r["kind"]] += int(r["n"])
        marks = ", ".join("?" for _ in PER_MINUTE)
        for r in tx.sql(
            f"SELECT kind, at FROM events WHERE id >= ? AND {final} AND kind IN ({marks})",
            (low, *params, *PER_MINUTE),
        ):
            self.minutes.setdefault(int(float(r["at"]) // 60), Counter())[r["kind"]] += 1
        self.replies.skip(tx)
        self.started = True

    def refresh(self, tx: Tx) -> list[dict[str, Any]]:
        """Read what is new; returns the new replies (for the latency histograms)."""
        with self.lock:
            now = db_now(tx)
            if not self.started:
                self._start(tx, now)
            for r in self.events.read(tx):
                self.totals[r["kind"]] += 1
                if r["kind"] in PER_MINUTE:
                    self.minutes.setdefault(int(float(r["at"]) // 60), Counter())[r["kind"]] += 1
            oldest = int(now // 60) - 2 * self.window_minutes
            for m in [m for m in self.minutes if m < oldest]:
                del self.minutes[m]
            return self.replies.read(tx)

    def per_minute(self, now: float, kind: str = "processed") -> list[tuple[int, int]]:
        """``[(minute_start_epoch, count), ...]``: the last ``window_minutes`` minutes, the current last."""
        current = int(now // 60)
        with self.lock:
            return [
                (m * 60, self.minutes.get(m, Counter())[kind])
                for m in range(current - self.window_minutes + 1, current + 1)
            ]


def _first_id_at_or_after(tx: Tx, table: str, t: float) -> int:
    """The first id whose time is at or after ``t`` (ids rise with time), by binary search on the
    primary key: a few indexed lookups instead of a scan. One past the last id if none is."""
    sql = f"SELECT id, at FROM {table} WHERE id >= ? ORDER BY id LIMIT 1"  # table is ours
    top = tx.sql(f"SELECT COALESCE(MAX(id), 0) AS m FROM {table}")[0]["m"]
    lo, hi = 1, int(top) + 1  # answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        rows = tx.sql(sql, (mid,))
        if not rows:
            hi = mid
            continue
        rid, at = int(rows[0]["id"]), float(rows[0]["at"])
        if at >= t:
            hi = min(mid, rid)
        else:
            lo = rid + 1
    return lo
