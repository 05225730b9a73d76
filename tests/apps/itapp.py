"""The integration tests' application: one agent whose operations log every execution.

Each execution is written to its own SQLite file (path from ``ITAPP_LOG``), committed when it
starts and again when it ends, so a test can count executions and effects without trusting the
store it is testing. A worker killed mid-step leaves a start row without an end.

Operations read their behaviour from the task input:

- ``sleep``: ``{"ATTEMPT": SECONDS}``, how long attempt ATTEMPT of a blocking operation takes
  (missing attempts take no time). ``block`` sleeps asynchronously (the agent can cancel it at
  complete-by); ``block_sync`` is a plain function (it cannot be interrupted).
- ``fail_transient`` always raises :class:`Transient`; ``fail_permanent`` raises :class:`Permanent`
  (both of agent ``down``; everything else is agent ``it``).
- ``undo`` is the compensation; it logs the result of the step it undoes (``req.undo``).

Workers import it with ``PYTHONPATH=tests/apps stepwarden worker --app itapp:app``; tests build
their own copy against their store with :func:`make_app`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
import time
from typing import Any

from stepwarden import App, Backoff, Permanent, Request, Retry, Step, Transient

LOG_ENV = "ITAPP_LOG"

SCHEMA = """
CREATE TABLE IF NOT EXISTS executions (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id    INTEGER NOT NULL,
    step       TEXT NOT NULL,
    attempt    INTEGER NOT NULL,
    kind       TEXT NOT NULL,
    op         TEXT NOT NULL,
    key        TEXT NOT NULL,
    pid        INTEGER NOT NULL,
    started_at REAL NOT NULL,
    ended_at   REAL,
    outcome    TEXT,
    detail     TEXT
)
"""

_local = threading.local()


def connect_log(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode survives the death of the process (kill -9); only power loss could lose
    # the last commits, and the tests do not pull the plug.
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(SCHEMA)
    return conn


def _log() -> sqlite3.Connection:
    conn = getattr(_local, "conn", None)
    if conn is None:
        path = os.environ.get(LOG_ENV)
        if not path:
            raise RuntimeError(f"set {LOG_ENV} to the path of the execution log")
        conn = _local.conn = connect_log(path)
    return conn


def _start(req: Request, op: str) -> int:
    cur = _log().execute(
        "INSERT INTO executions (task_id, step, attempt, kind, op, key, pid, started_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (req.task_id, req.step, req.attempt, req.kind, op, req.idempotency_key, os.getpid(), time.time()),
    )
    return int(cur.lastrowid or 0)


def _end(row: int, outcome: str, detail: Any = None) -> None:
    _log().execute(
        "UPDATE executions SET ended_at = ?, outcome = ?, detail = ? WHERE id = ?",
        (time.time(), outcome, None if detail is None else json.dumps(detail), row),
    )


def _sleep_for(req: Request) -> float:
    table = req.input.get("sleep", {}) if isinstance(req.input, dict) else {}
    return float(table.get(str(req.attempt), 0))


def _result(req: Request, op: str) -> dict[str, Any]:
    return {"task": req.task_id, "step": req.step, "attempt": req.attempt, "op": op, "pid": os.getpid()}


async def quick(req: Request) -> Any:
    row = _start(req, "quick")
    out = _result(req, "quick")
    _end(row, "ok", out)
    return out


async def block(req: Request) -> Any:
    row = _start(req, "block")
    try:
        await asyncio.sleep(_sleep_for(req))
    except asyncio.CancelledError:
        _end(row, "cancelled")
        raise
    out = _result(req, "block")
    _end(row, "ok", out)
    return out


async def block_in_thread(req: Request) -> Any:
    """An async operation that hands a blocking call to the loop's default executor, as
    ``asyncio.to_thread`` does: cancelling it leaves the thread running."""
    row = _start(req, "block_in_thread")
    await asyncio.to_thread(time.sleep, _sleep_for(req))
    out = _result(req, "block_in_thread")
    _end(row, "ok", out)
    return out


def block_sync(req: Request) -> Any:
    row = _start(req, "block_sync")
    time.sleep(_sleep_for(req))
    out = _result(req, "block_sync")
    _end(row, "ok", out)
    return out


async def fail_transient(req: Request) -> Any:
    row = _start(req, "fail_transient")
    _end(row, "transient")
    raise Transient(f"{req.step} is down (attempt {req.attempt})")


async def fail_permanent(req: Request) -> Any:
    row = _start(req, "fail_permanent")
    _end(row, "permanent")
    raise Permanent(f"{req.step} refused the request for good")


async def undo(req: Request) -> Any:
    row = _start(req, "undo")
    out = {"undone": req.undo, "attempt": req.attempt}
    _end(row, "ok", out)
    return out


def _retry(max_failures: int = 5, escalation: Any = None) -> Retry:
    return Retry(
        max_failures=max_failures,
        backoff=Backoff(initial=0.1, maximum=0.3, jitter=0.1),
        tries=2,
        in_attempt=Backoff(initial=0.01, maximum=0.05),
        escalation=escalation,
    )


def make_app(db: str | None = None) -> App:
    app = App(db)
    # Its steps hang past complete-by on purpose (a worker killed mid-step, rescues while the
    # leadership changes hands); each such call counts against the breaker (AGT3), which would
    # open and hold the next attempts back: these tests are about rescue, not about the breaker.
    it = app.agent("it", concurrency=16, breaker_threshold=1000)
    for fn in (quick, block, block_in_thread, block_sync, undo):
        it.operation(fn)
    # The failing operations live in an agent of their own, whose circuit breaker never opens in
    # these tests, so every try reaches the operation (and its log) and the breaker never holds
    # back the compensations of agent "it".
    down = app.agent("down", concurrency=4, breaker_threshold=1000)
    for fn in (fail_transient, fail_permanent):
        down.operation(fn)

    # one quick step (exclusive claims)
    app.workflow("one", [Step("only", "it.quick", complete_by=20.0)])
    # a step whose first attempt blocks: a worker is killed in it, or it passes complete-by
    app.workflow("blocking", [Step("slow", "it.block", complete_by=2.0, retry=_retry())])
    # the same with a plain function, which the agent cannot cancel
    app.workflow("blocking-sync", [Step("slow", "it.block_sync", complete_by=3.0, retry=_retry())])
    # a long complete-by: an agent stopped gracefully mid-step must hand the attempt back long before
    app.workflow("long", [Step("slow", "it.block", complete_by=30.0, retry=_retry())])
    app.workflow("long-sync", [Step("slow", "it.block_sync", complete_by=30.0, retry=_retry())])
    # short complete-by, for rescues while leadership changes hands
    app.workflow("flaky", [Step("slow", "it.block", complete_by=1.0, retry=_retry(max_failures=8))])
    # always failing: error after three failures, with an alert
    app.workflow("doomed", [Step("doomed", "down.fail_transient", complete_by=5.0, retry=_retry(3))])
    # permanent failure: error at once
    app.workflow(
        "refused",
        [
            Step("first", "it.quick", complete_by=5.0, compensate="it.undo"),
            Step("refused", "down.fail_permanent", complete_by=5.0, retry=_retry(3)),
        ],
    )
    # the third step always fails: undo the first two, newest first
    app.workflow(
        "undone",
        [
            Step("first", "it.quick", complete_by=5.0, compensate="it.undo"),
            Step("second", "it.quick", complete_by=5.0, compensate="it.undo"),
            Step("third", "down.fail_transient", complete_by=5.0, retry=_retry(3, escalation="compensate")),
        ],
    )
    return app


app = make_app()
