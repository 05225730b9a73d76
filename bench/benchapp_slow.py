"""W3's application: one step that takes 200 ms and records each execution in a SQLite file of its
own (the "remote service's" ledger), so a benchmark can count lost and duplicated executions.

Configured by the environment, read at import (the worker and the submitter import it alike):
``STEPWARDEN_BENCH_LEDGER`` (the ledger file, made first by :func:`prepare_ledger`: the
operation only inserts into it), ``STEPWARDEN_BENCH_SLOW_SECONDS`` (0.2),
``STEPWARDEN_BENCH_SLOW_BUDGET`` (the step's complete-by in seconds, 30).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from typing import Any

from stepwarden import App, Request, Step

LEDGER = os.environ.get("STEPWARDEN_BENCH_LEDGER", "")
SECONDS = float(os.environ.get("STEPWARDEN_BENCH_SLOW_SECONDS", "0.2"))
BUDGET = float(os.environ.get("STEPWARDEN_BENCH_SLOW_BUDGET", "30"))
LEDGER_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS executions (id INTEGER PRIMARY KEY, key TEXT NOT NULL,"
    " task_id INTEGER NOT NULL,"
    " attempt INTEGER NOT NULL, phase TEXT NOT NULL, pid INTEGER NOT NULL, at REAL NOT NULL)"
)

app = App()
slow = app.agent("slow", concurrency=8)


def prepare_ledger(path: str) -> None:
    """Create the ledger, in WAL mode, before any worker runs. Not in :func:`record`: the switch to
    WAL takes an exclusive lock that SQLite may refuse at once ("database is locked", without
    waiting out the busy timeout) to connections opening a new file together, as a worker's 8 slots
    do. In W3 that made a task's first execution fail and the task end in ``error`` (one repetition
    of round s24); 8 threads opening fresh files together: 5 failures in 1,600."""
    conn = sqlite3.connect(path, timeout=30, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")  # kept by the file: every later connection uses it
        conn.execute(LEDGER_SCHEMA)
    finally:
        conn.close()


def record(phase: str, req: Request) -> None:
    """One committed row per phase ("start", "done") in the ledger :func:`prepare_ledger` made; WAL,
    so a SIGKILLed process loses nothing committed."""
    if not LEDGER:
        return
    conn = sqlite3.connect(LEDGER, timeout=30, isolation_level=None)
    try:
        conn.execute(
            "INSERT INTO executions (key, task_id, attempt, phase, pid, at) VALUES (?, ?, ?, ?, ?, ?)",
            (req.idempotency_key, req.task_id, req.attempt, phase, os.getpid(), time.time()),
        )
    finally:
        conn.close()


@slow.operation
async def work(req: Request) -> Any:
    await asyncio.to_thread(record, "start", req)
    await asyncio.sleep(SECONDS)
    await asyncio.to_thread(record, "done", req)
    return None


app.workflow("slow", [Step("a", "slow.work", complete_by=BUDGET)])
