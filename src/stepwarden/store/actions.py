"""Operator actions on one task (OPS2, OPS3): retry it from a step, or cancel it."""

from __future__ import annotations

from ..errors import InputError, NotFound
from .base import Tx
from .records import _now, event, message
from .undo import failed_undos


def _reopen_undos(tx: Tx, task_id: int) -> None:
    """The failed compensations get a fresh budget of attempts, as a retried step gets for its
    operation; the task goes back to being undone, picked up at once by a scheduler."""
    tx.sql(
        "UPDATE steps SET comp_failures = 0, locked_by = NULL, complete_by = NULL, finished_at = NULL "
        "WHERE task_id = ? AND state = 'failed' AND comp_failures > 0",
        (task_id,),
    )
    _to_compensating(tx, task_id)


def _to_compensating(tx: Tx, task_id: int) -> None:
    """The task is undone from now on, picked up at once by a scheduler: no longer finished, nor
    failing with its last error (`task show` must not give it the time and error of its end)."""
    tx.sql(
        "UPDATE tasks SET state = 'compensating', locked_by = NULL, complete_by = NULL, finished_at = NULL, "
        "last_error = NULL, run_at = 0, waiting = 0, updated_at = ? WHERE id = ?",
        (_now(tx), task_id),
    )


def retry_task(tx: Tx, task_id: int, step_name: str | None, actor: str) -> str:
    """Resubmit an errored task from its failed step, or from ``step_name`` (OPS2). A task that
    ended in ``error`` while being undone (a compensation failed for good) resumes its undo: its
    steps must not run forward again over effects already undone.

    A ``compensated`` or ``cancelled`` task is refused. Run again, its steps would call the
    services with the same idempotency keys (``TASK_ID:STEP``, stable by SPEC), and an idempotent
    service answers a key it has seen from its record of that first call, without applying the
    effect again: the task would end ``processed`` over effects that stay undone (REL2). A new
    task, with new keys, is the way to run it again."""
    task = tx.one("task_for_update", task_id=task_id)
    if task is None:
        raise NotFound(f"no task {task_id}")
    if task["state"] in ("compensated", "cancelled"):
        raise InputError(
            f"task {task_id} is {task['state']}: its effects were undone, and run again under the same"
            " idempotency keys an idempotent service would not apply them again; submit a new task"
            f" with its input (stepwarden task show {task_id} --json)"
        )
    if task["state"] != "error":
        raise InputError(f"task {task_id} is {task['state']}; only error tasks can be retried")
    steps = tx.all("steps_of_task", task_id=task_id)
    names = [s["name"] for s in steps]
    undos = failed_undos(steps)
    if undos:
        failed = undos[-1]["name"]
        if step_name is not None:
            raise InputError(
                f"task {task_id} failed while undoing step {failed!r}: a retry resumes the undo from"
                " there, so it takes no step"
            )
        _reopen_undos(tx, task_id)
        event(tx, "retried", task_id, actor, undos[-1]["idx"], step=failed, kind="undo")
        message(tx, task, "retried", step=failed)
        return "compensating"
    if step_name is not None and step_name not in names:
        raise InputError(f"task {task_id} has no step {step_name!r}; its steps are {', '.join(names)}")
    first_open = next((i for i, s in enumerate(steps) if s["state"] != "completed"), len(steps) - 1)
    start = names.index(step_name) if step_name else first_open
    if start > first_open:
        raise InputError(
            f"step {step_name!r} comes after step {names[first_open]!r}, which has not completed"
        )
    tx.sql(
        "UPDATE steps SET state = 'pending', failure_offset = failure_count, comp_failures = 0, "
        "locked_by = NULL, complete_by = NULL, finished_at = NULL WHERE task_id = ? AND idx >= ?",
        (task_id, start),
    )
    tx.sql(
        "UPDATE tasks SET state = 'pending', locked_by = NULL, complete_by = NULL, cancel_requested = 0, "
        "finished_at = NULL, last_error = NULL, run_at = 0, waiting = 0, updated_at = ? WHERE id = ?",
        (_now(tx), task_id),
    )
    event(tx, "retried", task_id, actor, start, step=names[start])
    message(tx, task, "retried", step=names[start])
    return "pending"


def describe_retry(task_id: int, state: str, step: str | None) -> str:
    """What a retry did, in the words the CLI and the dashboard print: the task's new state."""
    if state == "compensating":
        return f"task {task_id} is compensating again: its undo resumes where it failed"
    return f"task {task_id} is pending again" + (f" from step {step}" if step else "")


def cancel_task(tx: Tx, task_id: int, actor: str) -> str:
    """Ask a task to stop after its running step and undo what it did (CMP4); returns its state now."""
    task = tx.one("task_for_update", task_id=task_id)
    if task is None:
        raise NotFound(f"no task {task_id}")
    if task["state"] in ("processed", "compensated", "cancelled"):
        raise InputError(f"task {task_id} is already {task['state']}; nothing to cancel")
    if task["state"] == "compensating" and not task["cancel_requested"]:
        # Its undo began because a step failed: a cancel would only rename the outcome, and the
        # final message would no longer say why the task was undone.
        raise InputError(
            f"task {task_id} is already being undone after a step failed; it will end compensated,"
            " so there is nothing to cancel"
        )
    if task["cancel_requested"] and task["state"] != "error":
        return str(task["state"])  # asked already, and on its way: nothing new to write
    undoing = task["state"] == "error" and failed_undos(tx.all("steps_of_task", task_id=task_id))
    if not (undoing and not task["cancel_requested"]):
        # Not for an undo that a step's failure began: the cancel resumes it as a retry does, and
        # it ends compensated, which says why (marked cancelled, it ended `cancelled`).
        tx.sql("UPDATE tasks SET cancel_requested = 1, updated_at = ? WHERE id = ?", (_now(tx), task_id))
    event(tx, "cancel_requested", task_id, actor)
    if undoing:
        # Ended while being undone: the undo resumes, with a fresh budget of attempts (one more
        # failure used to end it in error again at once).
        _reopen_undos(tx, task_id)
    elif task["state"] == "error" or (task["state"] == "pending" and task["locked_by"] is None):
        tx.put("skip_unstarted", task_id=task_id)
        _to_compensating(tx, task_id)
    else:
        return str(task["state"])  # a step is running: the undo begins when its reply is applied
    event(tx, "compensating", task_id, actor, reason="cancel requested")
    message(tx, task, "compensating", reason="cancel requested")
    return "compensating"
