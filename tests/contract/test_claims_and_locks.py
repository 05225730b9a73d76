"""Claims and row locks whose loss no other test noticed (a mutation review found each edit below
survived the whole suite):

* the expiry sweep re-checks each candidate under its task's lock (SCH4, SUP2): without it, a
  reply applied between the sweep's scan and its lock was overridden and the finished step failed;
* every operator action locks its task first (``task_for_update``): without it a cancel or a
  retry decided on the state before a concurrent transition committed, and wrote over it;
* schedulers claim tasks with SKIP LOCKED (SCH1): without it a claim waited on a task another
  scheduler (or a paused session) held, instead of taking the next one;
* agents take requests by their task's priority, then age (SUB5): without it a priority-9 task's
  request waited behind every older request of lower priority.

The PostgreSQL tests hold rows in another session or pause one of the store's own transactions
between two statements, and watch ``pg_stat_activity`` for a session waiting on a lock: no test
sleeps and hopes. The priority test runs on both stores (``store``, tests/contract/conftest.py).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from pg_threads import ends_before_it_waits, in_thread

from stepwarden.clock import FakeClock
from stepwarden.errors import InputError
from stepwarden.store import Store, open_store
from stepwarden.store import agents as sa
from stepwarden.store import transitions as t
from stepwarden.store.base import Row, SweepResult, Tx
from stepwarden.testing.postgres import wait_for_lock_waiter
from stepwarden.workflow import Workflow, encode_input

SCHED = "sched-1:1:aaa"
AGENT = "agent-1:1:bbb"
SUP = "sup-1:1:ccc"
Factory = Callable[..., Workflow]


# -- helpers ---------------------------------------------------------------------------------------


def _submit(store: Store, wf: Workflow, priority: int = 0) -> int:
    task_id, _ = store.transact_sync(
        t.submit,
        wf,
        encode_input({"order": 1}),
        correlation_id=None,
        idempotency_key=None,
        priority=priority,
        reply_to=None,
    )
    return int(task_id)


def _q(store: Store, sql: str, *params: Any) -> list[Row]:
    return store.transact_sync(lambda tx: tx.sql(sql, params))


class _Paused:
    """One of the store's transactions, run on a thread of its own and paused after ``work``
    returned, before it commits: the rows it locked stay held until :meth:`commit`."""

    def __init__(self, store: Store, work: Callable[[Tx], Any]) -> None:
        self.holding, self.go = threading.Event(), threading.Event()

        def paused(tx: Tx) -> Any:
            done = work(tx)
            self.holding.set()
            assert self.go.wait(20), "never released"
            return done

        self.thread, self.out = in_thread(lambda: store.transact_sync(paused))
        assert self.holding.wait(10), f"the transaction never reached its pause: {self.out}"

    def commit(self) -> Any:
        self.go.set()
        self.thread.join(15)
        assert not self.thread.is_alive(), "the paused transaction never ended"
        [done] = self.out
        assert not isinstance(done, BaseException), done
        return done


# -- SCH4, SUP2: the sweep re-checks each candidate under its task's lock -------------------------


@pytest.mark.parametrize("kind", ["sweep_expired", "rescue_orphans"])
def test_a_reply_applied_between_the_sweeps_scan_and_its_lock_is_not_overridden(
    pg_url: str, clock: FakeClock, make_workflow: Factory, kind: str
) -> None:
    """SCH4, SUP2. The agent's reply arrived a second before complete-by; its transaction
    commits, and a scheduler applies it, just after the supervisor's sweep (or its rescue of a
    worker presumed dead) has read the attempt as expired and before it locks the task. The
    user saw a task whose step had completed in time failed anyway: FailureCount 1, the step
    run again (or the task escalated). The sweep must pass it by: the step stays completed."""
    store = open_store(pg_url, clock=clock)
    try:
        task_id = _submit(store, make_workflow("a", budget=5))
        assert store.transact_sync(t.claim_and_dispatch, SCHED, 10) == 1
        [taken] = asyncio.run(store.claim_requests(AGENT, ["svc"], 10))
        got = asyncio.run(store.acquire_lease("supervisor", SUP, 1e6))
        assert got is not None
        term = int(got[0])
        [row] = _q(store, "SELECT complete_by FROM steps WHERE task_id = ?", task_id)
        complete_by = float(row["complete_by"])
        clock.advance(6)  # the attempt is past complete-by (budget 5 s)

        applied: list[Any] = []

        def reply_lands() -> None:
            """The agent's in-time reply commits, and a scheduler applies it and commits."""
            with psycopg.connect(pg_url, autocommit=True) as agent:
                agent.execute(
                    "INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, result,"
                    " sent_by, received_at) VALUES (%s, %s, 0, 1, 'do', 'ok', '{\"paid\": true}', %s, %s)",
                    (taken.id, task_id, AGENT, complete_by - 1),
                )
                agent.execute("UPDATE requests SET state = 'replied' WHERE id = %s", (taken.id,))
            th, out = in_thread(lambda: store.transact_sync(t.apply_replies, SCHED, 50, random.Random(0)))
            th.join(15)
            assert not th.is_alive(), "the scheduler's apply waited on the sweep"
            applied.extend(out)

        candidates = "expired_steps" if kind == "sweep_expired" else "orphaned_steps"

        def rescue_with_a_reply_landing(tx: Tx) -> SweepResult:
            real_all = tx.all

            def all_(query: str, /, **params: Any) -> list[Row]:
                found = real_all(query, **params)
                if query == candidates and not applied:
                    assert [r["task_id"] for r in found] == [task_id], "the scan saw the attempt to rescue"
                    reply_lands()
                return found

            tx.all = all_  # type: ignore[method-assign]
            if kind == "sweep_expired":
                return t.sweep_expired(tx, SUP, "supervisor", term, 10, random.Random(0))
            return t.rescue_orphans(tx, SUP, "supervisor", term, AGENT, "gone", 10, random.Random(0))

        result = store.transact_sync(rescue_with_a_reply_landing)
        [done] = applied
        assert not isinstance(done, BaseException), done
        assert (done.accepted, done.stale) == (1, 0), "the reply was in time"
        assert result.rescued == 0, "the sweep failed an attempt whose reply was applied under it"
        steps = _q(store, "SELECT state, attempt, failure_count FROM steps WHERE task_id = ?", task_id)
        assert [(s["state"], s["attempt"], s["failure_count"]) for s in steps] == [("completed", 1, 0)]
        [task] = _q(store, "SELECT state FROM tasks WHERE id = ?", task_id)
        assert task["state"] == "processed"
        rescued = _q(
            store, "SELECT count(*) AS n FROM events WHERE task_id = ? AND kind = 'rescued'", task_id
        )
        assert rescued[0]["n"] == 0
    finally:
        store.close()


# -- operator actions lock their task before they read it (task_for_update) -----------------------


def test_a_cancel_waits_for_a_reply_being_applied_and_then_sees_the_task_finished(
    pg_url: str, clock: FakeClock, make_workflow: Factory
) -> None:
    """OPS3, CMP4. An operator cancels a task while a scheduler applies the reply that finishes
    it. The cancel must wait for the scheduler's transaction and then refuse ("already
    processed"). Reading the task without its lock, it decided on the state before the reply:
    the user's cancel "succeeded", and a processed task was left marked cancel-requested with a
    cancel_requested event in its history."""
    store = open_store(pg_url, clock=clock)
    cancel: threading.Thread | None = None
    sched: _Paused | None = None
    try:
        task_id = _submit(store, make_workflow("a", budget=30))
        assert store.transact_sync(t.claim_and_dispatch, SCHED, 10) == 1
        [taken] = asyncio.run(store.claim_requests(AGENT, ["svc"], 10))
        asyncio.run(store.send_reply(AGENT, taken.id, "ok", {"paid": True}, None))

        sched = _Paused(store, lambda tx: t.apply_replies(tx, SCHED, 50, random.Random(0)))
        cancel, out = in_thread(lambda: store.transact_sync(t.cancel_task, task_id, "operator"))
        wait_for_lock_waiter(pg_url)  # the cancel waits for the task the scheduler holds
        assert cancel.is_alive() and out == [], "the cancel did not wait for the scheduler"
        assert sched.commit().accepted == 1
        cancel.join(15)
        assert not cancel.is_alive(), "the cancel never ended"
        [refused] = out
        assert isinstance(refused, InputError), f"the cancel of a processed task returned {refused!r}"
        assert "already processed" in str(refused)
        [task] = _q(store, "SELECT state, cancel_requested FROM tasks WHERE id = ?", task_id)
        assert (task["state"], task["cancel_requested"]) == ("processed", 0)
        asked = _q(
            store, "SELECT count(*) AS n FROM events WHERE task_id = ? AND kind = 'cancel_requested'", task_id
        )
        assert asked[0]["n"] == 0
    finally:
        if sched is not None:
            sched.go.set()
            sched.thread.join(15)
        if cancel is not None:
            cancel.join(15)
        store.close()


def test_of_two_operators_retrying_one_task_at_once_the_second_is_told_it_is_pending(
    pg_url: str, clock: FakeClock, make_workflow: Factory
) -> None:
    """OPS2. Two operators retry the same errored task at once (two dashboards, a script run
    twice). The second retry must wait for the first and then be refused: the task is pending
    again. Deciding without the task's lock, both retried it: two "retried" events and two
    "retried" messages on the task's reply queue for one retry."""
    store = open_store(pg_url, clock=clock)
    second: threading.Thread | None = None
    first: _Paused | None = None
    try:
        task_id = _submit(store, make_workflow("a", "b", budget=30))
        assert store.transact_sync(t.claim_and_dispatch, SCHED, 10) == 1
        [taken] = asyncio.run(store.claim_requests(AGENT, ["svc"], 10))
        asyncio.run(store.send_reply(AGENT, taken.id, "error", None, "card declined"))
        assert store.transact_sync(t.apply_replies, SCHED, 50, random.Random(0)).finished == [
            (task_id, "error")
        ]

        first = _Paused(store, lambda tx: t.retry_task(tx, task_id, None, "alice"))
        second, out = in_thread(lambda: store.transact_sync(t.retry_task, task_id, None, "bob"))
        wait_for_lock_waiter(pg_url)  # bob's retry waits for the task alice's retry holds
        assert second.is_alive() and out == [], "the second retry did not wait for the first"
        assert first.commit() == "pending"
        second.join(15)
        assert not second.is_alive(), "the second retry never ended"
        [refused] = out
        assert isinstance(refused, InputError), f"the second retry returned {refused!r}"
        assert "is pending" in str(refused)
        retried = _q(store, "SELECT actor FROM events WHERE task_id = ? AND kind = 'retried'", task_id)
        assert [r["actor"] for r in retried] == ["alice"]
    finally:
        if first is not None:
            first.go.set()
            first.thread.join(15)
        if second is not None:
            second.join(15)
        store.close()


# -- SCH1: a claim passes over a task another transaction holds ------------------------------------


@pytest.mark.parametrize("kind", ["ready", "due"])
def test_a_claim_takes_the_next_task_at_once_when_another_session_holds_the_first(
    pg_url: str, clock: FakeClock, make_workflow: Factory, kind: str
) -> None:
    """SCH1. Another scheduler's transaction (or a paused session) holds the oldest claimable
    task: a new one (``ready``), or one whose back-off after a failed attempt is over (``due``).
    A claim of one task must take the next one at once, not wait: waiting, every scheduler
    queued behind the one held row and the whole fleet stalled for as long as it was held (up to
    the session's 10 s lock limit, then failed)."""
    store = open_store(pg_url, clock=clock)
    claim: threading.Thread | None = None
    try:
        wf = make_workflow("a", budget=30)
        held, free = _submit(store, wf), _submit(store, wf)
        if kind == "due":  # both attempts fail (a transient error): each task waits out 10 s
            assert store.transact_sync(t.claim_and_dispatch, SCHED, 10) == 2
            for m in asyncio.run(store.claim_requests(AGENT, ["svc"], 10)):
                asyncio.run(store.send_reply(AGENT, m.id, "retry", None, "transient: 503"))
            assert store.transact_sync(t.apply_replies, SCHED, 50, random.Random(0)).accepted == 2
            clock.advance(11)
        waiting = _q(store, "SELECT waiting FROM tasks ORDER BY id")
        assert [r["waiting"] for r in waiting] == [int(kind == "due")] * 2
        with psycopg.connect(pg_url) as other:
            other.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", (held,))
            claim, out = in_thread(lambda: store.transact_sync(t.claim_and_dispatch, SCHED, 1))
            ended = ends_before_it_waits(pg_url, claim)
            other.rollback()  # lets a claim that waited go on, so that the test ends promptly
            claim.join(15)
            assert ended, "the claim waited for the task another session holds"
        assert out == [1]
        locked = _q(store, "SELECT id, state, locked_by FROM tasks ORDER BY id")
        assert [(r["id"], r["state"], r["locked_by"]) for r in locked] == [
            (held, "pending", None),
            (free, "processing", SCHED),
        ]
    finally:
        if claim is not None:
            claim.join(15)
        store.close()


# -- SUB5: agents take the requests of higher-priority tasks first ---------------------------------


def test_an_agent_takes_the_request_of_a_higher_priority_task_before_an_older_one(
    store: Store, make_workflow: Factory
) -> None:
    """SUB5, on both stores. A priority-0 task's request is dispatched, then a priority-9 task's.
    An agent instance with room for one must take the priority-9 request: taking by age alone,
    urgent work waited behind every older request of its agent (a backlog of bulk jobs held up
    the one a customer waits for)."""
    wf = make_workflow("a", budget=30)
    low = _submit(store, wf, priority=0)
    assert store.transact_sync(t.claim_and_dispatch, SCHED, 10) == 1
    high = _submit(store, wf, priority=9)
    assert store.transact_sync(t.claim_and_dispatch, SCHED, 10) == 1
    queued = _q(store, "SELECT task_id FROM requests WHERE state = 'queued' ORDER BY id")
    assert [r["task_id"] for r in queued] == [low, high], "the low-priority request is the older"

    rules = sa.HealthRules()
    want = {"svc": sa.Want(1, sa.ops_json(["do_a"]))}
    first = store.transact_sync(sa.pull, AGENT, want, rules)
    assert [m.task_id for m in first.requests] == [high], "the pull took the older, lower-priority request"
    second = store.transact_sync(sa.pull, AGENT, want, rules)
    assert [m.task_id for m in second.requests] == [low]


def test_a_take_of_any_operation_also_goes_by_priority(store: Store, make_workflow: Factory) -> None:
    """SUB5, on both stores: the take of a tool (or a test) acting as an agent
    (``Store.claim_requests``) goes by priority too, then age."""
    wf = make_workflow("a", budget=30)
    low = _submit(store, wf, priority=0)
    assert store.transact_sync(t.claim_and_dispatch, SCHED, 10) == 1
    high = _submit(store, wf, priority=9)
    assert store.transact_sync(t.claim_and_dispatch, SCHED, 10) == 1
    [taken] = asyncio.run(store.claim_requests(AGENT, ["svc"], 1))
    assert taken.task_id == high
    [rest] = asyncio.run(store.claim_requests(AGENT, ["svc"], 1))
    assert rest.task_id == low


def test_the_listen_session_survives_an_idle_session_timeout_set_on_the_database(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: with ``idle_session_timeout`` set on the role or the database (a DBA's
    guard against forgotten sessions), the LISTEN connection, idle by design between
    notifications, was ended every few seconds: a warning each time, and wake-ups lost between.
    Its own session turns the limit off."""
    import logging

    caplog.set_level(logging.INFO, logger="stepwarden")
    dbname = pg_url.rsplit("/", 1)[1].split("?")[0]
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE \"{dbname}\" SET idle_session_timeout = '1s'")
    store = open_store(pg_url)
    woken: list[str] = []

    async def body() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(store.listen(woken.append, stop, ["stepwarden_tasks"]))
        deadline = time.monotonic() + 10
        while not woken:  # the first wake-up: listening now
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        woken.clear()
        await asyncio.sleep(2.5)  # idle past the database's limit
        with psycopg.connect(pg_url, autocommit=True) as other:
            other.execute("NOTIFY stepwarden_tasks")
        while not woken:
            assert time.monotonic() < deadline, "the notification sent after the idle time was lost"
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 10)

    try:
        asyncio.run(body())
    finally:
        store.close()
    assert not [r for r in caplog.records if "LISTEN connection lost" in r.getMessage()], caplog.text
