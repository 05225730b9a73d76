"""The supervisor's transitions: rescue expired and orphaned attempts, prune, take a dead leader's
lease. Each is fenced by the leader's term (LEAD4) and bounded (SUP6); the failure itself is
counted and escalated by the same :func:`~.transitions.fail_attempt` the schedulers use."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from functools import partial
from typing import Any

from ..errors import LostOwnership
from ..liveness import SILENT_AFTER
from .base import FINAL_TASK_STATES, Row, SweepResult, Tx, read_only
from .records import event
from .transitions import fail_attempt


def sweep_expired(tx: Tx, me: str, lease: str, term: int, limit: int, rng: random.Random) -> SweepResult:
    """The supervisor's sweep (SUP1-3), fenced by the leader's term (LEAD4) and bounded (SUP6).
    ``examined`` counts the candidates read, skipped ones too: a full batch means more may wait."""
    leader_fence(tx, me, lease, term)
    out = SweepResult()
    # Lock tasks in id order (no deadlocks between concurrent transitions), skipping any another
    # transaction holds, then re-check each candidate under the lock: a reply may have been
    # applied since the scan.
    found = tx.all("expired_steps", limit=limit)
    out.examined = len(found)
    for x in sorted(found, key=lambda r: (r["task_id"], r["idx"])):
        _rescue(tx, x, me, term, rng, out, "still_expired", {}, partial(_expired_why, tx, x))
    return out


def _expired_why(tx: Tx, x: Row) -> str:
    """Why an attempt is rescued at complete-by, and, when no agent ever took its request, why
    that may be: the step's error otherwise said only "passed complete-by", the same for a
    service that hung as for an agent name mistyped in the workflow, which no worker will ever
    run (an agent is not checked at definition: a worker of another app may run it)."""
    why = f"attempt {x['attempt']} passed complete-by"
    req = tx.one("request_of_attempt", task_id=x["task_id"], idx=x["idx"], attempt=x["attempt"])
    if req is None or req["state"] != "queued":
        return why
    agent = str(req["agent"])
    if tx.one("agent_instance_live", agent=agent, silent=SILENT_AFTER) is None:
        return (
            f"{why}, its request never taken: no worker runs agent {agent!r} (is that the agent's name,"
            " and is a worker with it running?)"
        )
    return (
        f"{why}, its request never taken by agent {agent!r}: its instances were busy, unhealthy or"
        f" held back by an open breaker, or none has operation {req['operation']!r}"
    )


def rescue_orphans(
    tx: Tx,
    me: str,
    lease: str,
    term: int,
    worker: str,
    reason: str,
    limit: int,
    rng: random.Random,
    silent_for: float | None = None,
) -> SweepResult:
    """Rescue the in-flight attempts of a worker presumed dead (see ``liveness``) without waiting
    for their complete-by: the same fenced transition as an expiry, counted as a failure (a step
    that kills its worker must not loop forever), but retried without back-off: the remote
    service did nothing wrong, so there is nothing to spare it from."""
    leader_fence(tx, me, lease, term)
    out = SweepResult()
    if not _still_silent(tx, worker, silent_for):
        return out  # it beat again since it was judged: alive after all
    found = tx.all("orphaned_steps", worker=worker, limit=limit)
    out.examined = len(found)
    for x in found:
        why = f"attempt {x['attempt']} was taken by worker {worker}, presumed dead: {reason}"
        _rescue(
            tx, x, me, term, rng, out, "still_orphaned", {"worker": worker}, partial(str, why), immediate=True
        )
    return out


def _still_silent(tx: Tx, worker: str, silent_for: float | None) -> bool:
    """A worker presumed dead by its heartbeat's age (``silent_for``: the bound it passed) is
    still silent, or stopped, by the database's clock now; a verdict of another kind stands."""
    if silent_for is None:
        return True
    return tx.one("worker_still_silent", worker=worker, silent_for=silent_for) is not None


def fence(tx: Tx, me: str, lease: str, term: int) -> None:
    """Raise LostOwnership unless ``me`` still holds ``lease`` with ``term``, unexpired on the
    database clock (LEAD4), before the transaction writes anything. On PostgreSQL ``lease_holds``
    also share-locks the lease row until commit, so a successor's acquire waits for this
    transaction (SQLite's ``BEGIN IMMEDIATE`` serialises them). Every leader's writes use it: the
    supervisor's and the alert dispatcher's through :func:`leader_fence`, an application's
    through ``tx.fence(lead)``."""
    if tx.one("lease_holds", name=lease, holder=me, term=term) is None:
        raise LostOwnership(f"lease {lease!r} term {term} is no longer held by {me}")


def leader_fence(tx: Tx, me: str, lease: str, term: int) -> None:
    """:func:`fence` for the transactions of stepwarden's own leader work (the supervisor's, the
    alert dispatcher's). The share lock on the lease row also holds up the holder's own renewal
    (an UPDATE of that row) until this transaction ends, and the heartbeat that queues behind the
    renewal on the lease lane: a wait of a few seconds here cost the leader its lease and got
    its process presumed dead. So the supervisor's transactions take the rows others may hold
    with SKIP LOCKED and leave them to the next round (``task_for_sweep``, ``request_for_sweep``,
    ``prune_held_tasks``); the dispatcher's wait only on the supervisor's prune, which never
    waits itself. On PostgreSQL any wait that remains is cut at 1 s (``leader_lock_timeout``),
    which fails the transaction and writes nothing. An application's ``tx.fence`` keeps its
    session's limits: its block runs the application's own SQL."""
    if tx.dialect == "postgres":
        tx.put("leader_lock_timeout")
    fence(tx, me, lease, term)


def _rescue(
    tx: Tx,
    x: Row,
    me: str,
    term: int,
    rng: random.Random,
    out: SweepResult,
    recheck: str,
    params: dict[str, Any],
    why_of: Callable[[], str],
    *,
    immediate: bool = False,
) -> None:
    if tx.dialect == "postgres":  # SQLite's single writer holds no row locks to wait on
        # The task, then the attempt's request, each skipped if held (in one round trip), before
        # the re-check: a reply whose transaction holds the request commits after the check of a
        # sweep that waited for it, which then expired an attempt answered in time.
        key = {"task_id": x["task_id"], "idx": x["idx"], "attempt": x["attempt"]}
        tasks, request = tx.both(("task_for_sweep", {"task_id": x["task_id"]}), ("request_for_sweep", key))
        if tasks and request and request[0]["held"]:
            return  # its reply is being recorded: next sweep, which sees it if it commits
        task = tasks[0] if tasks else None
    else:
        task = tx.one("task_for_sweep", task_id=x["task_id"])
    if task is None:
        return  # held by another transaction: next sweep
    steps = tx.all("steps_of_task", task_id=x["task_id"])
    step = next(s for s in steps if s["idx"] == x["idx"])
    if tx.one(recheck, task_id=x["task_id"], idx=x["idx"], attempt=x["attempt"], **params) is None:
        return
    why = why_of()  # after the re-check: a candidate skipped here costs no reads for its reason
    tx.put("expire_request", task_id=task["id"], idx=step["idx"], attempt=step["attempt"])
    now = tx.one("now")
    event(
        tx,
        "rescued",
        task["id"],
        me,
        step["idx"],
        step["attempt"],
        step=step["name"],
        term=term,
        complete_by=x["complete_by"],
        late_by=(now or {}).get("now", 0) - x["complete_by"],
        reason=why[:300],
    )
    what = fail_attempt(
        tx, task, step, why, me, rng, permanent=False, out_alerts=out.alerts, immediate=immediate
    )
    out.rescued += 1
    out.escalated += what != "retry"
    if task["state"] in FINAL_TASK_STATES:
        out.finished.append((int(task["id"]), str(task["state"])))


def prune(
    tx: Tx, me: str, lease: str, term: int, retention: float, limit: int, unread: list[Row] | None = None
) -> int:
    """Delete up to ``limit`` tasks finished more than ``retention`` seconds ago, with every row
    they own, so the hot tables stay the size of the live work. Leader-only and term-fenced, so
    two supervisors never prune at once; bounded, so a large backlog is many small transactions.

    ``unread`` (a list) gets, per named consumer of a reply queue, how many of the messages
    deleted it had not read (``queue``, ``consumer``, ``position``, ``n``): a consumer that lags
    by more than the retention loses them, and the leader says so rather than nobody."""
    leader_fence(tx, me, lease, term)
    if unread is not None:
        unread.clear()  # a transaction tried again reports its own try's, not the sum
    found = [int(r["id"]) for r in tx.all("prunable_tasks", retention=retention, limit=limit)]
    ids = found
    if found and tx.dialect == "postgres":  # SQLite's single writer holds no row locks to wait on
        held = {int(r["task_id"]) for r in tx.all("prune_held_tasks", ids=json.dumps(found))}
        ids = [i for i in found if i not in held]
    if ids:
        text = json.dumps(ids)
        for table in ("steps", "requests", "replies"):
            tx.put("prune_" + table, ids=text)
        _add_event_totals(tx, tx.all("prune_events", ids=text))
        if unread is not None:
            unread.extend(tx.all("prune_unread_messages", ids=text))
        for table in ("messages", "tasks"):
            tx.put("prune_" + table, ids=text)
    return len(ids)


def _add_event_totals(tx: Tx, deleted: list[Row]) -> int:
    """Add the events just deleted (rows of ``kind``, ``n``) to ``event_totals``, in the deleting
    transaction: the metrics' counters are ``event_totals`` plus the events stored, so a prune
    never lowers them (Prometheus would read a lower total as a reset). Returns how many."""
    kinds: dict[str, int] = {}
    for r in deleted:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + int(r["n"])
    for kind, n in sorted(kinds.items()):  # in key order: no deadlock between two such writers
        tx.run("add_event_totals", kind=kind, n=n)
    return sum(kinds.values())


# The records pruned by age alone, in this order: agent instances go after their workers.
AGED_RECORDS = ("workers", "agent_instances", "taskless_events", "lease_terms")


def prune_records(tx: Tx, me: str, lease: str, term: int, retention: float, limit: int) -> dict[str, int]:
    """Delete up to ``limit`` rows of each record that outlives its tasks, once past ``retention``:
    workers long silent (and their agent instances), events with no task, ended lease terms, and
    alerts no one needs (acknowledged, or their task pruned). Without it these grow for as long as
    the store lives, however small the live work. Leader-only and term-fenced, as ``prune``."""
    leader_fence(tx, me, lease, term)
    out: dict[str, int] = {}
    for name in AGED_RECORDS:
        if name == "taskless_events":  # counted as they go, as a task's events are (see prune)
            deleted = tx.all("prune_taskless_events", retention=retention, limit=limit)
            out[name] = _add_event_totals(tx, deleted)
        else:
            out[name] = tx.run("prune_" + name, retention=retention, limit=limit)
    alerts = [int(r["id"]) for r in tx.all("prunable_alerts", retention=retention, limit=limit)]
    if alerts:
        text = json.dumps(alerts)
        tx.run("prune_alert_deliveries", ids=text)
        tx.run("prune_alerts", ids=text)
    out["alerts"] = len(alerts)
    return out


@read_only
def owners_in_flight(tx: Tx) -> list[Row]:
    """The workers holding taken requests, each row with the database's ``now``. Read-only: on
    SQLite it waits for no writer (the rescue re-checks each verdict in its own transaction)."""
    return tx.all("owners_in_flight")


def lease_holder(tx: Tx, name: str) -> Row | None:
    """The worker holding lease ``name`` (unexpired), with its liveness columns and ``now``."""
    return tx.one("lease_holder", name=name)


def take_lease(
    tx: Tx, name: str, holder: str, dead: str, term: int, ttl: float, silent_for: float | None = None
) -> tuple[int, float] | None:
    """Take lease ``name`` from ``dead`` (presumed dead) if it still holds ``term``; see ``lease_take``."""
    if not _still_silent(tx, dead, silent_for):
        return None
    row = tx.one("lease_take", name=name, holder=holder, dead=dead, term=term, ttl=ttl)
    if row is None:
        return None
    new = int(row["term"])
    tx.run("term_end", name=name, term=new - 1)
    tx.run("term_begin", name=name, term=new, holder=holder)
    event(tx, "lease_acquired", None, holder, lease=name, term=new, taken_from=dead)
    return new, float(row["expires_at"])


for _fn in (lease_holder, take_lease):
    setattr(_fn, "stepwarden_lane", "lease")  # noqa: B010 - read by Store.transact: never queue behind work


@read_only
def fleet_gaps(tx: Tx, silent: float, late: float) -> tuple[bool, bool]:
    """Whether work waits on a role no live worker runs: (tasks ready more than ``late`` seconds
    ago and no scheduler; attempts more than ``late`` seconds past their complete-by and no
    supervisor). The work is read only when a role is missing: those reads may walk a backlog."""
    roles = tx.one("fleet_roles", silent=silent, scheduler="%,scheduler,%", supervisor="%,supervisor,%")
    assert roles is not None
    unclaimed = not roles["scheduler"] and bool(_found(tx.one("fleet_unclaimed", late=late)))
    overdue = not roles["supervisor"] and bool(_found(tx.one("fleet_overdue", late=late)))
    return unclaimed, overdue


def _found(row: Row | None) -> bool:
    return row is not None and bool(row["found"])
