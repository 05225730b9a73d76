"""The compensation crash tests' application: an idempotent remote service with a ledger of effects.

REL2 says that with agents passing the idempotency key to an idempotent service, no effect is
applied twice and no compensated effect survives. Checking it needs a service that keeps its own
books, apart from the store under test: this one keeps them in ``itapp``'s execution log (the
SQLite file named by ``ITAPP_LOG``, written with WAL and ``synchronous=NORMAL`` so a worker killed
with SIGKILL loses nothing it committed), through ``itapp``'s own helpers:

- every call is an execution there (op ``apply``, ``revert`` or ``refuse``), committed before it
  does anything (so a call in a killed process leaves a row without an end): key, step, kind,
  attempt, pid, and how it ended;
- ``effects``, a table beside it: one row per idempotency key, ``applied`` and ``undone`` counts and
  a ``tombstoned`` flag, written in the same transaction as the call's row. The service is
  idempotent the way a real one is: a forward call under a key it has seen answers from its record
  and applies nothing; an undo call undoes at most what was applied; an undo of a key never
  applied leaves a tombstone, so a forward call still in flight cannot land after its
  compensation (the demo services' rule).

A call can *hang* after it has applied its effect -- the reply is withheld, as a real service's
lost reply -- which is where the tests kill the worker. The task input says which calls hang:
``{"hang": {"KIND:STEP": [SECONDS, ...]}}``, the n-th call of that kind for that step's key
hanging the n-th number of seconds (later calls, or 0, return at once). Counting calls in the
log, not attempts, keeps the rule true across processes and independent of the attempt numbers
a step's forward and undo attempts share.

Workers load it as ``--app ledgerapp:app`` with ``tests/apps`` on ``PYTHONPATH`` (as ``itapp``);
tests build their own copy against their store with :func:`make_app`.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from typing import Any

from itapp import _end, _log, _start, connect_log

from stepwarden import App, Backoff, Permanent, Request, Retry, Step

EFFECTS = """CREATE TABLE IF NOT EXISTS effects (
    key        TEXT PRIMARY KEY,
    applied    INTEGER NOT NULL,
    undone     INTEGER NOT NULL,
    tombstoned INTEGER NOT NULL
)"""

_local = threading.local()


def connect_books(path: str) -> sqlite3.Connection:
    """``itapp``'s execution log at ``path``, with the service's table of effects beside it."""
    conn = connect_log(path)
    conn.execute(EFFECTS)
    return conn


def _books() -> sqlite3.Connection:
    """``itapp``'s log connection of this thread, its table of effects made sure of once."""
    conn = _log()
    if getattr(_local, "conn", None) is not conn:
        conn.execute(EFFECTS)
        _local.conn = conn
    return conn


def _begin(req: Request, op: str) -> tuple[sqlite3.Connection, int, int]:
    """Open the service's transaction and log the call in it: (connection, call row, n-th call of
    its kind under its key)."""
    conn = _books()
    conn.execute("BEGIN IMMEDIATE")
    row = _start(req, op)  # the same connection: inside this transaction
    nth = int(
        conn.execute(
            "SELECT COUNT(*) FROM executions WHERE key = ? AND kind = ? AND id <= ?",
            (req.idempotency_key, req.kind, row),
        ).fetchone()[0]
    )
    return conn, row, nth


def _hang_for(req: Request, nth: int) -> float:
    table = req.input.get("hang", {}) if isinstance(req.input, dict) else {}
    plan = table.get(f"{req.kind}:{req.step}", [])
    return float(plan[nth - 1]) if nth <= len(plan) else 0.0


async def _withhold(req: Request, row: int, nth: int, outcome: str) -> None:
    """The effect is committed: hang if the input says so (the reply is lost), then record the end."""
    try:
        await asyncio.sleep(_hang_for(req, nth))
    except asyncio.CancelledError:  # cancelled at complete-by (AGT4): the effect stays applied
        _end(row, "cancelled")
        raise
    _end(row, outcome)


async def apply(req: Request) -> Any:
    """The forward effect, applied at most once per idempotency key."""
    conn, row, nth = _begin(req, "apply")
    effect = conn.execute(
        "SELECT applied, tombstoned FROM effects WHERE key = ?", (req.idempotency_key,)
    ).fetchone()
    if effect is not None and effect[1]:
        _end(row, "tombstoned")
        conn.execute("COMMIT")
        raise Permanent(f"{req.idempotency_key} was undone before it was applied")
    outcome = "replayed" if effect is not None else "applied"
    if effect is None:
        conn.execute("INSERT INTO effects VALUES (?, 1, 0, 0)", (req.idempotency_key,))
    conn.execute("COMMIT")
    await _withhold(req, row, nth, outcome)
    return {"key": req.idempotency_key, "step": req.step, "attempt": req.attempt}


async def revert(req: Request) -> Any:
    """The compensation: undoes what its key applied, at most once; a tombstone if nothing was."""
    conn, row, nth = _begin(req, "revert")
    effect = conn.execute(
        "SELECT applied, undone FROM effects WHERE key = ?", (req.idempotency_key,)
    ).fetchone()
    if effect is None:
        conn.execute("INSERT INTO effects VALUES (?, 0, 0, 1)", (req.idempotency_key,))
        outcome = "tombstoned"
    elif effect[0] > effect[1]:
        conn.execute("UPDATE effects SET undone = undone + 1 WHERE key = ?", (req.idempotency_key,))
        outcome = "undone"
    else:
        outcome = "replayed"
    conn.execute("COMMIT")
    await _withhold(req, row, nth, outcome)
    return {"undone": req.idempotency_key, "attempt": req.attempt}


async def refuse(req: Request) -> Any:
    """A business rule says no before any effect: a permanent failure, nothing applied."""
    conn, row, _ = _begin(req, "refuse")
    _end(row, "refused")
    conn.execute("COMMIT")
    raise Permanent(f"step {req.step} refused for good")


# Short back-off, one try per attempt: every attempt is one call, so counting calls counts attempts.
_RETRY = Retry(max_failures=5, backoff=Backoff(initial=0.1, maximum=0.3, jitter=0.1), tries=1)
# A step whose second failed attempt gives the task up: it is compensated.
_GIVE_UP = Retry(
    max_failures=2, backoff=Backoff(initial=0.1, maximum=0.3, jitter=0.1), tries=1, escalation="compensate"
)
# Long: a killed worker's attempt must be rescued because the worker is dead, not because its
# complete-by passed, and a test that had to wait one out would time out rather than pass late.
LONG = 30.0
SHORT = 3.0


def make_app(db: str | None = None) -> App:
    app = App(db)
    # The calls hang on purpose; the breaker (AGT3) is not what these tests are about.
    svc = app.agent("svc", concurrency=8, breaker_threshold=1000)
    for fn in (apply, revert, refuse):
        svc.operation(fn)

    def step(name: str, op: str = "svc.apply", **kw: Any) -> Step:
        kw.setdefault("complete_by", LONG)
        kw.setdefault("retry", _RETRY)
        return Step(name, op, compensate="svc.revert", **kw)

    # Two effects, then a refusal: the task is compensated, b undone first, then a.
    app.workflow("refused", [step("a"), step("b"), step("c", "svc.refuse", on_error="compensate")])
    # Two effects, then a step whose second attempt also expires (its short complete-by): given up,
    # the task is compensated, c included -- its first attempt applied the effect and lost the reply.
    app.workflow("given-up", [step("a"), step("b"), step("c", complete_by=SHORT, retry=_GIVE_UP)])
    return app


app = make_app()
