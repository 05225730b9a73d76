"""Where SQLite's write lock goes, query by query, in one W1 or W2 run: what ``statements.py`` is
for PostgreSQL.

    .venv/bin/python bench/sqlite_queries.py [--workload w2] [--tasks 3000]

Runs the harness's own W1 (or W2) once on a fresh SQLite file, with every named query, every batch
of deferred or kept writes and every transaction of the submitting process and of the worker
timed where it runs (on SQLite the statements run in the process that sends them, inside its
``BEGIN IMMEDIATE``, so their time is the time they hold the file's one write lock). Prints, per
process, microseconds per task for each; a transaction's line also says how much of it was its
statements, and the rest is its ``COMMIT`` (the fsync) and the Python between the statements.
The throughput it prints is one noisy run, slowed a little by the timing itself: use
``bench/run.py`` for figures; this is for deciding which query to make cheaper (docs/performance.md,
round s46).

The worker is the harness's usual ``stepwarden worker`` process, given this module as its app
(``--app sqlite_queries:app``, the bench app with the timers installed when ``TIMES_ENV`` names a
file to write at exit).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchapp import app

__all__ = ["app"]

TIMES_ENV = "STEPWARDEN_BENCH_QUERY_TIMES"  # a file path: this process's times are written there


class Times:
    """Seconds, calls and rows per key, and per thread the statements' time of the transaction
    running on it (the worker runs transactions on the event loop's thread and on the store's
    threads, at times at once)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        self.lock = threading.Lock()
        self.local = threading.local()  # .within: this thread's transaction's statements so far

    def add(self, key: str, seconds: float, rows: int = 0) -> None:
        with self.lock:
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds
            self.calls[key] = self.calls.get(key, 0) + 1
            self.rows[key] = self.rows.get(key, 0) + rows

    def statement(self, key: str, seconds: float, rows: int = 0) -> None:
        self.add(key, seconds, rows)
        if getattr(self.local, "within", None) is not None:
            self.local.within += seconds

    def dump(self, path: str) -> None:
        with self.lock:
            keys = sorted(self.seconds, key=lambda k: -self.seconds[k])
            data = [
                {"key": k, "calls": self.calls[k], "rows": self.rows[k], "s": self.seconds[k]} for k in keys
            ]
        Path(path).write_text(json.dumps(data) + "\n")


def install(times: Times) -> None:
    """Wrap the SQLite store's transaction and its ``SqliteTx`` methods with timers: each read or
    write sent at once, each query's batch of deferred or kept writes (``SqliteTx._many``), each
    transaction. A read first runs the deferred writes, outside its own timer, so that no write is
    counted twice."""
    from stepwarden.store import sqlite as store_mod
    from stepwarden.store import sqlite_tx
    from stepwarden.store.base import DEFERRED

    tx_cls: Any = sqlite_tx.SqliteTx
    if getattr(tx_cls, "bench_times", None) is not None:
        return  # once per process
    tx_cls.bench_times = times

    def statement(method: Callable[..., Any], prefix: str = "") -> Callable[..., Any]:
        def timed(self: Any, query: str, /, *args: Any, **params: Any) -> Any:
            if self.deferred:
                self._run_deferred()  # timed query by query, not as a part of this one
            started = time.perf_counter()
            try:
                return method(self, query, *args, **params)
            finally:
                key = prefix + (query if not prefix else " ".join(query.split())[:60])
                times.statement(key, time.perf_counter() - started)

        return timed

    for name in ("one", "all", "run"):
        setattr(tx_cls, name, statement(getattr(tx_cls, name)))
    tx_cls.sql = statement(tx_cls.sql, prefix="sql: ")
    put = tx_cls.put
    timed_put = statement(put)

    def put_timed(self: Any, query: str, /, **params: Any) -> None:  # a deferred one runs later
        (put if query in DEFERRED else timed_put)(self, query, **params)

    tx_cls.put = put_timed

    many = tx_cls._many

    def many_timed(self: Any, query: str, rows: list[dict[str, Any]]) -> None:
        started = time.perf_counter()
        try:
            many(self, query, rows)
        finally:
            kind = "deferred" if query in DEFERRED else "kept"
            times.statement(f"{kind} {query}", time.perf_counter() - started, len(rows))

    tx_cls._many = many_timed
    run = store_mod.SQLiteStore._run

    def transaction(self: Any, conn: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        outer = getattr(times.local, "within", None)
        times.local.within = 0.0
        started = time.perf_counter()
        try:
            return run(self, conn, fn, *args, **kwargs)
        finally:
            name = getattr(fn, "__name__", "?")
            times.add(f"TX {name}", time.perf_counter() - started)
            times.add(f"TX {name} statements", times.local.within)
            times.local.within = outer

    store_mod.SQLiteStore._run = transaction  # type: ignore[method-assign]


def _install_from_env() -> None:
    """In the worker, which imports this module as its app: the timers, written at exit."""
    from stepwarden.store import sqlite_tx

    path = os.environ.get(TIMES_ENV)
    if path and __name__ != "__main__" and getattr(sqlite_tx.SqliteTx, "bench_times", None) is None:
        times = Times()
        install(times)
        atexit.register(times.dump, path)


_install_from_env()


SHOWN_US = 0.5  # a line under this many microseconds per task is left out of the table


def report(path: Path, tasks: int, title: str) -> list[str]:
    """Lines of one process's table: microseconds per task, the most first."""
    rows = json.loads(path.read_text())
    spent = {r["key"]: r for r in rows}
    lines = [f"{title}:", f"{'calls':>7} {'rows':>7} {'us/task':>8}  {'of it in statements':>19}  what"]
    for r in rows:
        key = r["key"]
        if key.endswith(" statements") or r["s"] * 1e6 / tasks < SHOWN_US:
            continue
        inner = spent.get(key + " statements")
        share = f"{inner['s'] * 1e6 / tasks:>19.1f}" if inner else " " * 19
        rows_txt = str(r["rows"]) if r["rows"] else ""
        lines.append(f"{r['calls']:>7} {rows_txt:>7} {r['s'] * 1e6 / tasks:>8.1f}  {share}  {key}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("w1", "w2"), default="w1")
    ap.add_argument("--tasks", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", dest="json_out", default=None, help="also write the times to this file")
    a = ap.parse_args()
    import run as harness  # the harness: imported here, not by the worker that imports this module

    work = Path(tempfile.mkdtemp(prefix="stepwarden-sqlite-queries-"))
    submitter, worker = work / "times-submitter.json", work / "times-worker.json"
    os.environ[TIMES_ENV] = str(worker)  # the worker's environment is copied from this process's
    times = Times()
    install(times)
    dbs = harness.Databases(work, None, need_pg=False)
    try:
        out = harness.stepwarden_throughput(
            dbs, "sqlite", a.workload, a.tasks, 1, a.concurrency, app_module="sqlite_queries"
        )
        times.dump(str(submitter))  # the worker wrote its own when it stopped
        if not worker.exists():
            logs = sorted(work.glob("*/worker-*.log"))
            tail = logs[0].read_text(errors="replace").splitlines()[-5:] if logs else []
            sys.exit("\n".join(["error: the worker wrote no times; the end of its log:", *tail]))
        lines = [f"{a.workload}: {out['rate']} tasks/s, {out['submit_rate']} submit calls/s (one run)", ""]
        lines += report(submitter, a.tasks, "the submitting process (the warm-up's tasks included)")
        lines += ["", *report(worker, a.tasks, "the worker (its start, its stop and the warm-up included)")]
        lines += [
            "",
            f"(lines under {SHOWN_US} us per task left out; TX: a whole transaction, BEGIN to COMMIT)",
        ]
        print("\n".join(lines))
        if a.json_out:
            doc = {
                "run": out,
                "submitter": json.loads(submitter.read_text()),
                "worker": json.loads(worker.read_text()),
            }
            Path(a.json_out).write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
