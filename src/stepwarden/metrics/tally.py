"""Event counts read incrementally from the store (:class:`EventTally`): totals by kind since the
store began, per-minute counts for the dashboard's throughput, and the replies new since the last
refresh. Each refresh reads only the rows added since the previous one."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..store import Tx

# Events whose counts per minute the dashboard draws (throughput) -- the finished states and arrivals.
PER_MINUTE = ("received", "processed", "error", "compensated", "cancelled")
# Seconds an event or reply must be old before its id range counts as settled. On PostgreSQL ids
# are taken before commit, so a row can become visible after a higher id; rows newer than this are
# read again on the next refresh (and counted once: their ids are remembered). SQLite commits in
# id order (one writer at a time), so it needs no lag.
PG_SETTLE_LAG = 5.0
BATCH = 20_000


def db_now(tx: Tx) -> float:
    row = tx.one("now")
    return float(row["now"]) if row else time.time()


class _Tail:
    """Reads rows of one append-only table by id, each once, tolerating late commits (see PG_SETTLE_LAG)."""

    def __init__(self, select: str, lag: float) -> None:
        self.select = select  # "SELECT ... WHERE x.id > ? ORDER BY x.id LIMIT ?", with columns id and at
        self.lag = lag
        self.horizon = 0  # every row with id <= horizon has been seen
        self.seen: set[int] = set()  # rows above the horizon already counted

    def read(self, tx: Tx, now: float) -> list[dict[str, Any]]:
        fresh: list[dict[str, Any]] = []
        after = self.horizon
        settled_to = self.horizon
        unsettled = False
        for _ in range(20):  # bounded work per refresh; the rest waits for the next one
            rows = tx.sql(self.select, (after, BATCH))
            for r in rows:
                rid = int(r["id"])
                if r["at"] is not None and float(r["at"]) <= now - self.lag and not unsettled:
                    settled_to = rid
                else:
                    unsettled = True
                if rid not in self.seen:
                    self.seen.add(rid)
                    fresh.append(r)
            if len(rows) < BATCH:
                break
            after = int(rows[-1]["id"])
        self.horizon = settled_to
        self.seen = {i for i in self.seen if i > settled_to}
        return fresh


@dataclass
class EventTally:
    """Totals of events by kind, per-minute counts, and new replies, read incrementally from a store."""

    dialect: str
    window_minutes: int = 15
    totals: Counter[str] = field(default_factory=Counter)
    minutes: dict[int, Counter[str]] = field(default_factory=dict)
    started: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        lag = PG_SETTLE_LAG if self.dialect == "postgres" else 0.0
        self.events = _Tail("SELECT id, kind, at FROM events WHERE id > ? ORDER BY id LIMIT ?", lag)
        self.replies = _Tail(
            "SELECT r.id, r.outcome, r.received_at AS at, q.agent, q.dispatched_at, q.taken_at "
            "FROM replies r JOIN requests q ON q.id = r.request_id WHERE r.id > ? ORDER BY r.id LIMIT ?",
            lag,
        )

    def _start(self, tx: Tx, now: float) -> None:
        """Totals up to now with one GROUP BY; per-minute counts of the window; replies from now on."""
        horizon = _first_id_at_or_after(tx, "events", now - self.events.lag) - 1
        for r in tx.sql("SELECT kind, COUNT(*) AS n FROM events WHERE id <= ? GROUP BY kind", (horizon,)):
            self.totals[r["kind"]] += int(r["n"])
        low = _first_id_at_or_after(tx, "events", now - 60 * self.window_minutes)
        marks = ", ".join("?" for _ in PER_MINUTE)
        for r in tx.sql(
            f"SELECT kind, at FROM events WHERE id >= ? AND id <= ? AND kind IN ({marks})",
            (low, horizon, *PER_MINUTE),
        ):
            self.minutes.setdefault(int(float(r["at"]) // 60), Counter())[r["kind"]] += 1
        self.events.horizon = horizon
        self.replies.horizon = _first_id_at_or_after(tx, "replies", now - self.replies.lag, "received_at") - 1
        self.started = True

    def refresh(self, tx: Tx) -> list[dict[str, Any]]:
        """Read what is new; returns the new replies (for the latency histograms)."""
        with self.lock:
            now = db_now(tx)
            if not self.started:
                self._start(tx, now)
            for r in self.events.read(tx, now):
                self.totals[r["kind"]] += 1
                if r["kind"] in PER_MINUTE:
                    self.minutes.setdefault(int(float(r["at"]) // 60), Counter())[r["kind"]] += 1
            oldest = int(now // 60) - 2 * self.window_minutes
            for m in [m for m in self.minutes if m < oldest]:
                del self.minutes[m]
            return self.replies.read(tx, now)

    def per_minute(self, now: float, kind: str = "processed") -> list[tuple[int, int]]:
        """``[(minute_start_epoch, count), ...]``: the last ``window_minutes`` minutes, the current last."""
        current = int(now // 60)
        with self.lock:
            return [
                (m * 60, self.minutes.get(m, Counter())[kind])
                for m in range(current - self.window_minutes + 1, current + 1)
            ]


def _first_id_at_or_after(tx: Tx, table: str, t: float, col: str = "at") -> int:
    """The first id whose time is at or after ``t`` (ids rise with time), by binary search on the
    primary key: a few indexed lookups instead of a scan. One past the last id if none is."""
    sql = f"SELECT id, {col} AS at FROM {table} WHERE id >= ? ORDER BY id LIMIT 1"  # table/col are ours
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
