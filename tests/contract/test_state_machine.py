"""A Hypothesis state machine over the real store, on SQLite AND PostgreSQL, against a small model.

Rules -- random interleavings of what every role does to the store:

* ``submit``: a 2-3 step workflow, steps with and without compensations, on_error ``error`` or
  ``compensate``, 1-3 failures allowed, escalation error/compensate/wait; sometimes a repeated
  idempotency key (SUB3);
* ``scheduler_a`` / ``scheduler_b``: a scheduler round (``Store.schedule``: apply replies, then
  claim and dispatch, in one transaction) by one of two schedulers;
* ``agent_1`` / ``agent_2``: an agent instance takes requests, or answers one it holds with
  ``ok``, a permanent ``error``, ``retry`` (transient failures exhausted) or ``released``, after a
  call that is fast, lasts exactly until complete-by, or ends just past it;
* ``worker_1`` / ``worker_2``: a worker running both roles does a whole round, its replies
  applied in the transaction that records them (``send_replies(apply=True)``);
* ``agent_replies_stale``: a superseded, late or duplicate answer;
* ``advance_clock``: the fake clock moves, by a fixed amount or exactly to a boundary (the next
  complete-by, just past it, just before the lease expires, to its expiry);
* ``supervisor``: the lease holder renews and sweeps (or a candidate acquires it and sweeps), a
  candidate acquires / renews / resigns, or sweeps under a deposed, expired or old term -- which
  must raise LostOwnership and change nothing (LEAD4);
* ``operator``: cancel or retry a task (or one that does not exist); refusals change nothing.

Each rule is applied to the store and to an executable model written from SPEC and
docs/concepts.md (``MTask``/``MStep``/... and the ``m_*`` methods). After every step the database
must equal the model -- every task, step, request and reply, their states, attempts, FailureCounts,
locks, deadlines and run-at times, the alerts and the lease -- and these invariants are checked on
the database's own rows:

* every task and step state is in SPEC's vocabulary;
* one terminal outcome per attempt: at most one accepted reply, never both accepted and expired;
* a completed step never runs again (no new ``do`` request) unless an operator retried it;
* no request is dispatched for a task that was final; only the current attempt of an in-flight
  step has a queued or taken request;
* FailureCount (of steps and tasks) never decreases -- an operator retry moves ``failure_offset``;
* compensations run in reverse order of completion: an undo starts only when every later started
  step with an undo is compensated; a compensated/cancelled task has nothing left undone;
* lease terms only increase, one holder per term, terms do not overlap, and every sweep that acted
  did so in the term of the holder that held it;
* every non-final task is either claimable or has exactly one attempt in flight (nothing stuck).

When an example ends, its audit trail is checked too: every ``rescued`` event names the term of the
holder that made it, and a task's reply queue starts with ``received`` and ends with its final state.

Time moves in multiples of 0.5 s and back-off has no jitter, so every deadline comparison is exact
on both databases. One store per backend; each example starts from empty tables.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, TypedDict

import pytest
from hypothesis import HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from stepwarden.clock import FakeClock
from stepwarden.errors import InputError, LostOwnership, NotFound
from stepwarden.policies import Backoff, Retry
from stepwarden.store import STEP_STATES, TASK_STATES, SQLiteStore, Store, open_store
from stepwarden.store import transitions as t
from stepwarden.store.sqlite_tx import SqliteTx
from stepwarden.workflow import Step, Workflow, encode_input

BUDGET = 10.0  # complete-by budget of every step
TTL = 15.0  # the supervisor lease
BACKOFF_INITIAL, BACKOFF_MAX = 5.0, 20.0  # 5, 10, 20, 20 ... exactly (no jitter)
ESCALATION_WAIT = 30.0
MAX_TASKS = 3
FINAL = frozenset({"processed", "error", "compensated", "cancelled"})
SCHEDULERS = ("sched-a:1:aaa", "sched-b:2:bbb")
AGENTS = ("agent-1:3:ccc", "agent-2:6:fff")
SUPERVISORS = ("sup-a:4:ddd", "sup-b:5:eee")
LEASE = "supervisor"
OPERATOR = "operator"
# A fixed budget for CI: the same examples every run (derandomize). PostgreSQL pays a network round
# trip per statement, so it runs fewer examples than SQLite; both finish in about the same time.
EXAMPLES = {"sqlite": 80, "postgres": 20}
SETTINGS = settings(
    max_examples=EXAMPLES["sqlite"],
    stateful_step_count=100,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)
Key = tuple[int, int, int]  # (task id, step index, attempt)


class AgentMove(TypedDict):
    """The strategies of an agent rule's arguments, by name."""

    take: st.SearchStrategy[bool]
    limit: st.SearchStrategy[int]
    i: st.SearchStrategy[int]
    outcome: st.SearchStrategy[str]
    slow: st.SearchStrategy[str]


def backoff(n: int) -> float:
    """The model's back-off before retry ``n``: 5 s, 10 s, then 20 s."""
    growth: float = 2 ** (n - 1)
    return min(BACKOFF_MAX, BACKOFF_INITIAL * growth)


# -- the model ---------------------------------------------------------------------------------------


@dataclass
class MStep:
    name: str
    compensate: bool
    on_error: str
    max_failures: int
    escalation: str | None
    state: str = "pending"
    attempt: int = 0
    failure_count: int = 0
    failure_offset: int = 0
    comp_failures: int = 0
    complete_by: float | None = None
    started: bool = False

    @property
    def in_flight(self) -> bool:
        return self.state in ("running", "compensating") and self.complete_by is not None


@dataclass
class MTask:
    id: int
    priority: int
    steps: list[MStep]
    run_at: float
    state: str = "pending"
    locked_by: str | None = None
    cancel_requested: bool = False
    failure_count: int = 0


@dataclass
class MRequest:
    task_id: int
    idx: int
    attempt: int
    kind: str
    priority: int
    complete_by: float
    state: str = "queued"
    outcome: str | None = None
    db_id: int = 0


@dataclass
class MReply:
    task_id: int
    idx: int
    attempt: int
    kind: str
    outcome: str
    received_at: float
    status: str = "new"
    must_be_stale: bool = False


@dataclass
class MLease:
    holder: str
    term: int
    expires_at: float


StepSpec = tuple[bool, str, int, str | None]

step_specs = st.tuples(
    st.sampled_from([True, True, False]),  # has a compensation
    st.sampled_from(["compensate", "error"]),  # on_error
    st.integers(1, 3),  # Retry.max_failures
    st.sampled_from([None, "compensate", "error", "wait"]),  # Retry.escalation
)


def build_workflow(specs: list[StepSpec]) -> Workflow:
    steps = []
    for i, (comp, on_error, max_failures, escalation) in enumerate(specs):
        retry = Retry(
            max_failures=max_failures,
            backoff=Backoff(initial=BACKOFF_INITIAL, multiplier=2.0, maximum=BACKOFF_MAX, jitter=0.0),
            escalation=escalation,  # type: ignore[arg-type]
            escalation_wait=ESCALATION_WAIT,
        )
        steps.append(
            Step(
                f"s{i}",
                f"svc.do_s{i}",
                complete_by=BUDGET,
                retry=retry,
                compensate=f"svc.undo_s{i}" if comp else None,
                on_error=on_error,  # type: ignore[arg-type]
            )
        )
    return Workflow.of("wf", steps)


def tables(tx: Any) -> list[str]:
    """Every table but the migrations' own, children first (steps reference tasks)."""
    rows = tx.sql(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        if isinstance(tx, SqliteTx)
        else "SELECT tablename AS name FROM pg_tables WHERE schemaname = current_schema()"
    )
    return sorted((r["name"] for r in rows if r["name"] != "schema_migrations"), key=lambda n: n != "steps")


def wipe(store: Store) -> None:
    def run(tx: Any) -> None:
        for table in tables(tx):
            tx.sql(f"DELETE FROM {table}")

    store.transact_sync(run)


WRITTEN = ("tasks", "steps", "requests", "replies", "alerts", "leases", "lease_terms")
APPENDED = ("events", "messages")


def snapshot(store: Store) -> dict[str, Any]:
    """Every row a transition could change, and the size of the append-only tables: to show that a
    refused or fenced call wrote nothing."""

    def run(tx: Any) -> dict[str, Any]:
        out: dict[str, Any] = {t: sorted(tx.sql(f"SELECT * FROM {t}"), key=repr) for t in WRITTEN}
        out.update({t: tx.sql(f"SELECT COUNT(*) AS n FROM {t}")[0]["n"] for t in APPENDED})
        return out

    return store.transact_sync(run)


# What the invariants read after every step: (columns, order) of each table, fetched as one JSON
# document in one query (one round trip instead of seven; time in the PostgreSQL run is round trips).
DUMP = {
    "tasks": ("id, state, locked_by, cancel_requested, failure_count, run_at", "id"),
    "steps": (
        "task_id, idx, state, attempt, failure_count, failure_offset, comp_failures, complete_by, "
        "started_at, compensate",
        "task_id, idx",
    ),
    "requests": ("id, task_id, step_idx, attempt, kind, state, outcome", "id"),
    "replies": ("id, task_id, step_idx, attempt, kind, outcome, status", "id"),
    "alerts": ("kind, task_id, step", "id"),
    "leases": ("name, holder, term, expires_at", "name"),
    "lease_terms": ("name, term, holder, acquired_at, ended_at", "name, term"),
}


def dump_query(dialect: str) -> str:
    parts = []
    for table, (cols, order) in DUMP.items():
        names = [c.strip() for c in cols.split(",")]
        if dialect == "sqlite":
            obj = "json_object(" + ", ".join(f"'{c}', {c}" for c in names) + ")"
            rows = (
                f"json((SELECT json_group_array({obj}) FROM (SELECT {cols} FROM {table} ORDER BY {order})))"
            )
        else:
            obj = "json_build_object(" + ", ".join(f"'{c}', {c}" for c in names) + ")"
            rows = f"(SELECT COALESCE(json_agg({obj} ORDER BY {order}), '[]'::json) FROM {table})"
        parts.append(f"'{table}', {rows}")
    func = "json_object" if dialect == "sqlite" else "json_build_object"
    return f"SELECT {func}({', '.join(parts)}) AS dump"


def read_all(tx: Any) -> dict[str, list[dict[str, Any]]]:
    dialect = "sqlite" if isinstance(tx, SqliteTx) else "postgres"
    dump = tx.sql(dump_query(dialect))[0]["dump"]
    db: dict[str, list[dict[str, Any]]] = json.loads(dump) if isinstance(dump, str) else dump
    db["lease"] = [r for r in db.pop("leases") if r["name"] == LEASE]
    db["terms"] = [r for r in db.pop("lease_terms") if r["name"] == LEASE]
    return db


def read_audit(tx: Any) -> dict[str, list[dict[str, Any]]]:
    """The append-only records, checked when an example ends."""
    return {
        "tasks": tx.sql("SELECT id, state FROM tasks ORDER BY id"),
        "terms": tx.sql("SELECT term, holder FROM lease_terms WHERE name = 'supervisor' ORDER BY term"),
        "rescues": tx.sql("SELECT actor, detail FROM events WHERE kind = 'rescued' ORDER BY id"),
        "messages": tx.sql("SELECT task_id, kind, body FROM messages ORDER BY id"),
        "steps": tx.sql("SELECT task_id, name, state FROM steps ORDER BY task_id, idx"),
    }


class StoreMachine(RuleBasedStateMachine):
    """The store under random interleavings of every role's verbs, checked against the model."""

    def __init__(self, store: Store, clock: FakeClock) -> None:
        super().__init__()
        self.store = store
        self.clock = clock
        self.loop = asyncio.new_event_loop()
        wipe(store)
        # the model
        self.tasks: dict[int, MTask] = {}
        self.requests: dict[Key, MRequest] = {}
        self.replies: list[MReply] = []
        self.alerts: list[tuple[str, int, str]] = []
        self.lease: MLease | None = None
        self.term_of: dict[str, int] = {}
        self.keys: dict[str, int] = {}
        self.held: dict[str, list[Key]] = {a: [] for a in AGENTS}  # taken, not yet answered
        self.taken: dict[Key, str] = {}  # every request ever taken, by whom
        # what the invariants remember between steps
        self.seen_requests: set[int] = set()
        self.done: set[tuple[int, int]] = set()  # completed steps not since retried by an operator
        self.last_state: dict[int, str] = {}
        self.failures: dict[tuple[int, int], int] = {}
        self.task_failures: dict[int, int] = {}
        self.undo_order: dict[int, list[int]] = {}
        self.undo_seen: set[int] = set()
        self.max_term = 0
        self.acted: dict[int, str] = {}

    def teardown(self) -> None:
        """At the end of each example, the audit trail: who acted in which term, and the reply queue
        (unless the example already failed: its own error is the one to report)."""
        try:
            if sys.exc_info()[0] is None:
                audit = self.store.transact_sync(read_audit)
                self._check_rescue_terms(audit)
                self._check_messages(audit)
        finally:
            self.loop.close()

    @property
    def now(self) -> float:
        return self.clock.wall()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    # -- model transitions (SPEC SCH, SUP, CMP; concepts.md "States") --------------------------
    def m_dispatch(self, task: MTask, idx: int, kind: str, me: str) -> None:
        s = task.steps[idx]
        s.attempt += 1
        s.state = "running" if kind == "do" else "compensating"
        s.complete_by = self.now + BUDGET
        s.started = True
        self.requests[(task.id, idx, s.attempt)] = MRequest(
            task.id, idx, s.attempt, kind, task.priority, s.complete_by
        )
        task.locked_by = me
        if kind == "do":
            task.state = "processing"

    def m_finish(self, task: MTask, state: str) -> None:
        task.state = state
        task.locked_by = None

    def m_advance(self, task: MTask, me: str) -> None:
        if task.state in ("pending", "processing") and task.cancel_requested:
            self.m_begin_compensation(task, me)
            return
        if task.state in ("pending", "processing"):
            for i, s in enumerate(task.steps):
                if s.state != "completed":
                    self.m_dispatch(task, i, "do", me)
                    return
            self.m_finish(task, "processed")
            return
        for i in reversed(range(len(task.steps))):
            s = task.steps[i]
            if s.started and s.compensate and s.state != "compensated":
                self.m_dispatch(task, i, "undo", me)
                return
        for s in task.steps:
            if s.started and s.state == "pending":  # started, never completed, no undo: given up
                s.state = "failed"
        self.m_finish(task, "cancelled" if task.cancel_requested else "compensated")

    def m_begin_compensation(self, task: MTask, me: str) -> None:
        for s in task.steps:
            if not s.started and s.state == "pending":
                s.state = "skipped"
        task.state = "compensating"
        task.locked_by = me
        self.m_advance(task, me)

    def m_fail(self, task: MTask, idx: int, me: str, *, permanent: bool) -> str:
        """A failed attempt: count it, then retry after a back-off or escalate."""
        s = task.steps[idx]
        undo = s.state == "compensating"
        delay = 0.0
        if undo:
            n = s.comp_failures + 1
            action = "retry" if not permanent and n < s.max_failures else "error"
            delay = backoff(n)
        elif task.cancel_requested:
            action = "compensate"
        elif permanent:
            action = s.on_error
        else:
            n = s.failure_count + 1 - s.failure_offset
            if n < s.max_failures:
                action, delay = "retry", backoff(n)
            else:
                action = s.escalation or s.on_error
                if action == "wait":
                    action, delay = "retry", ESCALATION_WAIT
                    if n == s.max_failures:  # once per escalation, not at every wait
                        self.alerts.append(("step_escalated", task.id, s.name))
        s.complete_by = None
        if undo:
            s.comp_failures += 1
        else:
            s.failure_count += 1
            task.failure_count += 1
        task.locked_by = None
        if action == "retry":
            s.state = task.state = "compensating" if undo else "pending"
            task.run_at = self.now + delay
            return "retry"
        s.state = "failed"
        task.run_at = self.now
        if action == "compensate":
            self.m_begin_compensation(task, me)
            return action
        self.m_finish(task, "error")
        self.alerts.append(("compensation_failed" if undo else "task_error", task.id, s.name))
        return "error"

    def m_release(self, task: MTask, idx: int) -> None:
        s = task.steps[idx]
        s.state = task.state = "compensating" if s.state == "compensating" else "pending"
        s.complete_by = None
        task.locked_by = None
        task.run_at = self.now

    def m_lease_holds(self, who: str, term: int) -> bool:
        lease = self.lease
        return lease is not None and (lease.holder, lease.term) == (who, term) and lease.expires_at > self.now

    # -- rules ----------------------------------------------------------------------------------
    @precondition(lambda self: len(self.tasks) < MAX_TASKS)
    @rule(
        specs=st.lists(step_specs, min_size=2, max_size=3),
        priority=st.sampled_from([0, 1, 5]),
        key=st.sampled_from([None, None, "key-1", "key-2"]),
    )
    def submit(self, specs: list[StepSpec], priority: int, key: str | None) -> None:
        wf = build_workflow(specs)
        n = len(self.tasks)
        task_id, created = self.store.transact_sync(
            t.submit,
            wf,
            encode_input({"n": n}),
            correlation_id=f"order-{n}",
            idempotency_key=key,
            priority=priority,
            reply_to="web-1",
        )
        if key is not None and key in self.keys:  # SUB3: the existing task, nothing written
            assert (task_id, created) == (self.keys[key], False)
            return
        assert created and task_id not in self.tasks
        steps = [
            MStep(s.name, s.compensate is not None, s.on_error, *spec[2:])
            for s, spec in zip(wf.steps, specs, strict=True)
        ]
        self.tasks[task_id] = MTask(task_id, priority, steps, run_at=self.now)
        if key is not None:
            self.keys[key] = task_id

    def _claimable(self) -> list[MTask]:
        return sorted(
            (
                x
                for x in self.tasks.values()
                if x.locked_by is None and x.state in ("pending", "compensating") and x.run_at <= self.now
            ),
            key=lambda x: (-x.priority, x.id),
        )

    def m_claim_and_dispatch(self, me: str, limit: int) -> int:
        claimable = self._claimable()[:limit]
        for task in claimable:
            if task.state == "pending":
                task.state = "processing"
            task.locked_by = me
            self.m_advance(task, me)
        return len(claimable)

    def _takeable(self) -> list[MRequest]:
        return sorted(
            (r for r in self.requests.values() if r.state == "queued" and r.complete_by > self.now),
            key=lambda r: (-r.priority, r.db_id),
        )

    def _take(self, me: str, limit: int) -> None:
        want = self._takeable()[:limit]
        msgs = self.run(self.store.claim_requests(me, ["svc"], limit))
        got = sorted((m.task_id, m.step_idx, m.attempt) for m in msgs)
        assert got == sorted((r.task_id, r.idx, r.attempt) for r in want), "the agent took other requests"
        for m in msgs:
            key = (m.task_id, m.step_idx, m.attempt)
            req = self.requests[key]
            assert req.db_id == m.id
            step = self.tasks[m.task_id].steps[m.step_idx]
            assert (m.kind, m.operation, m.idempotency_key) == (
                req.kind,
                f"{req.kind}_{step.name}",
                f"{m.task_id}:{step.name}",
            )
            assert m.remaining == pytest.approx(req.complete_by - self.now)
            req.state = "taken"
            self.held[me].append(key)
            self.taken[key] = me

    def _slow_call(self, keys: list[Key], slow: str) -> None:
        """The remote call takes time: until the earliest of these attempts' complete-by (a reply
        then is still in time, SCH4), or half a second past it (too late: stale)."""
        if slow == "fast" or not keys:
            return
        due = min(self.requests[k].complete_by for k in keys) + (0.5 if slow == "past complete-by" else 0.0)
        if due > self.now:
            self.clock.advance(due - self.now)

    def _agent(self, me: str, take: bool, limit: int, i: int, outcome: str, slow: str) -> None:
        held = self.held[me]
        if (take and self._takeable()) or not held:
            note(f"{me} takes up to {limit} request(s)")
            self._take(me, limit)
        else:
            key = held.pop(i % len(held))
            note(f"{me} answers {key} with {outcome!r} ({slow})")
            self._slow_call([key], slow)
            self._send(me, key, outcome, stale=False)

    # An agent instance's move: take up to ``limit`` queued requests (AGT6), or answer one it holds --
    # the current attempt, unless it expired meanwhile -- with ``ok``, a permanent ``error``, ``retry``
    # (transient failures exhausted inside the attempt) or ``released`` (graceful shutdown), after a
    # call that was fast or slow (see _slow_call). Whichever of the two it cannot do, it does the
    # other. Two instances, two rules (AGT1).
    slowness = st.sampled_from(
        ["fast", "fast", "fast", "fast", "fast", "until complete-by", "past complete-by"]
    )
    agent_move: AgentMove = {
        "take": st.booleans(),
        "limit": st.integers(1, 3),
        "i": st.integers(0, 7),
        "outcome": st.sampled_from(["ok", "ok", "ok", "error", "retry", "released"]),
        "slow": slowness,
    }

    @precondition(lambda self: self.held[AGENTS[0]] or self._takeable())
    @rule(**agent_move)
    def agent_1(self, take: bool, limit: int, i: int, outcome: str, slow: str) -> None:
        self._agent(AGENTS[0], take, limit, i, outcome, slow)

    @precondition(lambda self: self.held[AGENTS[1]] or self._takeable())
    @rule(**agent_move)
    def agent_2(self, take: bool, limit: int, i: int, outcome: str, slow: str) -> None:
        self._agent(AGENTS[1], take, limit, i, outcome, slow)

    def _send(self, me: str, key: Key, outcome: str, *, stale: bool) -> None:
        req = self.requests[key]
        result = {"by": me, "attempt": key[2]} if outcome == "ok" else None
        error = None if outcome == "ok" else f"{outcome} from the service"
        self.run(self.store.send_reply(me, req.db_id, outcome, result, error))
        self.replies.append(MReply(*key, req.kind, outcome, self.now, must_be_stale=stale))
        if req.state == "taken":
            req.state = "replied"

    def _worker_round(self, i: int, outcome: str, slow: str) -> None:
        sched, agent = SCHEDULERS[i], AGENTS[i]
        note(f"a worker round of {sched} and {agent}, answering {outcome!r} ({slow})")
        self._scheduler(sched, 50)
        self._take(agent, 50)
        keys, self.held[agent] = self.held[agent], []
        self._slow_call(keys, slow)
        batch = []
        for key in keys:
            req = self.requests[key]
            result = {"by": agent, "attempt": key[2]} if outcome == "ok" else None
            batch.append(
                (req.db_id, outcome, result, None if outcome == "ok" else f"{outcome} from the service")
            )
            self.replies.append(MReply(*key, req.kind, outcome, self.now))
            if req.state == "taken":
                req.state = "replied"
        applied = self.run(self.store.send_replies(agent, batch, apply=True))
        self.m_apply_replies(agent, len(batch), applied, own=len(batch))
        self._sync_request_ids()

    # A worker process running the scheduler and agent roles does one round in which nothing goes
    # wrong but ``outcome`` and ``slow``: a scheduler round, then its agent takes every queued request
    # and answers all it holds in one transaction that also applies them (AgentSettings.apply_replies:
    # the next steps are dispatched at once, by the agent's identity).
    worker_outcomes = st.sampled_from(["ok", "ok", "ok", "ok", "error", "retry", "released"])

    @precondition(lambda self: self._claimable() or self._takeable() or self.held[AGENTS[0]])
    @rule(outcome=worker_outcomes, slow=slowness)
    def worker_1(self, outcome: str, slow: str) -> None:
        self._worker_round(0, outcome, slow)

    @precondition(lambda self: self._claimable() or self._takeable() or self.held[AGENTS[1]])
    @rule(outcome=worker_outcomes, slow=slowness)
    def worker_2(self, outcome: str, slow: str) -> None:
        self._worker_round(1, outcome, slow)

    def _stale_candidates(self) -> list[Key]:
        out = []
        for key in self.taken:
            req = self.requests[key]
            step = self.tasks[key[0]].steps[key[1]]
            if step.attempt != key[2] or req.state in ("replied", "expired") or self.now > req.complete_by:
                out.append(key)
        return out

    @precondition(lambda self: self._stale_candidates())
    @rule(i=st.integers(0, 7), outcome=st.sampled_from(["ok", "error", "retry"]))
    def agent_replies_stale(self, i: int, outcome: str) -> None:
        """A slow or duplicate answer: a superseded attempt, one past complete-by, or a second reply."""
        candidates = self._stale_candidates()
        key = candidates[i % len(candidates)]
        me = self.taken[key]
        if key in self.held[me]:
            self.held[me].remove(key)
        self._send(me, key, outcome, stale=True)

    def _scheduler(self, me: str, limit: int) -> None:
        applied, claimed = self.run(self.store.schedule(me, limit))
        self.m_apply_replies(me, limit, applied)
        want = self.m_claim_and_dispatch(me, limit)
        assert claimed == want, f"claimed {claimed} task(s), the model expected {want}"
        self._sync_request_ids()  # the new requests' ids

    # One round of a scheduler, as SchedulerRole.tick: in one transaction, apply up to ``limit``
    # replies, then claim up to ``limit`` tasks and dispatch. Two scheduler instances, two rules (SCH1).
    @precondition(lambda self: self._claimable() or any(r.status == "new" for r in self.replies))
    @rule(limit=st.integers(1, 3))
    def scheduler_a(self, limit: int) -> None:
        self._scheduler(SCHEDULERS[0], limit)

    @precondition(lambda self: self._claimable() or any(r.status == "new" for r in self.replies))
    @rule(limit=st.integers(1, 3))
    def scheduler_b(self, limit: int) -> None:
        self._scheduler(SCHEDULERS[1], limit)

    def m_apply_replies(self, me: str, limit: int, result: Any, own: int = 0) -> None:
        """SCH4: only the current attempt's reply, received by its complete-by, is applied. ``own``:
        the last replies were sent by the applying transaction itself: all of them come, after up to
        ``limit`` of those waiting."""
        new = [r for r in self.replies if r.status == "new"]
        batch = new[: len(new) - own][:limit] + new[len(new) - own :]
        accepted = stale = 0
        for r in sorted(batch, key=lambda r: r.task_id):  # stable: by id within a task
            task = self.tasks[r.task_id]
            s = task.steps[r.idx]
            expect = "running" if r.kind == "do" else "compensating"
            current = (
                s.attempt == r.attempt
                and s.state == expect
                and s.complete_by is not None
                and r.received_at <= s.complete_by
                and task.state in ("processing", "compensating")
            )
            if not current:
                r.status = "stale"
                stale += 1
                continue
            assert not r.must_be_stale, f"the model accepted a stale reply {r}"
            r.status = "accepted"
            accepted += 1
            req = self.requests[(r.task_id, r.idx, r.attempt)]
            if req.outcome is None:
                req.outcome = r.outcome
            if r.outcome == "released":
                self.m_release(task, r.idx)
            elif r.outcome == "ok":
                s.state = "completed" if r.kind == "do" else "compensated"
                s.complete_by = None
                self.m_advance(task, me)
            else:
                self.m_fail(task, r.idx, me, permanent=r.outcome == "error")
        assert (result.accepted, result.stale) == (accepted, stale), (result, accepted, stale)

    @rule(
        dt=st.sampled_from(
            [
                0.5,
                0.5,
                2.5,
                5.0,
                10.0,
                10.5,
                "to the next complete-by",
                "just past the next complete-by",
                "just before the lease expires",
                "to the lease's expiry",
            ]
        )
    )
    def advance_clock(self, dt: float | str) -> None:
        """Time passes, by a fixed amount or exactly to a boundary: a reply at complete-by is in time
        but a sweep needs complete-by < now; a lease is free at expires_at but held just before."""
        if isinstance(dt, str):
            deadlines = [
                s.complete_by for x in self.tasks.values() for s in x.steps if s.complete_by is not None
            ]
            upcoming = [d for d in deadlines if d > self.now]
            target = {
                "to the next complete-by": min(upcoming, default=None),
                "just past the next complete-by": min(upcoming, default=-1.0) + 0.5,
                "just before the lease expires": self.lease.expires_at - 0.5 if self.lease else None,
                "to the lease's expiry": self.lease.expires_at if self.lease else None,
            }[dt]
            if target is None or target <= self.now:
                return
            dt = target - self.now
        self.clock.advance(dt)

    @rule(
        who=st.sampled_from(SUPERVISORS),
        action=st.sampled_from(
            ["lead", "lead", "sweep", "sweep with an old term", "acquire", "renew", "resign"]
        ),
    )
    def supervisor(self, who: str, action: str) -> None:
        """One move of a supervisor candidate (LEAD1-4, SUP1-3). ``lead``: what a live supervisor
        does each interval -- the holder of the lease renews it and sweeps; if nobody holds it, ``who``
        acquires it and sweeps. ``sweep``: ``who`` sweeps under the term it last acquired, which is
        fenced (LostOwnership, nothing written) unless it still holds the lease; ``sweep with an old
        term``: always fenced. ``acquire``, ``renew``, ``resign``: lease moves by ``who``. The lease
        expires when the clock passes it."""
        if action == "lead":
            held = self.lease is not None and self.lease.expires_at > self.now
            leader = self.lease.holder if held and self.lease is not None else who
            self._lease(leader, "renew" if held else "acquire")
            self._sweep(leader, self.term_of[leader])
        elif action == "sweep":
            self._sweep(who, self.term_of.get(who, 0))
        elif action == "sweep with an old term":
            self._sweep(who, self.term_of.get(who, 0) - 1)
        else:
            self._lease(who, action)

    def _sweep(self, who: str, term: int) -> None:
        if not self.m_lease_holds(who, term):  # deposed, expired, or never elected: fenced (LEAD4)
            before = snapshot(self.store)
            with pytest.raises(LostOwnership):
                self.store.transact_sync(t.sweep_expired, who, LEASE, term, 100, random.Random(0))
            assert snapshot(self.store) == before, "a fenced sweep changed the store"
            return
        new_replies = {(r.task_id, r.idx, r.attempt) for r in self.replies if r.status == "new"}
        expired = [
            (task, i)
            for task in sorted(self.tasks.values(), key=lambda x: x.id)
            for i, s in enumerate(task.steps)
            if s.in_flight
            and s.complete_by is not None
            and s.complete_by < self.now
            and (task.id, i, s.attempt) not in new_replies
        ]
        result = self.store.transact_sync(t.sweep_expired, who, LEASE, term, 100, random.Random(0))
        escalated = 0
        for task, i in expired:
            req = self.requests[(task.id, i, task.steps[i].attempt)]
            if req.outcome is None:
                req.state = req.outcome = "expired"
            escalated += self.m_fail(task, i, who, permanent=False) != "retry"
        assert (result.rescued, result.escalated) == (len(expired), escalated), (result, expired)
        assert self.acted.setdefault(term, who) == who, f"two supervisors acted in term {term}"

    def _lease(self, who: str, action: str) -> None:
        term = self.term_of.get(who, 0)
        if action == "acquire":
            got = self.run(self.store.acquire_lease(LEASE, who, TTL))
            if self.lease is None or self.lease.expires_at <= self.now:
                term = (self.lease.term if self.lease else 0) + 1
                self.lease = MLease(who, term, self.now + TTL)
                self.term_of[who] = term
                assert got == (term, self.now + TTL), got
            else:
                assert got is None, f"{who} acquired a lease {self.lease} still holds"
        elif action == "renew":
            ok = self.run(self.store.renew_lease(LEASE, who, term, TTL))
            assert ok == self.m_lease_holds(who, term)
            if ok:
                assert self.lease is not None
                self.lease.expires_at = self.now + TTL
        else:
            self.run(self.store.resign_lease(LEASE, who, term))
            if self.lease is not None and (self.lease.holder, self.lease.term) == (who, term):
                self.lease.expires_at = self.now

    def _pick(self, i: int) -> int:
        ids = sorted(self.tasks)
        return ids[i % len(ids)] if i < 12 else 999_999  # now and then, a task that does not exist

    @precondition(
        lambda self: any(x.state in FINAL or x.steps[0].state == "completed" for x in self.tasks.values())
    )
    @rule(
        action=st.sampled_from(["cancel", "retry"]),
        i=st.integers(0, 12),
        step=st.sampled_from([None, None, "s0", "s1", "s2", "zz"]),
    )
    def operator(self, action: str, i: int, step: str | None) -> None:
        """An operator cancels (CMP4) or retries (OPS2) a task, now and then one that does not exist.
        Operators act once some task has got somewhere (a first step completed, or a final state)."""
        if action == "cancel":
            self._cancel(self._pick(i))
        else:
            self._retry(self._pick(i), step)

    def _cancel(self, task_id: int) -> None:
        task = self.tasks.get(task_id)
        refused = task is None or task.state in ("processed", "compensated", "cancelled")
        # Being undone because a step failed: a cancel would only rename the outcome (refused);
        # asked already and on its way: nothing new to write.
        undoing = task is not None and task.state == "compensating" and not task.cancel_requested
        asked = task is not None and task.cancel_requested and task.state not in FINAL
        if refused or undoing or asked:
            before = snapshot(self.store)
            if refused or undoing:
                with pytest.raises(NotFound if task is None else InputError):
                    self.store.transact_sync(t.cancel_task, task_id, OPERATOR)
            else:
                assert task is not None
                assert self.store.transact_sync(t.cancel_task, task_id, OPERATOR) == task.state
            assert snapshot(self.store) == before, "a refused or repeated cancel changed the store"
            return
        assert task is not None
        now_state = self.store.transact_sync(t.cancel_task, task_id, OPERATOR)
        if self._reopen_undos(task):
            # It ended in error while being undone: the undo resumes, with a fresh budget, as a
            # retry resumes it; one a step's failure began still ends compensated, which says why.
            pass
        elif task.state == "error" or (task.state == "pending" and task.locked_by is None):
            task.cancel_requested = True
            for s in task.steps:
                if not s.started and s.state == "pending":
                    s.state = "skipped"
            task.state = "compensating"
            task.locked_by = None
            task.run_at = 0.0
        else:
            task.cancel_requested = True  # a step is running: the undo begins when its reply is applied
        assert now_state == task.state

    def _retry(self, task_id: int, step: str | None) -> None:
        task = self.tasks.get(task_id)
        start = self._retry_start(task, step)
        if task is None or start is None:
            before = snapshot(self.store)
            with pytest.raises(NotFound if task is None else InputError):
                self.store.transact_sync(t.retry_task, task_id, step, OPERATOR)
            assert snapshot(self.store) == before, "a refused retry changed the store"
            return
        self.store.transact_sync(t.retry_task, task_id, step, OPERATOR)
        if self._reopen_undos(task):  # ended in error while being undone: the undo resumes
            return
        for idx in range(start, len(task.steps)):
            s = task.steps[idx]
            s.state, s.failure_offset, s.comp_failures, s.complete_by = "pending", s.failure_count, 0, None
            self.done.discard((task_id, idx))
        task.state, task.locked_by, task.cancel_requested, task.run_at = "pending", None, False, 0.0
        self.undo_order.pop(task_id, None)

    @staticmethod
    def _failed_undos(task: MTask) -> list[MStep]:
        """The steps whose compensation failed for good (the task ended in error being undone)."""
        if task.state != "error":
            return []
        return [s for s in task.steps if s.state == "failed" and s.comp_failures > 0]

    def _reopen_undos(self, task: MTask) -> bool:
        """A retry or cancel of a task whose undo failed: the undo resumes, its failures forgotten."""
        undos = self._failed_undos(task)
        for s in undos:
            s.comp_failures, s.complete_by = 0, None
        if undos:
            task.state, task.locked_by, task.run_at = "compensating", None, 0.0
        return bool(undos)

    @classmethod
    def _retry_start(cls, task: MTask | None, step: str | None) -> int | None:
        """OPS2: where an operator retry resumes, or None when it must be refused."""
        if task is None or task.state != "error":  # an undone task is not run again (REL2)
            return None
        if cls._failed_undos(task):  # it resumes its undo: no step to resume from
            return None if step is not None else 0
        names = [s.name for s in task.steps]
        if step is not None and step not in names:
            return None
        first_open = next((i for i, s in enumerate(task.steps) if s.state != "completed"), len(names) - 1)
        start = names.index(step) if step else first_open
        return None if start > first_open else start

    # -- after every step ------------------------------------------------------------------------
    @invariant()
    def database_matches_model_and_invariants_hold(self) -> None:
        db = self.store.transact_sync(read_all)
        self._check_vocabulary(db)
        self._sync_request_ids(db)
        self._check_model(db)
        self._check_attempt_outcomes(db)
        self._check_no_rerun_and_no_dispatch_after_final(db)
        self._check_failure_counts(db)
        self._check_compensation_order(db)
        self._check_structure(db)
        self._check_leases(db)
        self.last_state = {r["id"]: r["state"] for r in db["tasks"]}

    def _check_vocabulary(self, db: dict[str, list[dict[str, Any]]]) -> None:
        assert {r["state"] for r in db["tasks"]} <= set(TASK_STATES), db["tasks"]
        assert {r["state"] for r in db["steps"]} <= set(STEP_STATES), db["steps"]
        assert {r["state"] for r in db["requests"]} <= {"queued", "taken", "replied", "expired"}
        assert {r["status"] for r in db["replies"]} <= {"new", "accepted", "stale"}

    def _sync_request_ids(self, db: dict[str, list[dict[str, Any]]] | None = None) -> None:
        """Learn the database ids of the requests the model knows by (task, step, attempt)."""
        rows = (db or {}).get("requests") or self.store.transact_sync(
            lambda tx: tx.sql("SELECT id, task_id, step_idx, attempt FROM requests")
        )
        for r in rows:
            req = self.requests.get((r["task_id"], r["step_idx"], r["attempt"]))
            if req is not None:
                req.db_id = r["id"]

    def _check_model(self, db: dict[str, list[dict[str, Any]]]) -> None:
        got_tasks = {
            r["id"]: (
                r["state"],
                r["locked_by"],
                bool(r["cancel_requested"]),
                r["failure_count"],
                r["run_at"],
            )
            for r in db["tasks"]
        }
        want_tasks = {
            x.id: (x.state, x.locked_by, x.cancel_requested, x.failure_count, x.run_at)
            for x in self.tasks.values()
        }
        assert got_tasks == want_tasks, _diff("tasks", got_tasks, want_tasks)
        got_steps = {
            (r["task_id"], r["idx"]): (
                r["state"],
                r["attempt"],
                r["failure_count"],
                r["failure_offset"],
                r["comp_failures"],
                r["complete_by"],
                r["started_at"] is not None,
            )
            for r in db["steps"]
        }
        want_steps = {
            (x.id, i): (
                s.state,
                s.attempt,
                s.failure_count,
                s.failure_offset,
                s.comp_failures,
                s.complete_by,
                s.started,
            )
            for x in self.tasks.values()
            for i, s in enumerate(x.steps)
        }
        assert got_steps == want_steps, _diff("steps", got_steps, want_steps)
        got_reqs = {
            (r["task_id"], r["step_idx"], r["attempt"]): (r["kind"], r["state"], r["outcome"])
            for r in db["requests"]
        }
        want_reqs = {k: (r.kind, r.state, r.outcome) for k, r in self.requests.items()}
        assert got_reqs == want_reqs, _diff("requests", got_reqs, want_reqs)
        got_replies = [
            (r["task_id"], r["step_idx"], r["attempt"], r["kind"], r["outcome"], r["status"])
            for r in db["replies"]
        ]
        want_replies = [(r.task_id, r.idx, r.attempt, r.kind, r.outcome, r.status) for r in self.replies]
        assert got_replies == want_replies, _diff(
            "replies", dict(enumerate(got_replies)), dict(enumerate(want_replies))
        )
        assert [(a["kind"], a["task_id"], a["step"]) for a in db["alerts"]] == self.alerts
        lease = db["lease"][0] if db["lease"] else None
        want_lease = (
            None if self.lease is None else (self.lease.holder, self.lease.term, self.lease.expires_at)
        )
        assert (
            None if lease is None else (lease["holder"], lease["term"], lease["expires_at"])
        ) == want_lease

    def _check_attempt_outcomes(self, db: dict[str, list[dict[str, Any]]]) -> None:
        """One terminal outcome per attempt: one accepted reply at most, never also expired."""
        accepted = Counter(
            (r["task_id"], r["step_idx"], r["attempt"]) for r in db["replies"] if r["status"] == "accepted"
        )
        outcome_of = {
            (r["task_id"], r["step_idx"], r["attempt"]): r["outcome"]
            for r in db["replies"]
            if r["status"] == "accepted"
        }
        for r in db["requests"]:
            key = (r["task_id"], r["step_idx"], r["attempt"])
            assert accepted[key] <= 1, f"attempt {key} has {accepted[key]} accepted replies"
            if r["state"] == "expired":
                assert accepted[key] == 0 and r["outcome"] == "expired", f"attempt {key} expired and answered"
            if accepted[key]:
                assert r["outcome"] == outcome_of[key], (
                    f"attempt {key}: outcome {r['outcome']} != accepted reply"
                )

    def _check_no_rerun_and_no_dispatch_after_final(self, db: dict[str, list[dict[str, Any]]]) -> None:
        for r in db["requests"]:
            if r["id"] in self.seen_requests:
                continue
            self.seen_requests.add(r["id"])
            key = (r["task_id"], r["step_idx"])
            assert self.last_state.get(r["task_id"]) not in FINAL, (
                f"request {r} dispatched for task {r['task_id']}, which was {self.last_state[r['task_id']]}"
            )
            if r["kind"] == "do":
                assert key not in self.done, f"completed step {key} ran again without an operator retry: {r}"
        self.done |= {(r["task_id"], r["idx"]) for r in db["steps"] if r["state"] == "completed"}

    def _check_failure_counts(self, db: dict[str, list[dict[str, Any]]]) -> None:
        for r in db["steps"]:
            key = (r["task_id"], r["idx"])
            assert r["failure_count"] >= self.failures.get(key, 0), f"FailureCount of step {key} went down"
            self.failures[key] = r["failure_count"]
        for r in db["tasks"]:
            assert r["failure_count"] >= self.task_failures.get(r["id"], 0), (
                f"FailureCount of task {r['id']} went down"
            )
            self.task_failures[r["id"]] = r["failure_count"]

    def _check_compensation_order(self, db: dict[str, list[dict[str, Any]]]) -> None:
        """Undo only started steps with an undo, latest first: each after every later one is compensated."""
        steps: dict[int, list[dict[str, Any]]] = {}
        for s in db["steps"]:
            steps.setdefault(s["task_id"], []).append(s)
        for r in db["requests"]:
            if r["kind"] != "undo" or r["id"] in self.undo_seen:
                continue
            self.undo_seen.add(r["id"])
            task_id, idx = r["task_id"], r["step_idx"]
            mine = steps[task_id]
            assert mine[idx]["started_at"] is not None and mine[idx]["compensate"], f"undo of {mine[idx]}"
            later = [s for s in mine[idx + 1 :] if s["started_at"] is not None and s["compensate"]]
            assert all(s["state"] == "compensated" for s in later), (
                f"undo of step {idx} of task {task_id} dispatched before later ones were compensated: {later}"
            )
            order = self.undo_order.setdefault(task_id, [])
            assert not order or idx <= order[-1], f"task {task_id}: undo order {order} then {idx}"
            order.append(idx)

    def _check_structure(self, db: dict[str, list[dict[str, Any]]]) -> None:
        tasks_by_id = {r["id"]: r for r in db["tasks"]}
        steps: dict[int, list[dict[str, Any]]] = {}
        for s in db["steps"]:
            steps.setdefault(s["task_id"], []).append(s)
            if s["state"] == "skipped":
                assert s["started_at"] is None, f"a skipped step had started: {s}"
        for s in db["steps"]:
            if s["state"] == "pending":  # an error task's may be (a retry resumes them)
                assert tasks_by_id[s["task_id"]]["state"] not in ("processed", "compensated", "cancelled"), (
                    f"a finished task's step is pending: {s}"
                )
        open_requests = {
            (r["task_id"], r["step_idx"], r["attempt"])
            for r in db["requests"]
            if r["state"] in ("queued", "taken")
        }
        tasks = {r["id"]: r for r in db["tasks"]}
        for task_id, task in tasks.items():
            mine = steps[task_id]
            flying = [
                s for s in mine if s["state"] in ("running", "compensating") and s["complete_by"] is not None
            ]
            if task["state"] in FINAL:
                assert task["locked_by"] is None and not flying, (
                    f"final task {task} still in flight: {flying}"
                )
            elif task["locked_by"] is None:
                assert task["state"] in ("pending", "compensating"), f"unlocked task {task} cannot be claimed"
            else:
                assert task["state"] in ("processing", "compensating") and len(flying) == 1, (
                    f"locked task {task} must have one attempt in flight: {mine}"
                )
            if task["state"] == "processed":
                assert all(s["state"] == "completed" for s in mine), mine
            if task["state"] in ("compensated", "cancelled"):
                left = [
                    s
                    for s in mine
                    if s["compensate"] and s["started_at"] is not None and s["state"] != "compensated"
                ]
                assert not left, f"task {task_id} is {task['state']} with effects not undone: {left}"
        for key in open_requests:
            s = steps[key[0]][key[1]]
            assert tasks[key[0]]["state"] not in FINAL, f"open request {key} of a final task"
            assert (
                s["attempt"] == key[2] and s["state"] in ("running", "compensating") and s["complete_by"]
            ), f"open request {key} is not the current attempt of an in-flight step: {s}"

    def _check_leases(self, db: dict[str, list[dict[str, Any]]]) -> None:
        if db["lease"]:
            term = db["lease"][0]["term"]
            assert term >= self.max_term, "the lease term went down"
            self.max_term = term
        terms = db["terms"]
        assert [r["term"] for r in terms] == list(range(1, len(terms) + 1)), terms
        for prev, nxt in itertools.pairwise(terms):
            assert prev["ended_at"] is not None and prev["ended_at"] <= nxt["acquired_at"], (prev, nxt)
        holder = {r["term"]: r["holder"] for r in terms}
        for term, who in self.acted.items():
            assert holder.get(term) == who, f"{who} acted in term {term} held by {holder.get(term)}"

    def _check_rescue_terms(self, audit: dict[str, list[dict[str, Any]]]) -> None:
        """Every rescue the store recorded was made by the holder of the term it names."""
        holder = {r["term"]: r["holder"] for r in audit["terms"]}
        for e in audit["rescues"]:
            term = json.loads(e["detail"])["term"]
            assert holder.get(term) == e["actor"], (
                f"{e['actor']} acted in term {term} held by {holder.get(term)}"
            )

    def _check_messages(self, db: dict[str, list[dict[str, Any]]]) -> None:
        """Each task's messages follow its life (SCH8): one ``received`` first, then only what
        its state allows (``step_completed`` while it runs, ``step_compensated`` while it is
        undone, ``retried`` only after an ``error``, nothing after ``processed``, ``compensated``
        or ``cancelled``), ending with its final state; and every step the store has completed
        (of a processed task) or compensated has its message. A missing, doubled or misplaced
        message fails here, not only a wrong first or last one."""
        msgs: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        for m in db["messages"]:
            msgs.setdefault(m["task_id"], []).append((m["kind"], json.loads(m["body"])))
        steps: dict[int, list[dict[str, Any]]] = {}
        for row in db["steps"]:
            steps.setdefault(row["task_id"], []).append(row)
        for task in db["tasks"]:
            mine = msgs.get(task["id"], [])
            kinds = [k for k, _ in mine]
            where = f"task {task['id']} ({task['state']}) messages {kinds}"
            assert kinds[:1] == ["received"] and kinds.count("received") == 1, where
            life, last_error = "pending", {}
            for kind, body in mine[1:]:
                assert life not in FINAL - {"error"}, f"{kind} after the end: {where}"
                assert life in MESSAGE_AFTER[kind], f"{kind} while {life}: {where}"
                if kind == "error":
                    last_error = body
                if kind == "retried":  # a task that failed while undone resumes its undo
                    life = "compensating" if "not_undone" in last_error else "pending"
                elif kind != "step_compensated":
                    life = {"step_completed": "processing"}.get(kind, kind)
            if task["state"] in FINAL:
                assert kinds[-1] == task["state"], where
            completed = [b.get("step") for k, b in mine if k == "step_completed"]
            compensated = [b.get("step") for k, b in mine if k == "step_compensated"]
            for step in steps.get(task["id"], []):
                if step["state"] == "compensated":
                    assert compensated.count(step["name"]) == 1, f"step {step['name']} compensated: {where}"
                if task["state"] == "processed":  # more than once if a retry ran it again (OPS2)
                    assert step["name"] in completed, f"step {step['name']} completed: {where}"


# The task's life a status message may come in (the message ``received`` only comes first).
MESSAGE_AFTER: dict[str, tuple[str, ...]] = {
    "step_completed": ("pending", "processing"),
    "processed": ("pending", "processing"),
    "compensating": ("pending", "processing", "error"),
    "step_compensated": ("compensating",),
    "compensated": ("compensating",),
    "cancelled": ("compensating",),
    "error": ("pending", "processing", "compensating"),
    "retried": ("error",),
}


def _diff(what: str, got: dict[Any, Any], want: dict[Any, Any]) -> str:
    lines = [f"{what} differ from the model (key: database != model):"]
    for k in sorted(set(got) | set(want), key=repr):
        if got.get(k) != want.get(k):
            lines.append(f"  {k}: {got.get(k)} != {want.get(k)}")
    return "\n".join(lines)


@pytest.mark.timeout(900)  # room to shrink a failure (Hypothesis gives shrinking up to 5 min)
def test_store_matches_the_model_under_random_interleavings(store_url: str, clock: FakeClock) -> None:
    if store_url.startswith("sqlite:///"):  # the same store, without an fsync per commit (WAL, NORMAL)
        store: Store = SQLiteStore(store_url[len("sqlite:///") :], clock=clock, synchronous="NORMAL")
    else:
        store = open_store(store_url, clock=clock)
    budget = settings(SETTINGS, max_examples=EXAMPLES[store.dialect])
    try:
        # A factory, as Hypothesis documents (a class or a function), though its hint says a class.
        run_state_machine_as_test(lambda: StoreMachine(store, clock), settings=budget)  # type: ignore[arg-type]
    finally:
        store.close()
