"""Every state change of tasks and steps, written once for all dialects.

Each function runs inside one transaction (a :class:`Tx`) and makes only conditional changes:
a statement matching no row means someone else (a newer attempt, another scheduler, a new leader)
owns the thing now, and the change is dropped or recorded as stale, never forced.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence
from typing import Any

from ..errors import InputError, LostOwnership, StoreError
from ..policies import Decision, stored_policy
from ..workflow import Step, Workflow, encode_result
from .base import FINAL_TASK_STATES, ApplyResult, Row, Tx, hot

# The records a change writes beside it; other modules reach them here too (``transitions.event``).
from .records import _now, _to_json, alert, event, message
from .undo import not_undone, reached_steps


def submit(
    tx: Tx,
    wf: Workflow,
    input_text: str,
    *,
    correlation_id: str | None,
    idempotency_key: str | None,
    priority: int,
    reply_to: str | None,
) -> tuple[int, bool]:
    """Write the task and one row per step (SUB1); an idempotency key returns the existing task (SUB3).

    The insert itself resolves a duplicate key (ON CONFLICT DO NOTHING) rather than a look-up first:
    at READ COMMITTED two concurrent submitters would both miss the look-up, and the second would
    then fail on the unique index instead of getting the first one's task. On PostgreSQL the whole
    submission is one statement (``submit_task``: one round trip instead of three).
    """
    task = {
        "workflow": wf.name,
        "version": wf.version,
        "input": input_text,
        "correlation_id": correlation_id,
        "idempotency_key": idempotency_key,
        "reply_to": reply_to,
        "priority": priority,
    }
    steps, steps_json = _step_rows(wf)
    # Twice at most: the task holding the key may be deleted between the insert that met it and
    # the look-up (the leader pruning it at the end of its retention, on PostgreSQL, where the
    # look-up is a statement of its own). The key is free then, and a second insert takes it.
    for _ in range(2):
        if tx.dialect == "postgres":
            detail = json.dumps({"workflow": wf.name, "correlation_id": correlation_id})
            skip = not tx.caller_managed
            tail = _received_tail(correlation_id) if reply_to is not None else None
            row = tx.one(
                "submit_task", **task, steps=steps_json, detail=detail, may_skip=skip, received_tail=tail
            )
        else:
            row = tx.one("insert_task", **task)
        if row is not None:
            break
        # The key exists, committed by another submitter (Postgres waited for it to commit), so
        # this statement's fresh snapshot sees it, unless it was deleted since.
        found = tx.one("task_by_key", key=idempotency_key)
        if found is not None:
            if found["workflow"] != wf.name:
                # The same submission again is the same workflow; another workflow's task under
                # the key is a key reused by mistake, and returning it (as it was) said the
                # submission had been made when nothing of it had.
                raise InputError(
                    f"idempotency key {idempotency_key!r} is task {found['id']}'s, a task of"
                    f" workflow {found['workflow']!r}, not {wf.name!r}: nothing was submitted; give"
                    " each submission a key of its own"
                )
            return int(found["id"]), False
    else:
        raise StoreError(
            f"idempotency key {idempotency_key!r}: its task was deleted while this submission"
            " looked for it, twice; nothing was submitted: submit it again"
        )
    task_id = int(row["id"])
    if tx.dialect != "postgres":
        for step in steps:
            tx.put("insert_step", task_id=task_id, **step)
        event(tx, "received", task_id, None, workflow=wf.name, correlation_id=correlation_id)
        message(tx, {"id": task_id, "reply_to": reply_to, "correlation_id": correlation_id}, "received")
    return task_id, True


submit.stepwarden_pipeline = False  # type: ignore[attr-defined]  # one statement on PostgreSQL
# ... which is its own transaction there: no BEGIN and COMMIT round trips (PostgresStore._autocommit).
submit.stepwarden_autocommit = True  # type: ignore[attr-defined]


def _received_tail(correlation_id: str | None) -> str:
    """The ``received`` message's body after its task id, as :func:`records.message` encodes the
    whole body on SQLite: ``submit_task`` writes ``'{"task_id": ' || id || tail`` on PostgreSQL,
    where the id is known only inside the statement, so both stores write the same text."""
    return ", " + _to_json({"correlation_id": correlation_id, "kind": "received"})[1:]


@functools.lru_cache(maxsize=256)
def _step_rows(wf: Workflow) -> tuple[tuple[dict[str, Any], ...], str]:
    """A workflow's step rows as a submission writes them, and as JSON: the same for every task
    of the workflow, so made once per definition (31 µs a submission for three steps, against 2
    for the definition's hash). The rows are shared: read them, never change them."""
    rows = tuple(_step_row(idx, s) for idx, s in enumerate(wf.steps))
    return rows, json.dumps(rows)


def _step_row(idx: int, s: Step) -> dict[str, Any]:
    return {
        "idx": idx,
        "name": s.name,
        "agent": s.agent,
        "operation": s.operation,
        "compensate": s.compensate,
        "budget": s.complete_by,
        "policy": json.dumps(s.retry.to_dict()),
        "on_error": s.on_error,
    }


def claim_and_dispatch(tx: Tx, me: str, limit: int) -> int:
    """Claim claimable tasks (SCH1) and dispatch each one's next step, all in this transaction.

    Set-based where it counts: one statement claims the batch, one reads all their steps, and
    the writes go out without waiting for each other, so a round's cost barely grows with its size."""
    tasks = tx.all("claim_tasks", me=me, limit=limit)
    if not tasks:
        return 0
    steps = steps_of(tx, [task["id"] for task in tasks])
    now = float(tasks[0]["now"])
    for task in tasks:
        event(tx, "claimed", task["id"], me, state=task["state"])
        advance(tx, task, me, steps.get(task["id"], []), now)
    return len(tasks)


def steps_of(tx: Tx, task_ids: list[int]) -> dict[int, list[Row]]:
    """The steps of several tasks in one statement, by task, in step order."""
    return _by_task(tx.all("steps_of_tasks", ids=json.dumps(task_ids)))


def _by_task(step_rows: list[Row]) -> dict[int, list[Row]]:
    out: dict[int, list[Row]] = {}
    for s in step_rows:
        out.setdefault(s["task_id"], []).append(s)
    return out


def advance(tx: Tx, task: Row, me: str, steps: list[Row] | None = None, now: float | None = None) -> None:
    """Move a task I hold to its next action: the next step, the next undo, or its end.

    ``steps`` are the task's step rows as they stand in this transaction (they are kept up to date
    by the hot path); without them they are read again."""
    if steps is None:
        steps = tx.all("steps_of_task", task_id=task["id"])
    if task["state"] in ("pending", "processing") and task["cancel_requested"]:
        begin_compensation(tx, task, me, reason="cancel requested")
        return
    if task["state"] in ("pending", "processing"):
        for s in steps:
            if s["state"] != "completed":
                dispatch(tx, task, s, steps, me, "do", now)
                return
        tx.put("finish_task", task_id=task["id"], state="processed", error=None)
        event(tx, "processed", task["id"], me)
        message(tx, task, "processed", results=_results(steps))
        task["state"] = "processed"
        return
    # compensating: undo, in reverse order, every started step that has an undo, is not undone
    # and may have had an effect: completed, or reached (an agent took one of its requests: a
    # failed call may have applied it). A step no agent ever took a request of never reached its
    # service: its undo would undo nothing, and sent to the same agent (the usual case, CMP1) that
    # is down, it failed for good and left the completed steps before it un-undone.
    reached: set[int] | None = None
    for s in reversed(steps):
        if s["started_at"] is not None and s["compensate"] and s["state"] != "compensated":
            if s["state"] not in ("completed", "compensating"):  # an undo begun is finished
                reached = reached_steps(tx, task["id"]) if reached is None else reached
                if s["idx"] not in reached:
                    continue
            dispatch(tx, task, s, steps, me, "undo", now)
            return
    final = "cancelled" if task["cancel_requested"] else "compensated"
    # A step that started and never completed, with no undo (its retry was waiting when the task
    # was given up): failed, not left pending in a finished task.
    tx.put("give_up_started", task_id=task["id"])
    # Steps that declare no undo keep their effect (completed ones, and failed ones whose call
    # may have applied it): the outcome names them, so that "compensated" is not read as "every
    # effect undone" (CMP1 makes the undo optional).
    kept = not_undone(steps, reached_steps(tx, task["id"]) if reached is None else reached)
    extra: dict[str, Any] = {"not_undone": kept} if kept else {}
    tx.put("finish_task", task_id=task["id"], state=final, error=None)
    event(tx, final, task["id"], me, **extra)
    message(tx, task, final, **extra)
    task["state"] = final


def begin_compensation(tx: Tx, task: Row, me: str, reason: str) -> None:
    tx.put("skip_unstarted", task_id=task["id"])
    tx.put("task_in_flight", task_id=task["id"], state="compensating", me=me, complete_by=None)
    task["state"] = "compensating"
    event(tx, "compensating", task["id"], me, reason=reason)
    message(tx, task, "compensating", reason=reason)
    advance(tx, task, me)  # reads the steps again: the skips above changed them


def dispatch(
    tx: Tx, task: Row, step: Row, steps: list[Row], me: str, kind: str, now: float | None = None
) -> None:
    """Start the step's next attempt and send its request message (SCH3), fenced by the attempt.

    The attempt's complete-by is the database's ``now`` (read once per transaction) plus the
    step's budget. The update is conditional on the attempt number; it cannot miss, because every
    transition of a task's steps first holds the task (claimed or locked in this transaction)."""
    if now is None:
        now = _now(tx)
    state = "running" if kind == "do" else "compensating"
    attempt = int(step["attempt"]) + 1
    complete_by = now + float(step["budget"])
    tx.put(
        "start_attempt",
        task_id=task["id"],
        idx=step["idx"],
        attempt=step["attempt"],
        state=state,
        me=me,
        complete_by=complete_by,
        now=now,
    )
    step.update(
        state=state,
        attempt=attempt,
        locked_by=me,
        complete_by=complete_by,
        started_at=step["started_at"] if step["started_at"] is not None else now,
    )
    payload: dict[str, Any] = {"input": json.loads(task["input"]), "results": _results(steps)}
    if kind == "undo":
        payload["undo"] = json.loads(step["result"]) if step["result"] else None
    agent, op = (step["operation"] if kind == "do" else step["compensate"]).split(".", 1)
    tx.dispatched.append(agent)
    tx.put(
        "insert_request",
        task_id=task["id"],
        idx=step["idx"],
        attempt=attempt,
        kind=kind,
        agent=agent,
        operation=op,
        payload=json.dumps(payload),
        policy=step["policy"],
        key=f"{task['id']}:{step['name']}",
        priority=task["priority"],
        complete_by=complete_by,
        me=me,
    )
    tx.put(
        "task_in_flight",
        task_id=task["id"],
        state=task["state"] if kind == "undo" else "processing",
        me=me,
        complete_by=complete_by,
    )
    if kind == "do":
        task["state"] = "processing"
    event(
        tx,
        "dispatched",
        task["id"],
        me,
        step["idx"],
        attempt,
        step=step["name"],
        kind=kind,
        complete_by=complete_by,
    )


def _results(steps: list[Row]) -> dict[str, Any]:
    return {s["name"]: json.loads(s["result"]) for s in steps if s["state"] == "completed" and s["result"]}


def apply_replies(
    tx: Tx,
    me: str,
    limit: int,
    rng: random.Random,
    own: Sequence[tuple[int, str, Any, str | None]] = (),
) -> ApplyResult:
    """Apply agents' replies: only the current attempt's, received before complete-by (SCH4).

    The batch's replies are read with their tasks, locked, in one statement, and the tasks'
    steps in a second (on PostgreSQL in the same round trip); a task whose replies take the
    common path (a step completes, the next is dispatched or the task ends) is then kept up to
    date in memory. Any other path reads it again before its next reply.

    ``own``: replies ``(request_id, outcome, result, error)`` that this transaction
    received itself (a worker's agent answering): they come with the batch, after up to ``limit``
    waiting in the table, and are written once, already settled (``accepted`` or ``stale``),
    instead of inserted as new and then marked: one row version and one statement fewer per
    reply, and no notification that nobody needs."""
    out = ApplyResult()
    own_json = json.dumps(
        [
            {
                "request_id": q,
                "outcome": o,
                "result": encode_result(res),
                "error": e,
            }
            for q, o, res, e in own
        ]
    )
    # The replies and their tasks, locked, then the steps, read after the locks are held (no
    # transition changes a task's steps without holding it): one round trip on PostgreSQL.
    rows, step_rows = tx.both(
        ("new_replies_with_tasks", {"limit": limit, "own": own_json, "me": me}),
        ("steps_of_new_replies", {"limit": limit, "own": own_json}),
    )
    if not rows:
        return out
    # Within a task, in the order received: the table's (by id), then this transaction's own.
    replies = sorted(
        rows, key=lambda r: (r["task_id"], r["id"] is None, r["n"] if r["id"] is None else r["id"])
    )
    # Each row carries its task's columns as t_<column> (t_id None: the task is gone).
    tasks = {
        r["t_id"]: {k[2:]: v for k, v in r.items() if k.startswith("t_")}
        for r in rows
        if r["t_id"] is not None
    }
    all_steps = _by_task(step_rows)
    now = float(replies[0]["now"])
    # The second statement reads the steps of exactly the tasks the first locked (on SQLite,
    # whose single writer is the lock, it chooses the replies again). A task whose steps did not
    # come all the same is read again on its own, as after a path below.
    stale_tasks: set[int] = {t for t in tasks if t not in all_steps}
    settled: list[tuple[int, Row]] = []  # the transaction's own replies, written in their order
    for r in replies:
        if r["task_id"] in stale_tasks:  # changed by a path that does not keep memory up to date
            tasks.pop(r["task_id"], None)
            found = tx.one("task_for_update", task_id=r["task_id"])
            if found is not None:
                tasks[r["task_id"]] = found
            all_steps[r["task_id"]] = tx.all("steps_of_task", task_id=r["task_id"])
            stale_tasks.discard(r["task_id"])
        task = tasks.get(r["task_id"])
        steps = all_steps.get(r["task_id"], [])
        step = next((s for s in steps if s["idx"] == r["step_idx"]), None)
        expect = "running" if r["kind"] == "do" else "compensating"
        current = (
            task is not None
            and step is not None
            and step["attempt"] == r["attempt"]
            and step["state"] == expect
            and step["complete_by"] is not None
            and r["received_at"] <= step["complete_by"]
            and task["state"] in ("processing", "compensating")
        )
        # The replies are ours alone (locked, or SQLite's single writer): marking cannot miss.
        if task is None:
            # The task was pruned (a reply that arrived while the prune held it): nothing will
            # ever read the reply, and no later prune would find it by its task.
            if r["id"] is not None:
                tx.put("delete_reply", id=r["id"])
            out.stale += 1
            continue
        if not current or step is None:
            _settle(tx, r, "stale", me, settled)
            event(
                tx,
                "stale_reply",
                r["task_id"],
                me,
                r["step_idx"],
                r["attempt"],
                outcome=r["outcome"],
                current_attempt=step["attempt"] if step else None,
            )
            out.stale += 1
            continue
        _settle(tx, r, "accepted", me, settled)
        tx.put(
            "finish_request", task_id=task["id"], idx=step["idx"], attempt=r["attempt"], outcome=r["outcome"]
        )
        out.accepted += 1
        out.requests.add(r["request_id"])
        if r["outcome"] == "released":
            release_attempt(tx, task, step, me, r["error"] or "released")
            stale_tasks.add(task["id"])
        elif r["outcome"] == "ok":
            done = "completed" if r["kind"] == "do" else "compensated"
            result = r["result"] if r["kind"] == "do" else step["result"]
            tx.put(
                "complete_step",
                task_id=task["id"],
                idx=step["idx"],
                attempt=r["attempt"],
                state=done,
                expect=expect,
                result=result,
            )
            step.update(state=done, result=result, locked_by=None, complete_by=None, finished_at=now)
            event(tx, "step_" + done, task["id"], me, step["idx"], r["attempt"], step=step["name"])
            message(tx, task, "step_" + done, step=step["name"])
            compensating = task["state"] == "compensating"
            advance(tx, task, me, steps, now)
            if task["state"] == "compensating" and not compensating:
                stale_tasks.add(task["id"])  # a cancel began compensation: it read its own rows
        else:
            fail_attempt(
                tx,
                task,
                step,
                r["error"] or r["outcome"],
                me,
                rng,
                permanent=r["outcome"] == "error",
                out_alerts=out.alerts,
            )
            stale_tasks.add(task["id"])
        if task["state"] in FINAL_TASK_STATES:
            out.finished.append((task["id"], task["state"]))
    for _, reply in sorted(settled, key=lambda nr: nr[0]):
        # nothing in this transaction reads them again: written with the kept writes
        tx.later("insert_applied_reply", **reply)
    return out


def _settle(tx: Tx, r: Row, status: str, me: str, own: list[tuple[int, Row]]) -> None:
    """Mark a reply from the table applied; one of the transaction's own is added to ``own``."""
    if r["id"] is not None:
        tx.put("mark_reply", id=r["id"], status=status, me=me)
        return
    reply = {
        "request_id": r["request_id"],
        "task_id": r["task_id"],
        "idx": r["step_idx"],
        "attempt": r["attempt"],
        "kind": r["kind"],
        "outcome": r["outcome"],
        "result": r["result"],
        "error": r["error"],
        "received_at": r["received_at"],  # the time the batch checked against complete-by
        "status": status,
        "me": me,
    }
    own.append((int(r["n"]), reply))


def release_attempt(tx: Tx, task: Row, step: Row, me: str, why: str) -> None:
    """Give an attempt back without counting a failure: its agent stopped gracefully (DEP4)."""
    undo = step["state"] == "compensating"
    back_to = "compensating" if undo else "pending"
    changed = tx.one(
        "fail_step",
        task_id=task["id"],
        idx=step["idx"],
        attempt=step["attempt"],
        expect=step["state"],
        error=why[:2000],
        fwd=0,
        comp=0,
        state=back_to,
        final=False,
    )
    if changed is None:
        raise LostOwnership(f"step {task['id']}/{step['name']} attempt {step['attempt']} moved under us")
    tx.put("release_task", task_id=task["id"], state=back_to, delay=0, failed=0, error=None)
    event(tx, "released", task["id"], me, step["idx"], step["attempt"], step=step["name"], reason=why[:200])
    task["state"] = back_to


@hot
def schedule(tx: Tx, me: str, limit: int, rng: random.Random) -> tuple[ApplyResult, int]:
    """The scheduler's whole round in one transaction: apply replies, then claim and dispatch."""
    applied = apply_replies(tx, me, limit, rng)
    return applied, claim_and_dispatch(tx, me, limit)


def fail_attempt(
    tx: Tx,
    task: Row,
    step: Row,
    error: str,
    me: str,
    rng: random.Random,
    *,
    permanent: bool,
    out_alerts: list[Row],
    immediate: bool = False,
) -> str:
    """Count a failed attempt (FailureCount) and apply the retry policy or escalate (SUP2, SUP3, SCH7).

    Returns what happened: ``"retry"``, ``"compensate"`` or ``"error"``.
    """
    undo = step["state"] == "compensating"
    policy = stored_policy(step["policy"])
    error = error[:2000]
    if undo:
        decision = policy.after_failure(step["comp_failures"] + 1, "error", rng)
        if permanent or decision.escalated:
            decision = Decision("error", escalated=True)
    elif task["cancel_requested"]:  # an operator asked to stop: undo now, do not retry (CMP4)
        decision = Decision("compensate", escalated=True)
    elif permanent:
        decision = Decision("compensate" if step["on_error"] == "compensate" else "error", escalated=True)
    else:
        decision = policy.after_failure(
            step["failure_count"] + 1 - step["failure_offset"], step["on_error"], rng
        )
    if immediate and decision.action == "retry" and not decision.escalated:
        decision = Decision("retry", 0.0)
    retry = decision.action == "retry"
    new_state = ("compensating" if undo else "pending") if retry else "failed"
    changed = tx.one(
        "fail_step",
        task_id=task["id"],
        idx=step["idx"],
        attempt=step["attempt"],
        expect=step["state"],
        error=error,
        fwd=0 if undo else 1,
        comp=1 if undo else 0,
        state=new_state,
        final=not retry,
    )
    if changed is None:
        raise LostOwnership(f"step {task['id']}/{step['name']} attempt {step['attempt']} moved under us")
    failures = changed["comp_failures"] if undo else changed["failure_count"]
    # What the policy counted: the forward failures since an operator's last retry of the step
    # (failure_offset), which the texts below name; events keep the total.
    counted = failures if undo else failures - int(step["failure_offset"] or 0)
    since = "" if counted == failures else f" since its last retry by an operator ({failures} in all)"
    if retry:
        back_to = "compensating" if undo else "pending"
        tx.put(
            "release_task",
            task_id=task["id"],
            state=back_to,
            delay=decision.delay,
            failed=0 if undo else 1,
            error=error,
        )
        event(
            tx,
            "retry_scheduled",
            task["id"],
            me,
            step["idx"],
            step["attempt"],
            step=step["name"],
            delay=round(decision.delay, 3),
            escalated=decision.escalated,
            failures=failures,
            kind="undo" if undo else "do",
        )
        if decision.escalated and not decision.repeated:
            out_alerts.append(
                alert(
                    tx,
                    "step_escalated",
                    task["id"],
                    step["name"],
                    f"step {step['name']!r} failed {counted} times{since}; "
                    f"waiting {decision.delay:g}s before retrying",
                )
            )
        task["state"] = back_to
        return "retry"
    tx.put(
        "release_task", task_id=task["id"], state=task["state"], delay=0, failed=0 if undo else 1, error=error
    )
    if decision.action == "compensate":
        event(
            tx,
            "escalated",
            task["id"],
            me,
            step["idx"],
            step["attempt"],
            step=step["name"],
            to="compensate",
            error=error[:500],
            failures=failures,
        )
        why = (
            "cancel requested" if task["cancel_requested"] else f"step {step['name']!r} failed: {error[:200]}"
        )
        begin_compensation(tx, task, me, reason=why)
        return "compensate"
    extra: dict[str, Any] = {}
    if undo:
        # The undo stops here, in reverse order, so the steps before this one keep their effects
        # too (CMP3): the alert names every step left un-undone, not only the one that failed.
        left = not_undone(tx.all("steps_of_task", task_id=task["id"]), reached_steps(tx, task["id"]))
        text = f"compensation of step {step['name']!r} failed ({error[:200]}); its effect is NOT undone"
        if others := [n for n in left if n != step["name"]]:
            text += f"; still standing: {', '.join(map(repr, others))}"
        kind = "compensation_failed"
        extra = {"not_undone": left}
    else:
        text = f"step {step['name']!r} failed after {counted} failure(s){since}: {error[:300]}"
        kind = "task_error"
    tx.put("finish_task", task_id=task["id"], state="error", error=error)
    out_alerts.append(alert(tx, kind, task["id"], step["name"], text))
    event(tx, "error", task["id"], me, step["idx"], step["attempt"], step=step["name"], reason=text, **extra)
    message(tx, task, "error", step=step["name"], error=text, **extra)
    task["state"] = "error"
    return "error"


# The supervisor's and the operator's transitions live in their own modules; they are reached
# through this one too (``transitions.sweep_expired``), the single entry point for every change.
from .actions import cancel_task, describe_retry, retry_task  # noqa: E402
from .supervision import (  # noqa: E402
    lease_holder,
    owners_in_flight,
    prune,
    prune_records,
    rescue_orphans,
    sweep_expired,
    take_lease,
)

__all__ = [
    "advance",
    "alert",
    "apply_replies",
    "begin_compensation",
    "cancel_task",
    "claim_and_dispatch",
    "describe_retry",
    "dispatch",
    "event",
    "fail_attempt",
    "lease_holder",
    "message",
    "owners_in_flight",
    "prune",
    "prune_records",
    "release_attempt",
    "rescue_orphans",
    "retry_task",
    "schedule",
    "steps_of",
    "submit",
    "sweep_expired",
    "take_lease",
]
