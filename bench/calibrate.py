"""Two probes of the machine itself, taken at the start of every run, so that runs on different
machines (or on one machine in a fast and a slow spell) can be told apart by more than the CPU's
name: how fast this Python runs plain code, and how long one durable SQLite commit takes.

Round s39 in docs/performance.md is why: the reference machine changed from an AMD EPYC to an
Intel Xeon on which the same Python code spent two to three times the CPU per task while the
fsync got faster, and stepwarden's ratio to Huey halved with no change to the code; nothing had
recorded the interpreter's speed on the first. Neither probe says anything about stepwarden.
"""

from __future__ import annotations

import sqlite3
import statistics
import time
from pathlib import Path
from typing import Any

LOOP = 2_000_000  # additions in the Python probe (~0.1-0.3 s)
COMMITS = 200  # one-row commits in the SQLite probe


def python_loop_s(n: int = LOOP) -> float:
    """Seconds for ``n`` additions in a plain loop: the interpreter's speed on this CPU now."""
    started = time.perf_counter()
    total = 0
    for i in range(n):
        total += i
    elapsed = time.perf_counter() - started
    assert total == n * (n - 1) // 2
    return elapsed


def sqlite_commit_us(folder: Path, n: int = COMMITS) -> float:
    """Median microseconds of a one-row ``INSERT`` committed on its own, in WAL mode with
    ``synchronous=FULL`` (stepwarden's default): mostly the fsync of this disk."""
    path = folder / "calibrate.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
        times = []
        for _ in range(n):
            started = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO t (v) VALUES ('x')")
            conn.execute("COMMIT")
            times.append(time.perf_counter() - started)
    finally:
        conn.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
    return statistics.median(times) * 1e6


def probe(folder: Path) -> dict[str, Any]:
    """Both probes, for the run's ``machine`` record."""
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "python_loop_s": round(python_loop_s(), 3),
        "sqlite_commit_us": round(sqlite_commit_us(folder), 1),
    }


def line(m: dict[str, Any]) -> str | None:
    """The Markdown line for the machine section; None for a run recorded without the probes."""
    if "python_loop_s" not in m:
        return None
    return (
        f"- calibration at the start: a plain Python loop of {LOOP:,} additions took"
        f" {m['python_loop_s']} s; a one-row SQLite commit (WAL, synchronous=FULL) {m['sqlite_commit_us']} µs"
        f" (median of {COMMITS})"
    )
