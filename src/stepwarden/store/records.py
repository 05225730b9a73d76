"""The records a change writes beside it, in its own transaction: events, status messages on the
task's reply queue (SCH8) and alerts (OPS4), with the database clock's ``now`` that a change reads.
Kept apart because every transition module writes them (the schedulers' ``transitions``, the
supervisor's ``supervision``, the operator's ``actions``, the agents' ``agents``): they sit below
all of those and import nothing of them, so writing an event never needs the transitions.
"""

from __future__ import annotations

import json
from typing import Any

from .base import Row, Tx

# ``json.dumps(x, default=str)``, with the encoder made once: dumps builds a new JSONEncoder for
# every call that passes ``default`` (4.2 against 2.8 µs for a small detail), and every step
# writes several events. The same text: JSONEncoder's defaults are dumps' defaults.
_to_json = json.JSONEncoder(default=str).encode


def event(
    tx: Tx,
    kind: str,
    task_id: int | None,
    actor: str | None,
    idx: int | None = None,
    attempt: int | None = None,
    /,
    **detail: Any,
) -> None:
    tx.later(
        "insert_event",
        task_id=task_id,
        idx=idx,
        attempt=attempt,
        kind=kind,
        actor=actor,
        detail=_to_json(detail) if detail else None,
    )


def message(tx: Tx, task: Row, kind: str, /, **body: Any) -> None:
    """A status message on the task's reply queue (SCH8), in the same transaction as the change."""
    if task.get("reply_to"):
        body = {"task_id": task["id"], "correlation_id": task.get("correlation_id"), "kind": kind, **body}
        tx.later(
            "insert_message",
            queue=task["reply_to"],
            task_id=task["id"],
            correlation_id=task.get("correlation_id"),
            kind=kind,
            body=_to_json(body),
        )


def alert(tx: Tx, kind: str, task_id: int | None, step: str | None, text: str) -> Row:
    row = tx.one("insert_alert", kind=kind, task_id=task_id, step=step, message=text)
    assert row is not None
    return {"id": row["id"], "kind": kind, "task_id": task_id, "step": step, "message": text}


def _now(tx: Tx) -> float:
    row = tx.one("now")
    assert row is not None
    return float(row["now"])
