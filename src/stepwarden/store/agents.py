"""Agent instances and their shared circuit breakers, in the store (AGT3, AGT6).

Two failures, two answers, both decided from rows every instance can see:

- **The remote service fails.** Failures from every instance of an agent count toward ONE breaker
  row (``agent_breakers``). The failure that reaches the threshold opens it with a conditional
  ``UPDATE ... WHERE state = 'closed'``: exactly one instance's statement changes the row, and only
  that instance raises the ``breaker_opened`` alert. Every instance reads the row when it pulls, so
  all of them stop pulling the agent's requests at once. After the cool-off (``retry_at``, on the
  database clock) one instance wins the conditional claim of the half-open trial; its success
  closes the breaker for all (``breaker_closed``), its failure opens it for another cool-off.
  The failure that reaches the threshold opens it only if at least two live instances are failing
  (or the agent has one instance): one instance alone cannot open the breaker for all. Only
  instances that called the service within ``stale_after`` count: an idle one (or one whose
  version lacks the operation) says nothing about the service, and counted, it kept the breaker
  closed for good while the others' calls failed.
- **Only this instance's calls fail** (its own network path, say). A failure made while another
  live, healthy instance of the same agent has succeeded since this one began failing (and has not
  failed since) is not the service's fault: it does not count toward the breaker. After
  ``unhealthy_after`` failures in a row the instance marks itself unhealthy
  (``agent_instances.healthy = 0``) and stops pulling that agent's requests, so the work goes to
  healthy instances; it probes again after ``probe_at``. A failure of an unhealthy instance with
  no such witness left (the others stopped, went silent or fail too) is the service's like any
  other: the instance is healthy again, and the failure counts.

The functions here run inside one transaction each (``store.transact(fn, ...)``); the agent role
(``agent_role.py``, ``agent_health.py``) keeps a local mirror of what they return.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..liveness import SILENT_AFTER  # an instance this long silent is listed only with include_stopped
from .base import ApplyResult, RequestMsg, Row, Tx, hot, read_only
from .core import Want as Want
from .core import _record_replies, _requests
from .core import ops_json as ops_json
from .records import alert, event
from .views import iso


@dataclass(frozen=True)
class BreakerView:
    """One agent's shared breaker as read in a transaction; ``retry_in`` is seconds on the database
    clock until a trial may be claimed (None when closed); ``due_for``, seconds since the trial
    first fell due, a cool-off after the breaker (re)opened, however often it was claimed and
    given back since (None when closed)."""

    agent: str
    state: str
    failures: int
    retry_in: float | None
    opened_by: str | None = None
    trial_by: str | None = None
    due_for: float | None = None

    @classmethod
    def of(cls, r: Row) -> BreakerView:
        closed = r["state"] == "closed" or r["due_for"] is None
        return cls(
            agent=str(r["agent"]),
            state=str(r["state"]),
            failures=int(r["failures"]),
            retry_in=None if r["retry_in"] is None else float(r["retry_in"]),
            opened_by=r["opened_by"],
            trial_by=r["trial_by"],
            due_for=None if closed else float(r["due_for"]),
        )


@dataclass(frozen=True)
class InstanceSpec:
    """What an instance registers for one agent: its capacity and its breaker settings."""

    agent: str
    capacity: int
    threshold: int
    cool_off: float


@dataclass
class PullResult:
    requests: list[RequestMsg] = field(default_factory=list)
    breakers: dict[str, BreakerView] = field(default_factory=dict)
    trials: set[str] = field(default_factory=set)  # agents whose trial this instance now holds
    workflows: dict[int, str] = field(default_factory=dict)  # task id -> workflow, if asked (tracing)


@dataclass(frozen=True)
class Report:
    """The outcome of one call to the service, as an instance reports it."""

    agent: str
    ok: bool
    error: str | None = None
    trial: bool = False
    ago: float = 0.0  # seconds between the call's end and this report
    successes: int = 1  # calls this report stands for (successes are written in batches)


@dataclass(frozen=True)
class Verdict:
    """What the store decided about a reported call."""

    breaker: BreakerView | None
    healthy: bool
    probe_in: float | None = None  # an unhealthy instance probes again after this many seconds
    opened: bool = False  # this report opened the breaker (and raised the alert)
    closed: bool = False  # this report's trial closed the breaker
    own_fault: bool = False  # the failure was judged this instance's own (others succeed)


@dataclass(frozen=True)
class HealthRules:
    unhealthy_after: int = 5  # own-fault failures in a row that make an instance unhealthy
    probe_after: float = 5.0  # seconds an unhealthy instance waits before probing again
    stale_after: float = 30.0  # an instance with no heartbeat for this long is not live
    trial_ttl: float = 60.0  # a trial whose claim is not renewed within this is open to others again


def register(tx: Tx, me: str, specs: Sequence[InstanceSpec]) -> None:
    """Register this worker's agent instances (capacity, heartbeat) and make sure each agent has
    its breaker row, with the threshold and cool-off of the agent's definition."""
    for s in specs:
        tx.run("agent_breaker_ensure", agent=s.agent, threshold=s.threshold, cool_off=s.cool_off)
        tx.run("agent_instance_upsert", worker=me, agent=s.agent, capacity=s.capacity)


def beat(tx: Tx, me: str, load: dict[str, tuple[int, int]]) -> None:
    """Heartbeat: ``{agent: (capacity, inflight)}``. An instance whose row is gone registers
    again: a worker stalled (SIGSTOP, a suspended VM) past the record retention had its rows
    pruned as a dead worker's, and without them its capacity and health would stay invisible to
    operators until it restarted (its worker row comes back the same way, ``worker_beat``)."""
    for agent, (capacity, inflight) in load.items():
        row = {"worker": me, "agent": agent, "capacity": capacity, "inflight": inflight}
        if tx.run("agent_instance_beat", **row) == 0:
            tx.run("agent_instance_upsert", worker=me, agent=agent, capacity=capacity)
            tx.run("agent_instance_beat", **row)


def stop(tx: Tx, me: str) -> None:
    tx.run("agent_instances_stop", worker=me)


def breakers(tx: Tx) -> dict[str, BreakerView]:
    return {str(r["agent"]): BreakerView.of(r) for r in tx.all("agent_breakers_all")}


@hot
def pull(
    tx: Tx, me: str, wants: dict[str, Want], rules: HealthRules, with_workflows: bool = False
) -> PullResult:
    """Claim requests for the agents whose shared breaker lets them through, in one transaction:
    closed, up to ``room``; open past its cool-off, ONE request as the trial, if this instance wins
    the conditional claim of it. The breaker rows read are returned for the caller's mirror."""
    out = PullResult(breakers=breakers(tx))
    for agent, want in wants.items():
        b = out.breakers.get(agent)
        if b is None or b.state == "closed":
            out.requests += _claim(tx, me, agent, want, want.room)
            continue
        if not want.may_trial or b.retry_in is None or b.retry_in > 0:
            continue
        # A healthy instance that pulls takes a trial the moment it is due; one still not run
        # trial_unclaimed after it fell due (untaken, or taken and given back for want of a
        # request of the taker's operations), while a request of ours has waited as long, is
        # one the healthy instances cannot run, and waiting on them would keep the breaker open
        # for as long as that lasts. A trial that was run and failed reopened the breaker, which
        # starts the count again; so does a request that has just come (until then there was
        # nothing to try, and the healthy instances gave the trial back for that reason alone).
        due_for = b.due_for if b.due_for is not None else -b.retry_in
        unclaimed = (
            want.trial_unclaimed > 0
            and due_for >= want.trial_unclaimed
            and tx.one("agent_request_waiting", agent=agent, ops=want.ops, waited=want.trial_unclaimed)
            is not None
        )
        alone = (
            not want.trial_if_alone
            or unclaimed
            or not tx.one("agent_healthy_others", agent=agent, me=me, stale=rules.stale_after)
        )
        if not alone:
            continue  # a healthy instance runs the trial: the service is not to blame for our path
        if not tx.run("agent_breaker_trial", agent=agent, me=me, trial_ttl=rules.trial_ttl):
            continue  # another instance took the trial
        got = _claim(tx, me, agent, want, 1)
        if not got:
            tx.run("agent_breaker_untrial", agent=agent, me=me)
            continue
        out.requests += got
        out.trials.add(agent)
        out.breakers[agent] = BreakerView(agent, "half_open", b.failures, rules.trial_ttl, b.opened_by, me)
        event(tx, "breaker_trial", None, me, agent=agent, request=got[0].id)
    if with_workflows and out.requests:
        out.workflows = task_workflows(tx, sorted({m.task_id for m in out.requests}))
    return out


@read_only
def task_workflows(tx: Tx, ids: Sequence[int]) -> dict[int, str]:
    """The workflow of each of the tasks ``ids`` (for the attempts' trace spans)."""
    if not ids:
        return {}
    marks = ", ".join("?" for _ in ids)
    rows = tx.sql(f"SELECT id, workflow FROM tasks WHERE id IN ({marks})", tuple(ids))
    return {int(r["id"]): str(r["workflow"]) for r in rows}


def _claim(tx: Tx, me: str, agent: str, want: Want, limit: int) -> list[RequestMsg]:
    return _requests(tx.all("claim_agent_requests", me=me, agent=agent, ops=want.ops, limit=limit), tx.waited)


def renew_trial(tx: Tx, me: str, agent: str, trial_ttl: float) -> bool:
    """Extend the claim ``me`` holds on the agent's half-open trial by ``trial_ttl`` from now,
    while its call runs (see ``AgentHealth._hold_trial``). False if the trial is not ``me``'s
    any more: its claim lapsed and another instance took it, or it was decided."""
    return bool(tx.run("agent_breaker_trial_renew", agent=agent, me=me, trial_ttl=trial_ttl))


def return_trials(tx: Tx, me: str, agents: Sequence[str], why: str) -> list[str]:
    """Give back the half-open trials ``me`` holds for ``agents``, unrun: open to any instance at
    once. For a pull whose commit was not confirmed (its connection lost with COMMIT's answer): it
    may have won a trial the instance does not know it holds, and the request it took for it was
    handed back unrun, so the trial said nothing about the service. Left alone, no instance could
    try the service until ``trial_ttl`` passed. Returns the agents whose trial was given back."""
    out: list[str] = []
    for agent in agents:
        if tx.run("agent_breaker_untrial", agent=agent, me=me):
            event(tx, "breaker_trial_returned", None, me, agent=agent, reason=why)
            out.append(agent)
    return out


def report(tx: Tx, me: str, r: Report, threshold: int, cool_off: float, rules: HealthRules) -> Verdict:
    """Record one call's outcome and apply the rules in the module docstring."""
    if r.ok:
        return _report_ok(tx, me, r)
    row = tx.one("agent_instance_fail", me=me, agent=r.agent, ago=r.ago, error=(r.error or "")[:1000])
    if row is None:  # not registered (a role used without run()): register and count it now
        return Verdict(breaker=None, healthy=True)
    failures, since, healthy = int(row["failures"]), float(row["failing_since"]), bool(row["healthy"])
    others = tx.one("agent_others_ok", agent=r.agent, me=me, stale=rules.stale_after, since=since)
    if others is not None and int(others["n"]) > 0:
        # The service answers others: this instance's own path is at fault. It does not count
        # toward the shared breaker; enough of it in a row makes the instance unhealthy.
        if r.trial:  # a trial that says nothing about the service: give it back at once
            tx.run("agent_breaker_untrial", agent=r.agent, me=me)
        probe_in: float | None = None
        if failures >= rules.unhealthy_after or not healthy:
            tx.run("agent_instance_unhealthy", me=me, agent=r.agent, cool_off=rules.probe_after)
            probe_in = rules.probe_after
            if healthy:
                event(tx, "instance_unhealthy", None, me, agent=r.agent, failures=failures, reason=r.error)
        return Verdict(_breaker(tx, r.agent), probe_in is None, probe_in, own_fault=True)
    reason = (r.error or "")[:300]
    if not healthy and tx.run("agent_instance_recovered", me=me, agent=r.agent):
        # "Unhealthy" meant: others succeed where this instance fails. No live, healthy instance
        # has succeeded since its failures began any more (they stopped, went silent or fail
        # too), so nothing tells this instance from the service: its failure counts toward the
        # breaker like anyone's, and its attempt is retried, counted. Left unhealthy, it handed
        # every probe back uncounted, and a task whose service stayed down never escalated.
        why = "no live instance succeeds where it fails"
        event(tx, "instance_healthy", None, me, agent=r.agent, reason=why)
        healthy = True
    opened = False
    if r.trial:
        if tx.run("agent_breaker_reopen", agent=r.agent, me=me, cool_off=cool_off, reason=reason):
            event(tx, "breaker_reopened", None, me, agent=r.agent, reason=reason)
    else:
        row = tx.one("agent_failing_spread", agent=r.agent, me=me, stale=rules.stale_after)
        live, failing = (int(row["live"]), int(row["failing"])) if row else (1, 1)
        spread = 1 if failing >= min(2, live) else 0
        got = tx.one(
            "agent_breaker_fail",
            agent=r.agent,
            me=me,
            threshold=threshold,
            cool_off=cool_off,
            reason=reason,
            spread=spread,
        )
        if got is not None and got["state"] == "open":
            opened = True  # this statement moved closed -> open: this instance alone raises the alert
            event(tx, "breaker_opened", None, me, agent=r.agent, reason=reason)
            alert(
                tx,
                "breaker_opened",
                None,
                None,
                f"circuit breaker of agent {r.agent!r} opened for every instance after {threshold} "
                f"failures in a row (last: {reason}); a trial call is made after {cool_off:g}s",
            )
    return Verdict(_breaker(tx, r.agent), healthy, opened=opened)


def _report_ok(tx: Tx, me: str, r: Report) -> Verdict:
    if tx.run("agent_instance_recovered", me=me, agent=r.agent):
        event(tx, "instance_healthy", None, me, agent=r.agent)
    tx.run("agent_instance_ok", me=me, agent=r.agent, n=r.successes, ago=r.ago)
    closed = False
    if r.trial:
        closed = bool(tx.run("agent_breaker_close", agent=r.agent, me=me))
        if closed:
            event(tx, "breaker_closed", None, me, agent=r.agent, reason="a trial call succeeded")
    else:
        tx.run("agent_breaker_reset", agent=r.agent)
    return Verdict(_breaker(tx, r.agent), True, closed=closed)


def _breaker(tx: Tx, agent: str) -> BreakerView | None:
    return breakers(tx).get(agent)


@dataclass
class HandBack:
    """What :func:`hand_back_dispatched` did in one transaction: ``found`` requests still queued,
    ``handed`` of them handed back (the rest were taken by an agent meanwhile, and left to it), and
    what applying the releases did (``applied``: its alerts are the caller's to log)."""

    found: int = 0
    handed: int = 0
    applied: ApplyResult | None = None


def hand_back_dispatched(tx: Tx, me: str, why: str, limit: int, rng: random.Random) -> HandBack:
    """Hand back, uncounted, up to ``limit`` attempts that the stopping worker ``me`` dispatched
    and that no agent has taken yet (DEP4).

    A worker stopping gracefully still applies its last replies, so their results are durable,
    and applying a reply dispatches the task's next step; but its own agents take nothing more
    by then. Left alone, such a request waits, with the task and step locked by an identity that
    is gone, until another worker's agent takes it or, with no live instance of its agent, until
    its complete-by, when the supervisor rescues it as a FAILED attempt: a routine restart would
    count a failure (and end a task with ``max_failures=1`` in ``error``). Handed back here, the
    step is ``pending`` and the task unlocked, claimable at once by any scheduler.

    It is the agent's own hand-back (a ``released`` reply), applied in the same transaction, as
    a worker that also schedules applies its agents' replies: the step's attempt is checked
    (SCH4), ``release_attempt`` moves step and task back without counting a failure, the request
    is marked replied. Each request is first taken from the queue by a conditional update (still
    ``queued``), after its task is locked (tasks before requests, in id order, as every
    transition): one that another worker's agent took in the meantime is left to that agent.
    Attempts past their complete-by are not touched; they are the supervisor's. The releases may
    apply, like any batch, replies already waiting in the table, which can dispatch further steps
    by ``me``: the caller repeats until a transaction finds nothing. ``limit`` bounds the
    transaction (SUP6)."""
    now = float(tx.all("now")[0]["now"])  # the database's clock (DESIGN principle 3)
    rows = tx.sql(
        "SELECT id, task_id FROM requests WHERE state = 'queued' AND dispatched_by = ? AND complete_by > ?"
        " ORDER BY task_id, id LIMIT ?",
        (me, now, limit),
    )
    out = HandBack(found=len(rows))
    if not rows:
        return out
    for task_id in sorted({int(r["task_id"]) for r in rows}):
        tx.one("task_for_update", task_id=task_id)
    ids = [int(r["id"]) for r in rows]
    marks = ", ".join("?" for _ in ids)  # placeholders only: the values go as parameters
    taken = tx.sql(
        f"UPDATE requests SET state = 'taken', taken_by = ?, taken_at = ? WHERE id IN ({marks})"
        " AND state = 'queued' RETURNING id",
        (me, now, *ids),
    )
    handed = sorted(int(r["id"]) for r in taken)
    out.handed = len(handed)
    if handed:
        out.applied = _record_replies(tx, me, [(i, "released", None, why) for i in handed], True, rng)
        # Taken above only to go through the reply path: no agent took them, so no call reached
        # the service, and a compensation must not count them as reached (undo.reached_steps).
        back = ", ".join("?" for _ in handed)
        tx.sql(f"UPDATE requests SET taken_by = NULL, taken_at = NULL WHERE id IN ({back})", tuple(handed))
    return out


# -- views for operators (CLI, dashboard, metrics) ---------------------------------------------------


@read_only
def list_agents(tx: Tx, include_stopped: bool = False) -> dict[str, list[dict[str, Any]]]:
    """``{"breakers": [...], "instances": [...]}``: each agent's shared breaker, and every live
    agent instance with its capacity, health, requests in flight and last success and failure
    (``include_stopped``: also those stopped, or silent for ``SILENT_AFTER`` seconds)."""
    out_b = [
        {
            "agent": r["agent"],
            "state": r["state"],
            "failures": int(r["failures"]),
            "threshold": int(r["threshold"]),
            "cool_off": float(r["cool_off"]),
            "since": iso(r["changed_at"]),
            "opened_at": iso(r["opened_at"]),
            "opened_by": r["opened_by"],
            "trial_by": r["trial_by"],
            "retry_in": None if r["retry_in"] is None else round(float(r["retry_in"]), 3),
            "reason": r["reason"],
            "opens": int(r["opens"]),
        }
        for r in tx.all("agent_breakers_all")
    ]
    instances = []
    for r in tx.all("agent_instances_all"):
        now = float(r["now"])
        gone = r["stopped_at"] is not None or now - float(r["heartbeat_at"]) > SILENT_AFTER
        if gone and not include_stopped:  # stopped, or killed without a word
            continue
        instances.append(
            {
                "worker": r["worker"],
                "agent": r["agent"],
                "capacity": int(r["capacity"]),
                "inflight": int(r["inflight"]),
                "healthy": bool(r["healthy"]),
                "failures": int(r["failures"]),
                "successes_total": int(r["successes_total"]),
                "failures_total": int(r["failures_total"]),
                "last_success_at": iso(r["last_success_at"]),
                "last_failure_at": iso(r["last_failure_at"]),
                "last_error": r["last_error"],
                "unhealthy_since": iso(r["unhealthy_since"]),
                "probe_in": None if r["probe_at"] is None else round(float(r["probe_at"]) - now, 3),
                "heartbeat_age": round(now - float(r["heartbeat_at"]), 3),
                "stopped_at": iso(r["stopped_at"]),
            }
        )
    return {"breakers": out_b, "instances": instances}
