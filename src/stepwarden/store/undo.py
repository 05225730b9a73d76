"""What a task's undo has left behind (CMP2, CMP3): the steps whose effects may still stand, and
the compensations that failed for good. The transitions that give a task up and the operator
actions that resume its undo read a task's steps the same way."""

from __future__ import annotations

from .base import Row, Tx


def not_undone(steps: list[Row], reached: set[int]) -> list[str]:
    """The steps whose effect may still stand while the task is given up, in step order: those
    not undone that either completed or failed after an agent took one of their requests
    (``reached``: the step indexes of :func:`reached_steps`), whose call may have applied its
    effect all the same (the reason a failed step with an undo is undone too). Named only when
    completed, a task whose last step timed out with no undo ended ``compensated`` saying nothing
    of it, read as "every effect undone". A step whose requests no agent took (they expired
    queued, or were handed back by a stopping worker) never reached its service: it is neither
    named nor undone (see ``transitions.advance``)."""
    return [
        s["name"]
        for s in steps
        if s["started_at"] is not None
        and s["state"] != "compensated"
        and (s["state"] == "completed" or s["idx"] in reached)
    ]


def reached_steps(tx: Tx, task_id: int) -> set[int]:
    """The indexes of the task's steps a forward request of which an agent took: their call may
    have reached the service. (A request an agent handed back unrun after its take counts too: a
    handed back call may also have been cut short mid-call by a stop, and which it was is not
    recorded. One a stopping worker handed back untaken, ``agents.hand_back_dispatched``, keeps
    no taker.)"""
    return {int(r["step_idx"]) for r in tx.all("steps_reached", task_id=task_id)}


def failed_undos(steps: list[Row]) -> list[Row]:
    """The steps whose compensation failed for good: the task ended in ``error`` while being
    undone. (A forward failure never counts a compensation failure.)"""
    return [s for s in steps if s["state"] == "failed" and int(s["comp_failures"] or 0) > 0]
