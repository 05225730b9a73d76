"""What a task's undo has left behind (CMP2, CMP3): the steps whose effects may still stand, and
the compensations that failed for good. The transitions that give a task up and the operator
actions that resume its undo read a task's steps the same way."""

from __future__ import annotations

from .base import Row


def not_undone(steps: list[Row]) -> list[str]:
    """The steps whose effect may still stand while the task is given up, in step order: every
    started step not undone. That is those with an undo that has not succeeded, and those that
    declare none: completed ones, and also ones that failed, timed out or were given up while
    waiting to retry, whose call may have applied its effect (the reason a failed step with an
    undo is undone too). Named only the completed ones, a task whose last step timed out with no
    undo ended ``compensated`` saying nothing of it, read as "every effect undone"."""
    return [s["name"] for s in steps if s["started_at"] is not None and s["state"] != "compensated"]


def failed_undos(steps: list[Row]) -> list[Row]:
    """The steps whose compensation failed for good: the task ended in ``error`` while being
    undone. (A forward failure never counts a compensation failure.)"""
    return [s for s in steps if s["state"] == "failed" and int(s["comp_failures"] or 0) > 0]
