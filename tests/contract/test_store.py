"""The SQLite store's transitions, on a fake clock: submission, claims, replies, the supervisor's
sweep, escalation, compensation, cancel, retry, fencing and migrations.

Time is the FakeClock's: the SQL reads it through ``sw_now()``, so ``clock.advance`` moves deadlines.
The default workflow (conftest ``make_workflow``) is a -> b -> c on agent ``svc``, 10 s budget per
attempt, each step undone by ``svc.undo_<step>``, back-off exactly 10 s then 20 s, 3 failures allowed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import sqlite3
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import psycopg
import pytest

from stepwarden.clock import FakeClock
from stepwarden.errors import InputError, LostOwnership, NotFound
from stepwarden.policies import Backoff, Retry
from stepwarden.store import ApplyResult, RequestMsg, SQLiteStore, Store, SweepResult, open_store, views
from stepwarden.store import agents as sa
from stepwarden.store import transitions as t
from stepwarden.store.agents import Want, ops_json
from stepwarden.supervisor import Supervisor, SupervisorSettings
from stepwarden.workflow import Workflow, encode_input

ME = "sched-1:1:aaa"
AGENT = "agent-1:1:bbb"
SUP = "sup-1:1:ccc"
INTEGRITY_ERRORS = (sqlite3.IntegrityError, psycopg.IntegrityError)
OPERATIONAL_ERRORS = (sqlite3.OperationalError, psycopg.errors.SyntaxError, psycopg.errors.UndefinedTable)
Factory = Callable[..., Workflow]


# -- helpers ---------------------------------------------------------------------------------------


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)


def submit(store: Store, wf: Workflow, value: Any = None, **kw: Any) -> int:
    return submit_full(store, wf, value, **kw)[0]


def submit_full(store: Store, wf: Workflow, value: Any = None, **kw: Any) -> tuple[int, bool]:
    opts: dict[str, Any] = {"correlation_id": None, "idempotency_key": None, "priority": 0, "reply_to": None}
    opts.update(kw)
    text = encode_input({"order": 1} if value is None else value)
    return store.transact_sync(t.submit, wf, text, **opts)


def claim(store: Store, limit: int = 10, me: str = ME) -> int:
    return store.transact_sync(t.claim_and_dispatch, me, limit)


def apply(store: Store, limit: int = 50, me: str = ME) -> ApplyResult:
    return store.transact_sync(t.apply_replies, me, limit, random.Random(0))


def room(n: int, ops: tuple[str, ...] = ("do_a", "do_b", "do_c", "undo_a", "undo_b", "undo_c")) -> Want:
    """A take of up to ``n`` requests for a worker's own slots, for ``ops`` (by default every
    operation of ``make_workflow()``'s steps, and of their undos)."""
    return Want(n, ops=ops_json(ops))


def take(store: Store, limit: int = 10, agent: str = "svc") -> list[RequestMsg]:
    return run(store.claim_requests(AGENT, [agent], limit))  # type: ignore[no-any-return]


def send(
    store: Store, request_id: int, outcome: str = "ok", result: Any = None, error: str | None = None
) -> None:
    """The agent's reply to a request it took first (taken here if still queued), as a real one
    does: a step a request of which an agent took may have reached its service (undo.reached_steps)."""
    take_it = "UPDATE requests SET state = 'taken', taken_by = ? WHERE id = ? AND state = 'queued'"
    q(store, take_it, AGENT, request_id)
    run(store.send_reply(AGENT, request_id, outcome, result, error))


def lease(store: Store, holder: str = SUP, ttl: float = 1e6) -> int:
    got = run(store.acquire_lease("supervisor", holder, ttl))
    assert got is not None
    return int(got[0])


def sweep(store: Store, term: int, limit: int = 100, me: str = SUP) -> SweepResult:
    return store.transact_sync(t.sweep_expired, me, "supervisor", term, limit, random.Random(0))


def q(store: Store, sql: str, *params: Any) -> list[dict[str, Any]]:
    return store.transact_sync(lambda tx: tx.sql(sql, params))


def task(store: Store, task_id: int) -> dict[str, Any]:
    return q(store, "SELECT * FROM tasks WHERE id = ?", task_id)[0]


def steps(store: Store, task_id: int) -> list[dict[str, Any]]:
    return q(store, "SELECT * FROM steps WHERE task_id = ? ORDER BY idx", task_id)


def step(store: Store, task_id: int, name: str) -> dict[str, Any]:
    return next(s for s in steps(store, task_id) if s["name"] == name)


def states(store: Store, task_id: int) -> tuple[str, list[str]]:
    return task(store, task_id)["state"], [s["state"] for s in steps(store, task_id)]


def requests(store: Store, task_id: int) -> list[dict[str, Any]]:
    return q(store, "SELECT * FROM requests WHERE task_id = ? ORDER BY id", task_id)


def last_request(store: Store, task_id: int, name: str) -> dict[str, Any]:
    idx = step(store, task_id, name)["idx"]
    return [r for r in requests(store, task_id) if r["step_idx"] == idx][-1]


def event_kinds(store: Store, task_id: int) -> list[str]:
    return [e["kind"] for e in q(store, "SELECT kind FROM events WHERE task_id = ? ORDER BY id", task_id)]


def alerts(store: Store) -> list[dict[str, Any]]:
    return store.transact_sync(views.list_alerts)


def reply(
    store: Store, task_id: int, name: str, outcome: str = "ok", result: Any = None, error: str | None = None
) -> None:
    """The agent's answer to the step's latest request."""
    send(store, last_request(store, task_id, name)["id"], outcome, result, error)


def complete(store: Store, task_id: int, name: str, result: Any = None) -> ApplyResult:
    reply(store, task_id, name, "ok", {"done": name} if result is None else result)
    r = apply(store)
    assert r.accepted == 1, r
    return r


def snapshot(store: Store) -> dict[str, list[dict[str, Any]]]:
    """Everything a transition may change, except the audit tables."""
    order = {"tasks": "id", "steps": "task_id, idx", "requests": "id", "alerts": "id", "leases": "name"}
    return {table: q(store, f"SELECT * FROM {table} ORDER BY {key}") for table, key in order.items()}


def count(store: Store, table: str) -> int:
    return int(q(store, f"SELECT COUNT(*) AS n FROM {table}")[0]["n"])


# -- submission ------------------------------------------------------------------------------------


def test_submit_writes_the_task_and_one_row_per_step(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    wf = make_workflow("a", "b", "c", budget=7.5)
    task_id, created = submit_full(store, wf, {"sku": "x"}, correlation_id="order-9", priority=3)
    assert created
    row = task(store, task_id)
    assert (row["state"], row["workflow"], row["correlation_id"], row["priority"]) == (
        "pending",
        "wf",
        "order-9",
        3,
    )
    assert json.loads(row["input"]) == {"sku": "x"}
    assert row["created_at"] == clock.wall() and row["locked_by"] is None
    assert [
        (s["idx"], s["name"], s["operation"], s["compensate"], s["state"], s["attempt"], s["budget"])
        for s in steps(store, task_id)
    ] == [
        (0, "a", "svc.do_a", "svc.undo_a", "pending", 0, 7.5),
        (1, "b", "svc.do_b", "svc.undo_b", "pending", 0, 7.5),
        (2, "c", "svc.do_c", "svc.undo_c", "pending", 0, 7.5),
    ]
    assert event_kinds(store, task_id) == ["received"]


def test_submit_is_one_transaction_a_failure_leaves_nothing(
    store: SQLiteStore, make_workflow: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every step row gets idx 0: the task and the first step are written, the second one fails.
    monkeypatch.setitem(
        store.queries,
        "insert_step",
        store.queries["insert_step"].replace(":idx", "0").replace("%(idx)s", "0"),
    )
    if "submit_task" in store.queries:  # PostgreSQL writes a submission in one statement
        monkeypatch.setitem(
            store.queries,
            "submit_task",
            store.queries["submit_task"].replace("SELECT t.id, x.idx", "SELECT t.id, 0"),
        )
    with pytest.raises(INTEGRITY_ERRORS):
        submit(store, make_workflow())
    assert (count(store, "tasks"), count(store, "steps"), count(store, "events")) == (0, 0, 0)


def test_the_store_keeps_the_highest_version_of_a_workflow_and_says_when_a_worker_differs(
    store: Store, make_workflow: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """``submit`` without ``--app`` builds tasks from the definition in the store: the highest
    version registered, so that a rolling deploy's old workers starting again do not undo it.
    A worker with an older version (a rollback that kept the old number), or the same version
    with other steps, was ignored or replaced the definition without a word."""
    from stepwarden.store.core import _register

    new = Workflow.of("order", make_workflow("a", "b").steps, version=2)
    old = Workflow.of("order", make_workflow("a").steps, version=1)
    store.transact_sync(_register, [new], "deploy-2:1:aa")
    with caplog.at_level(logging.WARNING, logger="stepwarden.store"):
        store.transact_sync(_register, [old], "rollback:2:bb")
    assert store.workflow_sync("order").version == 2  # kept
    [line] = [r.getMessage() for r in caplog.records if r.name == "stepwarden.store"]
    assert "this app's version 1 is older than version 2 in the store (registered by deploy-2:1:aa)" in line
    assert "give it a higher version" in line
    caplog.clear()
    changed = Workflow.of("order", make_workflow("a", "c").steps, version=2)
    with caplog.at_level(logging.WARNING, logger="stepwarden.store"):
        store.transact_sync(_register, [changed], "hotfix:3:cc")
        store.transact_sync(_register, [changed], "hotfix:4:dd")  # the same again: nothing to say
    assert [s.name for s in store.workflow_sync("order").steps] == ["a", "c"]
    [line] = [r.getMessage() for r in caplog.records if r.name == "stepwarden.store"]
    assert "version 2 differs from the definition in the store (registered by deploy-2:1:aa)" in line


def test_idempotency_key_returns_the_existing_task(store: Store, make_workflow: Factory) -> None:
    wf = make_workflow()
    first = submit_full(store, wf, {"n": 1}, idempotency_key="order-1:v1")
    again = submit_full(store, wf, {"n": 2}, idempotency_key="order-1:v1")
    other = submit_full(store, wf, {"n": 3}, idempotency_key="order-2:v1")
    assert first == (first[0], True)
    assert again == (first[0], False)
    assert other[1] and other[0] != first[0]
    assert count(store, "tasks") == 2 and count(store, "steps") == 6
    assert json.loads(task(store, first[0])["input"]) == {"n": 1}
    assert event_kinds(store, first[0]) == ["received"]


def test_an_idempotency_key_of_another_workflows_task_is_refused_and_writes_nothing(
    store: Store, make_workflow: Factory
) -> None:
    """The same submission again is the same workflow. Another workflow's task under the key is
    a key reused by mistake: returning that task (as it did) told the caller its submission was
    made when nothing of it was. Refused, naming the task that holds the key."""
    first, _ = submit_full(store, make_workflow(name="refund"), {"n": 1}, idempotency_key="order-1")
    before = (count(store, "tasks"), count(store, "steps"), count(store, "events"))
    with pytest.raises(
        InputError, match=rf"'order-1' is task {first}'s, a task of workflow 'refund', not 'ship'"
    ):
        submit_full(store, make_workflow(name="ship"), {"n": 1}, idempotency_key="order-1")
    assert (count(store, "tasks"), count(store, "steps"), count(store, "events")) == before


def test_concurrent_submits_with_one_key_all_get_the_one_task(store: Store, make_workflow: Factory) -> None:
    """Racing submitters of one key each get the same task id, none an error (SUB3 under load)."""
    wf = make_workflow()
    threads, rounds = 6, 15
    barrier = threading.Barrier(threads)
    got: dict[int, list[tuple[int, bool]]] = {r: [] for r in range(rounds)}
    errors: list[BaseException] = []

    def submitter() -> None:
        for r in range(rounds):
            barrier.wait(timeout=30)
            try:
                got[r].append(submit_full(store, wf, {"r": r}, idempotency_key=f"race-{r}"))
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

    pool = [threading.Thread(target=submitter) for _ in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(timeout=120)
    assert errors == []
    for r in range(rounds):
        assert len({tid for tid, _ in got[r]}) == 1, got[r]
        assert sum(created for _, created in got[r]) == 1, got[r]
    assert count(store, "tasks") == rounds and count(store, "steps") == 3 * rounds


def test_higher_priority_is_claimed_first_then_oldest(store: Store, make_workflow: Factory) -> None:
    wf = make_workflow()
    ids = {
        p: submit(store, wf, priority=prio)
        for p, prio in [("low", 0), ("high1", 5), ("mid", 1), ("high2", 5)]
    }
    order = []
    for _ in range(4):
        assert claim(store, limit=1) == 1
        locked = {r["id"] for r in q(store, "SELECT id FROM tasks WHERE locked_by IS NOT NULL")}
        order.append(next(p for p, i in ids.items() if i in locked and p not in order))
    assert order == ["high1", "high2", "mid", "low"]
    assert claim(store) == 0


def race_two_schedulers(s1: Store, s2: Store, limit: int = 3) -> dict[str, int]:
    """Schedulers ``s0`` (on ``s1``) and ``s1`` (on ``s2``) started together, each claiming
    ``limit`` at a time until a round finds nothing: how many each claimed."""
    barrier = threading.Barrier(2)
    got: dict[str, int] = {}

    def scheduler(s: Store, me: str) -> None:
        barrier.wait()
        n = 0
        while (k := s.transact_sync(t.claim_and_dispatch, me, limit)) > 0:
            n += k
        got[me] = n

    threads = [threading.Thread(target=scheduler, args=(s, f"s{i}")) for i, s in enumerate((s1, s2))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    return got


def test_claim_is_exclusive_between_two_schedulers(
    store_url: str, clock: FakeClock, make_workflow: Factory
) -> None:
    s1 = open_store(store_url, clock=clock)
    s2 = open_store(store_url, clock=clock)
    try:
        wf = make_workflow()
        ids = [submit(s1, wf) for _ in range(40)]
        got = race_two_schedulers(s1, s2)
        assert got["s0"] + got["s1"] == 40
        for task_id in ids:
            assert event_kinds(s1, task_id).count("claimed") == 1
            assert len(requests(s1, task_id)) == 1
            assert task(s1, task_id)["locked_by"] in ("s0", "s1")
            assert task(s1, task_id)["locked_by"] == requests(s1, task_id)[0]["dispatched_by"]
    finally:
        s1.close()
        s2.close()


# -- dispatch and replies --------------------------------------------------------------------------


def test_dispatch_starts_attempt_one_with_complete_by_from_the_database_clock(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    task_id = submit(store, make_workflow(budget=12.0), {"sku": "x"})
    clock.advance(100.0)
    now = clock.wall()
    assert claim(store) == 1
    a, b, _ = steps(store, task_id)
    assert (a["state"], a["attempt"], a["locked_by"]) == ("running", 1, ME)
    assert a["complete_by"] == pytest.approx(now + 12.0, abs=1e-6)
    assert (b["state"], b["attempt"]) == ("pending", 0)
    row = task(store, task_id)
    assert (row["state"], row["locked_by"]) == ("processing", ME)
    [req] = requests(store, task_id)
    assert (req["attempt"], req["kind"], req["agent"], req["operation"], req["state"]) == (
        1,
        "do",
        "svc",
        "do_a",
        "queued",
    )
    assert req["idempotency_key"] == f"{task_id}:a"
    assert req["complete_by"] == a["complete_by"]
    assert json.loads(req["payload"]) == {"input": {"sku": "x"}, "results": {}}
    clock.advance(2.5)
    [msg] = take(store)
    assert msg.remaining == pytest.approx(12.0 - 2.5, abs=1e-6)
    assert (msg.attempt, msg.idempotency_key) == (1, f"{task_id}:a")
    assert requests(store, task_id)[0]["state"] == "taken"


def test_agents_cannot_take_a_request_whose_complete_by_passed(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    submit(store, make_workflow())
    claim(store)
    clock.advance(10.0)
    assert take(store) == []


def test_current_reply_completes_the_step_and_dispatches_the_next(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    task_id = submit(store, make_workflow(), {"sku": "x"})
    claim(store)
    [msg] = take(store)
    clock.advance(9.0)
    send(store, msg.id, "ok", {"reserved": 2})
    r = apply(store, me="sched-2")
    assert (r.accepted, r.stale) == (1, 0)
    a, b, c = steps(store, task_id)
    assert (a["state"], json.loads(a["result"])) == ("completed", {"reserved": 2})
    assert (b["state"], b["attempt"], b["locked_by"]) == ("running", 1, "sched-2")
    assert b["complete_by"] == pytest.approx(clock.wall() + 10.0, abs=1e-6)
    assert c["state"] == "pending"
    req_b = last_request(store, task_id, "b")
    assert json.loads(req_b["payload"]) == {"input": {"sku": "x"}, "results": {"a": {"reserved": 2}}}
    assert event_kinds(store, task_id)[-2:] == ["step_completed", "dispatched"]


def test_completion_and_next_dispatch_commit_together(
    store: SQLiteStore, make_workflow: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    task_id = submit(store, make_workflow())
    claim(store)
    reply(store, task_id, "a", "ok", {"r": 1})
    before = snapshot(store)
    with monkeypatch.context() as m:
        m.setitem(store.queries, "insert_request", "INSERT INTO no_such_table VALUES (1)")
        with pytest.raises(OPERATIONAL_ERRORS):
            apply(store)
    assert snapshot(store) == before  # the step did not complete without its successor dispatched
    assert q(store, "SELECT status FROM replies") == [{"status": "new"}]
    assert apply(store).accepted == 1
    assert states(store, task_id) == ("processing", ["completed", "running", "pending"])


def test_a_task_runs_to_processed_and_reports_on_its_reply_queue(
    store: Store, make_workflow: Factory
) -> None:
    task_id = submit(store, make_workflow(), correlation_id="order-7", reply_to="web-1")
    claim(store)
    for name in ("a", "b", "c"):
        r = complete(store, task_id, name, {"out": name})
    assert r.finished == [(task_id, "processed")]
    assert states(store, task_id) == ("processed", ["completed"] * 3)
    assert task(store, task_id)["locked_by"] is None and task(store, task_id)["finished_at"] is not None
    msgs = q(store, "SELECT kind, correlation_id, body FROM messages WHERE queue = 'web-1' ORDER BY id")
    assert [m["kind"] for m in msgs] == [
        "received",
        "step_completed",
        "step_completed",
        "step_completed",
        "processed",
    ]
    assert {m["correlation_id"] for m in msgs} == {"order-7"}
    assert json.loads(msgs[-1]["body"])["results"] == {
        "a": {"out": "a"},
        "b": {"out": "b"},
        "c": {"out": "c"},
    }


@pytest.mark.parametrize(("late_by", "accepted"), [(0.0, True), (0.001, False), (5.0, False)])
def test_reply_after_complete_by_is_stale_and_changes_nothing(
    store: Store, clock: FakeClock, make_workflow: Factory, late_by: float, accepted: bool
) -> None:
    task_id = submit(store, make_workflow())
    claim(store)
    [msg] = take(store)
    clock.advance(10.0 + late_by)
    send(store, msg.id, "ok", {"late": True})
    before = snapshot(store)
    r = apply(store)
    if accepted:  # exactly at complete-by is still in time
        assert (r.accepted, r.stale) == (1, 0)
        assert step(store, task_id, "a")["state"] == "completed"
        return
    assert (r.accepted, r.stale) == (0, 1)
    assert snapshot(store) == before
    assert states(store, task_id) == ("processing", ["running", "pending", "pending"])
    assert q(store, "SELECT status FROM replies") == [{"status": "stale"}]
    stale = q(store, "SELECT step_idx, attempt, detail FROM events WHERE kind = 'stale_reply'")
    assert [(e["step_idx"], e["attempt"], json.loads(e["detail"])["current_attempt"]) for e in stale] == [
        (0, 1, 1)
    ]


def test_late_reply_of_an_old_attempt_after_a_rescue_is_stale(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)
    task_id = submit(store, make_workflow())
    claim(store)
    [old] = take(store)
    clock.advance(10.5)
    assert sweep(store, term).rescued == 1
    clock.advance(10.0)  # the back-off
    assert claim(store) == 1
    [new] = take(store)
    assert (old.attempt, new.attempt) == (1, 2)
    assert old.idempotency_key == new.idempotency_key  # stable across attempts
    send(store, old.id, "ok", {"from": "attempt 1"})  # the slow agent finally answers
    before = snapshot(store)
    r = apply(store)
    assert (r.accepted, r.stale) == (0, 1)
    assert snapshot(store) == before
    a = step(store, task_id, "a")
    assert (a["state"], a["attempt"], a["result"]) == ("running", 2, None)
    # the current attempt still completes normally afterwards
    send(store, new.id, "ok", {"from": "attempt 2"})
    assert apply(store).accepted == 1
    a = step(store, task_id, "a")
    assert (a["state"], json.loads(a["result"])) == ("completed", {"from": "attempt 2"})
    assert step(store, task_id, "b")["state"] == "running"


def test_a_reply_for_the_wrong_kind_or_a_finished_step_is_stale(store: Store, make_workflow: Factory) -> None:
    task_id = submit(store, make_workflow())
    claim(store)
    reply(store, task_id, "a", "ok", 1)
    reply(store, task_id, "a", "ok", 2)  # a duplicate reply to the same attempt
    r = apply(store)
    assert (r.accepted, r.stale) == (1, 1)
    assert json.loads(step(store, task_id, "a")["result"]) == 1


# -- the supervisor's sweep ------------------------------------------------------------------------


def test_sweep_rescues_only_expired_attempts_and_backs_off(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)
    wf = make_workflow()
    early = submit(store, wf)
    claim(store)
    clock.advance(5.0)
    later = submit(store, wf)
    claim(store)
    clock.advance(5.5)  # early's attempt expired 0.5 s ago; later's has 4.5 s left
    later_before = (task(store, later), steps(store, later), requests(store, later))
    r = sweep(store, term)
    assert (r.rescued, r.escalated) == (1, 0)
    assert (task(store, later), steps(store, later), requests(store, later)) == later_before
    a = step(store, early, "a")
    assert (a["state"], a["failure_count"], a["attempt"], a["locked_by"], a["complete_by"]) == (
        "pending",
        1,
        1,
        None,
        None,
    )
    assert "passed complete-by" in a["last_error"]
    row = task(store, early)
    assert (row["state"], row["locked_by"], row["failure_count"]) == ("pending", None, 1)
    assert row["run_at"] == pytest.approx(clock.wall() + 10.0, abs=1e-6)
    assert (requests(store, early)[0]["state"], requests(store, early)[0]["outcome"]) == (
        "expired",
        "expired",
    )
    assert event_kinds(store, early)[-2:] == ["rescued", "retry_scheduled"]
    # not claimable until the back-off has passed on the database clock
    clock.advance(9.875)
    assert claim(store) == 0
    clock.advance(0.125)
    assert claim(store) == 1
    a = step(store, early, "a")
    assert (a["state"], a["attempt"], a["failure_count"]) == ("running", 2, 1)
    # a second expiry doubles the back-off
    clock.advance(10.5)
    sweep(store, term)
    assert task(store, early)["run_at"] == pytest.approx(clock.wall() + 20.0, abs=1e-6)


def test_sweep_leaves_an_expired_attempt_whose_reply_is_waiting(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)
    task_id = submit(store, make_workflow())
    claim(store)
    clock.advance(9.0)
    reply(store, task_id, "a", "ok", {"x": 1})  # in time, not yet applied
    clock.advance(2.0)
    assert sweep(store, term).rescued == 0
    assert apply(store).accepted == 1
    assert step(store, task_id, "a")["state"] == "completed"


def test_reaching_max_failures_escalates_to_error_with_an_alert(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)
    wf = make_workflow("a", "b", retry=Retry(max_failures=2, backoff=Backoff(initial=10, jitter=0)))
    task_id = submit(store, wf)
    claim(store)
    complete(store, task_id, "a")
    clock.advance(10.5)
    assert sweep(store, term).escalated == 0
    clock.advance(10.0)
    claim(store)
    clock.advance(10.5)
    r = sweep(store, term)
    assert (r.rescued, r.escalated) == (1, 1)
    assert states(store, task_id) == ("error", ["completed", "failed"])
    assert step(store, task_id, "b")["failure_count"] == 2
    [al] = alerts(store)
    assert (al["kind"], al["task_id"], al["step"]) == ("task_error", task_id, "b")
    assert "'b' failed after 2 failure(s)" in al["message"]
    assert r.alerts[0]["id"] == al["id"]
    assert event_kinds(store, task_id)[-1] == "error"
    clock.advance(1000.0)
    assert claim(store) == 0 and sweep(store, term).rescued == 0  # an error task stays put


def test_reaching_max_failures_can_compensate_in_reverse_order(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)
    escalate = Retry(max_failures=1, escalation="compensate")
    wf = make_workflow("a", "b", "c", "d", steps={"c": {"retry": escalate}})
    task_id = submit(store, wf, reply_to="web-1")
    claim(store)
    complete(store, task_id, "a", {"reserved": "r-1"})
    complete(store, task_id, "b", {"charged": "c-1"})
    assert 2 in [m.step_idx for m in take(store)]  # an agent takes c's request: it may reach the service
    clock.advance(10.5)  # c's only attempt expires
    r = sweep(store, term)
    assert (r.rescued, r.escalated) == (1, 1)
    assert states(store, task_id) == ("compensating", ["completed", "completed", "compensating", "skipped"])
    undo_order = []
    for _ in range(3):
        req = requests(store, task_id)[-1]
        assert req["kind"] == "undo"
        name = steps(store, task_id)[req["step_idx"]]["name"]
        undo_order.append(name)
        assert (req["attempt"], req["operation"], req["idempotency_key"]) == (
            2,
            f"undo_{name}",
            f"{task_id}:{name}",
        )
        payload = json.loads(req["payload"])
        assert payload["undo"] == {"a": {"reserved": "r-1"}, "b": {"charged": "c-1"}, "c": None}[name]
        complete(store, task_id, name)
    assert undo_order == ["c", "b", "a"]
    assert states(store, task_id) == ("compensated", ["compensated", "compensated", "compensated", "skipped"])
    assert [m["kind"] for m in q(store, "SELECT kind FROM messages ORDER BY id")][-2:] == [
        "step_compensated",
        "compensated",
    ]
    assert alerts(store) == []


def test_a_step_no_agent_took_is_not_undone_and_its_dead_agent_does_not_block_the_undo_of_the_rest(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """Found by review (CMP2, CMP3): c's request was never taken (its agent, which also runs its
    undo, is down), its attempt expired, and the escalation compensated. c's undo went to the same
    dead agent, failed for good, and the task ended ``error`` with a and b un-undone, the alert
    saying c's effect "is NOT undone" though c never reached its service."""
    term = lease(store)
    escalate = Retry(max_failures=1, escalation="compensate")
    wf = make_workflow("a", "b", "c", steps={"c": {"retry": escalate}})
    task_id = submit(store, wf, reply_to="web-1")
    claim(store)
    complete(store, task_id, "a")
    complete(store, task_id, "b")
    clock.advance(10.5)  # c's request expires queued: no agent took it
    r = sweep(store, term)
    assert (r.rescued, r.escalated) == (1, 1)
    undone = []
    for _ in range(2):
        req = requests(store, task_id)[-1]
        assert req["kind"] == "undo"
        undone.append(steps(store, task_id)[req["step_idx"]]["name"])
        complete(store, task_id, undone[-1])
    assert undone == ["b", "a"]
    assert states(store, task_id) == ("compensated", ["compensated", "compensated", "failed"])
    assert [r["step_idx"] for r in requests(store, task_id) if r["kind"] == "undo"] == [1, 0]
    final = q(store, "SELECT body FROM messages WHERE kind = 'compensated'")
    assert [json.loads(m["body"]).get("not_undone") for m in final] == [None]  # nothing left standing
    assert alerts(store) == []


def test_wait_escalation_retries_after_the_extended_wait_and_alerts_once(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """Each wait is escalation_wait spread by the back-off's jitter (tasks escalated together by
    one outage do not all come back at once), and the alert is raised when the step first
    escalates, not again at every wait of the same outage (it used to be one per wait, for ever)."""
    term = lease(store)
    wait = 300.0
    wf = make_workflow("a", retry=Retry(max_failures=1, escalation="wait", escalation_wait=wait))
    task_id = submit(store, wf)
    delays = []
    for cycle in range(3):
        assert claim(store) == 1, f"cycle {cycle}: the task was not claimable after its wait"
        clock.advance(10.5)  # past complete-by (10 s)
        r = sweep(store, term)
        assert (r.rescued, r.escalated) == (1, 0)
        assert task(store, task_id)["state"] == "pending"
        delay = task(store, task_id)["run_at"] - clock.wall()
        assert wait * 0.8 - 1e-6 <= delay <= wait * 1.2 + 1e-6, delay  # Backoff's default jitter 0.2
        delays.append(delay)
        clock.advance(delay - 1.0)
        assert claim(store) == 0, "claimed before its wait was over"
        clock.advance(1.0)
    assert all(d != pytest.approx(wait) for d in delays), "not spread (the sweep's rng is seeded here)"
    assert [a["kind"] for a in alerts(store)] == ["step_escalated"]
    assert q(store, "SELECT failure_count FROM steps")[0]["failure_count"] == 3


# -- error replies -----------------------------------------------------------------------------------


def test_transient_retry_reply_counts_a_failure_and_backs_off(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    task_id = submit(store, make_workflow())
    claim(store)
    reply(store, task_id, "a", "retry", error="transient: 503")
    apply(store)
    a = step(store, task_id, "a")
    assert (a["state"], a["failure_count"], a["last_error"]) == ("pending", 1, "transient: 503")
    assert task(store, task_id)["run_at"] == pytest.approx(clock.wall() + 10.0, abs=1e-6)
    assert claim(store) == 0


def test_permanent_error_reply_applies_on_error_at_once(store: Store, make_workflow: Factory) -> None:
    task_id = submit(store, make_workflow(retry=Retry(max_failures=5)))
    claim(store)
    complete(store, task_id, "a")
    reply(store, task_id, "b", "error", error="card declined")
    r = apply(store)
    assert r.finished == [(task_id, "error")]
    assert states(store, task_id) == ("error", ["completed", "failed", "pending"])
    assert step(store, task_id, "b")["failure_count"] == 1  # far below max_failures: no retry
    [al] = alerts(store)
    assert (al["kind"], al["step"]) == ("task_error", "b")
    assert "card declined" in al["message"]
    assert task(store, task_id)["last_error"] == "card declined"


def test_permanent_error_with_on_error_compensate_undoes_started_steps(
    store: Store, make_workflow: Factory
) -> None:
    wf = make_workflow(steps={"b": {"on_error": "compensate", "compensate": None}})
    task_id = submit(store, wf)
    claim(store)
    complete(store, task_id, "a")
    reply(store, task_id, "b", "error", error="card declined")
    apply(store)
    assert states(store, task_id) == ("compensating", ["compensating", "failed", "skipped"])
    assert last_request(store, task_id, "a")["kind"] == "undo"
    complete(store, task_id, "a")
    assert states(store, task_id) == ("compensated", ["compensated", "failed", "skipped"])
    assert alerts(store) == []


def test_a_compensation_that_keeps_failing_ends_in_error_naming_the_step(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)
    wf = make_workflow(steps={"b": {"on_error": "compensate", "compensate": None}})  # 3 failures allowed
    task_id = submit(store, wf)
    claim(store)
    complete(store, task_id, "a")
    reply(store, task_id, "b", "error", error="declined")
    apply(store)
    # undo of a: 1st attempt says "retry", 2nd expires, 3rd says "retry" again
    reply(store, task_id, "a", "retry", error="transient: 502")
    apply(store)
    assert (task(store, task_id)["state"], step(store, task_id, "a")["comp_failures"]) == ("compensating", 1)
    assert claim(store) == 0  # backing off
    clock.advance(10.0)
    assert claim(store) == 1
    clock.advance(10.5)
    assert sweep(store, term).rescued == 1
    clock.advance(20.0)
    assert claim(store) == 1
    assert [r["kind"] for r in requests(store, task_id) if r["step_idx"] == 0] == [
        "do",
        "undo",
        "undo",
        "undo",
    ]
    reply(store, task_id, "a", "retry", error="transient: 502")
    r = apply(store)
    assert states(store, task_id) == ("error", ["failed", "failed", "skipped"])
    [al] = alerts(store)
    assert (al["kind"], al["task_id"], al["step"]) == ("compensation_failed", task_id, "a")
    # b declared no undo, and the agent that took its request answered: its call may have
    # applied its effect all the same, so it is named as standing (see not_undone)
    assert "NOT undone" in al["message"] and "still standing: 'b'" in al["message"], al["message"]
    assert r.alerts[0]["kind"] == "compensation_failed"


def _undo_of_b_fails_for_good(store: Store, make_workflow: Factory, cancel: bool) -> int:
    """a and b done, c running; undoing (after a cancel, or c's permanent failure) c succeeds and
    b's undo is refused for good: the task ends in error while being undone."""
    wf = make_workflow(steps={"c": {"on_error": "compensate"}})
    task_id = submit(store, wf, reply_to="web-1")
    claim(store)
    complete(store, task_id, "a")
    complete(store, task_id, "b")
    if cancel:
        store.transact_sync(t.cancel_task, task_id, "operator")
        complete(store, task_id, "c")  # c's own reply comes, then the undo begins
    else:
        reply(store, task_id, "c", "error", error="out of stock")
        apply(store)
    assert last_request(store, task_id, "c")["kind"] == "undo"
    complete(store, task_id, "c")
    assert last_request(store, task_id, "b")["kind"] == "undo"
    reply(store, task_id, "b", "error", error="refund refused")
    apply(store)
    assert states(store, task_id) == ("error", ["completed", "failed", "compensated"])
    return task_id


@pytest.mark.parametrize("cancel", [True, False], ids=["after-cancel", "after-escalation"])
def test_retry_of_a_task_whose_undo_failed_resumes_the_undo_not_the_steps(
    store: Store, make_workflow: Factory, cancel: bool
) -> None:
    """A retry used to resume from the first step not completed, b, running b and c forward again
    over c's undone effect (and dropping the cancel)."""
    task_id = _undo_of_b_fails_for_good(store, make_workflow, cancel)
    before = len(requests(store, task_id))
    # The CLI and the dashboard print what it did (they used to say "pending again").
    assert store.transact_sync(t.retry_task, task_id, None, "operator") == "compensating"
    assert t.describe_retry(task_id, "compensating", None) == (
        f"task {task_id} is compensating again: its undo resumes where it failed"
    )
    assert states(store, task_id) == ("compensating", ["completed", "failed", "compensated"])
    assert step(store, task_id, "b")["comp_failures"] == 0  # a fresh budget for the undo
    assert claim(store) == 1
    new = requests(store, task_id)[before:]
    assert [(r["step_idx"], r["kind"]) for r in new] == [(1, "undo")]
    complete(store, task_id, "b")
    complete(store, task_id, "a")
    final = "cancelled" if cancel else "compensated"
    assert states(store, task_id) == (final, ["compensated", "compensated", "compensated"])
    assert all(r["kind"] == "undo" for r in requests(store, task_id)[before:])
    with pytest.raises(InputError, match="undo"):  # and a step to resume from is refused, writing nothing
        fresh = _undo_of_b_fails_for_good(store, make_workflow, cancel)
        store.transact_sync(t.retry_task, fresh, "b", "operator")
    assert states(store, fresh) == ("error", ["completed", "failed", "compensated"])


@pytest.mark.parametrize("cancel", [False, True], ids=["undo-after-a-failure", "undo-of-a-cancel"])
def test_cancel_of_a_task_whose_undo_failed_gives_the_undo_its_full_budget(
    store: Store, clock: FakeClock, make_workflow: Factory, cancel: bool
) -> None:
    """Cancelling it resumed the undo with its failures still counted: of the policy's 3, the
    first refusal had used one, so the second transient failure ended the task in error again,
    with a second compensation_failed alert. It resumes the undo as a retry does, so an undo that
    c's failure began ends compensated, which says why (it ended cancelled); one a cancel began
    ends cancelled."""
    task_id = _undo_of_b_fails_for_good(store, make_workflow, cancel=cancel)
    assert store.transact_sync(t.cancel_task, task_id, "operator") == "compensating"
    for _ in range(2):
        assert claim(store) == 1
        reply(store, task_id, "b", "retry", error="transient: 502")
        apply(store)
        assert task(store, task_id)["state"] == "compensating"
        clock.advance(60.0)  # past the back-off
    assert [a["kind"] for a in alerts(store)] == ["compensation_failed"]
    assert claim(store) == 1
    complete(store, task_id, "b")
    complete(store, task_id, "a")
    final = "cancelled" if cancel else "compensated"
    assert states(store, task_id) == (final, ["compensated", "compensated", "compensated"])


# -- cancel and retry -----------------------------------------------------------------------------------


def test_cancel_of_a_pending_task_compensates_its_started_steps_then_ends_cancelled(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)
    task_id = submit(store, make_workflow(), reply_to="web-1")
    claim(store)
    complete(store, task_id, "a")
    clock.advance(10.5)
    sweep(store, term)  # b is backing off: the task is pending, unlocked
    assert task(store, task_id)["state"] == "pending"
    assert store.transact_sync(t.cancel_task, task_id, "operator") == "compensating"
    assert states(store, task_id) == ("compensating", ["completed", "pending", "skipped"])
    assert claim(store) == 1  # at once, not after the back-off
    # b started, but its request expired queued: no agent took it, it never reached its service,
    # so only a is undone (b's undo would undo nothing: CMP2 undoes what may have taken effect)
    assert last_request(store, task_id, "b")["kind"] == "do"
    assert last_request(store, task_id, "a")["kind"] == "undo"
    complete(store, task_id, "a")
    assert states(store, task_id) == ("cancelled", ["compensated", "failed", "skipped"])
    body = json.loads(q(store, "SELECT body FROM messages ORDER BY id DESC LIMIT 1")[0]["body"])
    assert "not_undone" not in body, body
    kinds = event_kinds(store, task_id)
    assert kinds.index("cancel_requested") < kinds.index("cancelled") == len(kinds) - 1
    assert q(store, "SELECT kind FROM messages ORDER BY id DESC LIMIT 1") == [{"kind": "cancelled"}]


def test_cancel_of_a_task_that_never_started_ends_cancelled_without_undo(
    store: Store, make_workflow: Factory
) -> None:
    task_id = submit(store, make_workflow())
    store.transact_sync(t.cancel_task, task_id, "operator")
    assert claim(store) == 1
    assert states(store, task_id) == ("cancelled", ["skipped"] * 3)
    assert requests(store, task_id) == []


def test_cancel_while_a_step_runs_takes_effect_when_its_reply_arrives(
    store: Store, make_workflow: Factory
) -> None:
    task_id = submit(store, make_workflow())
    claim(store)
    complete(store, task_id, "a")
    assert store.transact_sync(t.cancel_task, task_id, "operator") == "processing"
    assert states(store, task_id) == ("processing", ["completed", "running", "pending"])
    assert claim(store) == 0
    assert len(requests(store, task_id)) == 2  # nothing new dispatched yet
    complete(store, task_id, "b")
    assert states(store, task_id) == ("compensating", ["completed", "compensating", "skipped"])
    complete(store, task_id, "b")
    complete(store, task_id, "a")
    assert states(store, task_id) == ("cancelled", ["compensated", "compensated", "skipped"])


def test_cancel_is_honoured_when_the_running_step_then_fails(store: Store, make_workflow: Factory) -> None:
    task_id = submit(store, make_workflow())
    claim(store)
    complete(store, task_id, "a")
    store.transact_sync(t.cancel_task, task_id, "operator")
    reply(store, task_id, "b", "error", error="card declined")  # the running step fails for good
    apply(store)
    # the operator asked to undo the task: what it started is compensated and it ends cancelled
    assert task(store, task_id)["state"] == "compensating"
    for name in ("b", "a"):
        assert last_request(store, task_id, name)["kind"] == "undo"
        complete(store, task_id, name)
    assert states(store, task_id) == ("cancelled", ["compensated", "compensated", "skipped"])


def test_cancel_refuses_finished_tasks_and_unknown_ids(store: Store, make_workflow: Factory) -> None:
    task_id = submit(store, make_workflow("a"))
    claim(store)
    complete(store, task_id, "a")
    with pytest.raises(InputError, match="already processed"):
        store.transact_sync(t.cancel_task, task_id, "operator")
    with pytest.raises(NotFound):
        store.transact_sync(t.cancel_task, 999, "operator")


def test_a_compensated_task_names_the_completed_steps_it_had_no_undo_for(
    store: Store, make_workflow: Factory
) -> None:
    """CMP1 makes an undo optional: a step that declares none keeps its effect. The outcome says
    so (event and reply-queue message ``not_undone``), so that "compensated" is not read as
    "every effect undone"; a task whose every step has an undo says nothing of the kind."""
    wf = make_workflow(steps={"a": {"compensate": None}, "b": {"on_error": "compensate"}})
    task_id = submit(store, wf, reply_to="web")
    claim(store)
    complete(store, task_id, "a")
    reply(store, task_id, "b", "error", error="card declined")
    apply(store)
    complete(store, task_id, "b")  # b's undo (a failed step is undone too); a has none
    assert states(store, task_id) == ("compensated", ["completed", "compensated", "skipped"])
    last = q(store, "SELECT kind, body FROM messages ORDER BY id DESC LIMIT 1")[0]
    assert last["kind"] == "compensated"
    assert json.loads(last["body"])["not_undone"] == ["a"]
    ended = q(store, "SELECT detail FROM events WHERE kind = 'compensated'")[0]
    assert json.loads(ended["detail"])["not_undone"] == ["a"]
    other = submit(store, make_workflow(steps={"b": {"on_error": "compensate"}}), reply_to="web")
    claim(store)
    complete(store, other, "a")
    reply(store, other, "b", "error", error="card declined")
    apply(store)
    complete(store, other, "b")
    complete(store, other, "a")
    last = q(store, "SELECT kind, body FROM messages ORDER BY id DESC LIMIT 1")[0]
    assert last["kind"] == "compensated" and "not_undone" not in json.loads(last["body"])


@pytest.mark.parametrize("agents", ["none", "one, never taking it", "one, that took it"])
def test_an_expired_attempt_says_when_no_agent_took_its_request(
    store: Store, clock: FakeClock, make_workflow: Factory, agents: str
) -> None:
    """The step's error said only "passed complete-by", the same for a service that hung as for
    an agent name mistyped in the workflow, which no worker runs: the operator had nothing to go
    on. A request still queued at complete-by now says which it may be."""
    term = lease(store)
    task_id = submit(store, make_workflow("a", budget=5))
    claim(store)
    if agents != "none":
        store.transact_sync(sa.register, AGENT, [sa.InstanceSpec("svc", 4, 5, 5.0)])
    if agents == "one, that took it":
        assert len(take(store)) == 1
    clock.advance(6)
    assert sweep(store, term).rescued == 1
    error = step(store, task_id, "a")["last_error"]
    assert error.startswith("attempt 1 passed complete-by"), error
    if agents == "none":
        assert "never taken: no worker runs agent 'svc'" in error
    elif agents == "one, never taking it":
        assert "never taken by agent 'svc': its instances were busy" in error and "'do_a'" in error
    else:
        assert error == "attempt 1 passed complete-by"


@pytest.mark.parametrize("ends", ["timed out", "error reply", "never taken"])
def test_a_compensated_task_names_a_started_step_with_no_undo_that_failed(
    store: Store, clock: FakeClock, make_workflow: Factory, ends: str
) -> None:
    """A step with no undo that an agent took and that failed (its reply never came by
    complete-by, or an error came back) may have applied its effect all the same: a step with an
    undo is undone for that reason. The outcome names it in ``not_undone``; it named only
    completed steps, so this task ended ``compensated`` saying nothing, read as "every effect
    undone". A step whose request no agent took (it expired queued) reached no service: not named."""
    wf = make_workflow(
        "a",
        "b",
        retry=Retry(max_failures=1, backoff=Backoff(initial=1.0, jitter=0.0)),
        steps={"b": {"compensate": None, "on_error": "compensate"}},
    )
    task_id = submit(store, wf, reply_to="web")
    claim(store)
    complete(store, task_id, "a")
    b = last_request(store, task_id, "b")
    if ends != "never taken":
        assert b["id"] in [m.id for m in take(store)]  # the agent calls b's service ...
    if ends == "error reply":
        send(store, b["id"], "error", error="card declined")
        apply(store)
    else:  # ... and its reply is lost, or no agent takes the request
        clock.advance(11)
        assert sweep(store, lease(store)).rescued == 1
    complete(store, task_id, "a")  # a's undo
    assert states(store, task_id) == ("compensated", ["compensated", "failed"])
    last = q(store, "SELECT kind, body FROM messages ORDER BY id DESC LIMIT 1")[0]
    ended = q(store, "SELECT detail FROM events WHERE kind = 'compensated'")[0]
    named = ["b"] if ends != "never taken" else None
    assert (last["kind"], json.loads(last["body"]).get("not_undone")) == ("compensated", named)
    assert json.loads(ended["detail"] or "{}").get("not_undone") == named


def test_an_undo_that_fails_for_good_names_every_step_left_standing(
    store: Store, make_workflow: Factory
) -> None:
    """CMP3: the undo stops at the step whose compensation failed, so the steps before it keep
    their effects too. The alert, the ``error`` event and the reply-queue message name them all;
    the alert named only the failed step, which read as if the rest had been undone."""
    task_id = _undo_of_b_fails_for_good(store, make_workflow, cancel=False)
    [al] = alerts(store)
    assert (al["kind"], al["task_id"], al["step"]) == ("compensation_failed", task_id, "b")
    assert "'b' failed (refund refused); its effect is NOT undone; still standing: 'a'" in al["message"]
    last = q(store, "SELECT kind, body FROM messages ORDER BY id DESC LIMIT 1")[0]
    assert (last["kind"], json.loads(last["body"])["not_undone"]) == ("error", ["a", "b"])
    ended = q(store, "SELECT detail FROM events WHERE kind = 'error'")[0]
    assert json.loads(ended["detail"])["not_undone"] == ["a", "b"]


def test_cancel_of_a_task_undone_after_a_failure_is_refused_and_writes_nothing(
    store: Store, make_workflow: Factory
) -> None:
    """Its undo began because b failed; a cancel would only turn the outcome into "cancelled"
    and lose why. It is refused (InputError: exit 2 from the CLI) and the task ends compensated."""
    task_id = submit(store, make_workflow(steps={"b": {"on_error": "compensate"}}), reply_to="web")
    claim(store)
    complete(store, task_id, "a")
    reply(store, task_id, "b", "error", error="card declined")
    apply(store)
    assert task(store, task_id)["state"] == "compensating"
    before = snapshot(store)
    with pytest.raises(InputError, match="already being undone after a step failed; it will end compensated"):
        store.transact_sync(t.cancel_task, task_id, "operator")
    assert snapshot(store) == before
    complete(store, task_id, "b")
    complete(store, task_id, "a")
    assert states(store, task_id)[0] == "compensated"


def test_a_second_cancel_writes_nothing_and_a_cancel_that_begins_the_undo_records_it(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """A cancel of a task waiting out a back-off moves it to compensating at once: the event log
    says so (``compensating``, as when a scheduler begins an undo), not only ``cancel_requested``.
    Asking again changes nothing. A step that had started, has no undo and was waiting for its
    retry ends ``failed``, not ``pending`` in a finished task."""
    term = lease(store)
    task_id = submit(store, make_workflow(steps={"b": {"compensate": None}}), reply_to="web")
    claim(store)
    complete(store, task_id, "a")
    clock.advance(10.5)
    sweep(store, term)  # b's attempt expired: b is waiting out its back-off, the task unlocked
    assert store.transact_sync(t.cancel_task, task_id, "operator") == "compensating"
    assert event_kinds(store, task_id)[-2:] == ["cancel_requested", "compensating"]
    before = snapshot(store)
    assert store.transact_sync(t.cancel_task, task_id, "operator") == "compensating"
    assert snapshot(store) == before, "a second cancel wrote something"
    assert claim(store) == 1
    complete(store, task_id, "a")  # b has no undo: only a is undone
    assert states(store, task_id) == ("cancelled", ["compensated", "failed", "skipped"])


def _errored_at_b(store: Store, clock: FakeClock, wf: Workflow, term: int) -> int:
    """a completes; b expires once, then fails permanently: the task is error at b."""
    task_id = submit(store, wf)
    claim(store)
    complete(store, task_id, "a", {"a": 1})
    clock.advance(10.5)
    sweep(store, term)
    clock.advance(10.0)
    claim(store)
    reply(store, task_id, "b", "error", error="bad sku")
    apply(store)
    assert states(store, task_id) == ("error", ["completed", "failed", "pending"])
    return task_id


def test_retry_task_resumes_from_the_failed_step_with_a_fresh_failure_count(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)
    wf = make_workflow(retry=Retry(max_failures=2, backoff=Backoff(initial=10, jitter=0)))
    task_id = _errored_at_b(store, clock, wf, term)
    assert step(store, task_id, "b")["failure_count"] == 2
    store.transact_sync(t.retry_task, task_id, None, "operator")
    row = task(store, task_id)
    assert (row["state"], row["locked_by"], row["last_error"]) == ("pending", None, None)
    assert claim(store) == 1
    a, b, _ = steps(store, task_id)
    assert (a["state"], a["attempt"]) == ("completed", 1)  # never runs again
    assert (b["state"], b["attempt"]) == ("running", 3)
    assert json.loads(last_request(store, task_id, "b")["payload"])["results"] == {"a": {"a": 1}}
    # the retried step gets its full failure budget again: one expiry is a retry, not an escalation
    clock.advance(10.5)
    assert sweep(store, term).escalated == 0
    assert task(store, task_id)["state"] == "pending"
    clock.advance(10.0)
    claim(store)
    complete(store, task_id, "b")
    complete(store, task_id, "c")
    assert states(store, task_id) == ("processed", ["completed"] * 3)
    assert "retried" in event_kinds(store, task_id)


def test_the_alert_of_a_step_that_fails_again_after_a_retry_counts_what_its_policy_counted(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """Found by review: after an operator's retry the step escalated after 2 more failures, as
    its policy counts, but the alert said "failed after 4 failure(s)"."""
    term = lease(store)
    wf = make_workflow(retry=Retry(max_failures=2, backoff=Backoff(initial=10, jitter=0)))
    task_id = _errored_at_b(store, clock, wf, term)
    store.transact_sync(t.retry_task, task_id, None, "operator")
    for _ in range(2):
        clock.advance(10.0)
        assert claim(store) == 1
        clock.advance(10.5)
        sweep(store, term)
    assert states(store, task_id) == ("error", ["completed", "failed", "pending"])
    last = max(alerts(store), key=lambda a: a["id"])
    said = "'b' failed after 2 failure(s) since its last retry by an operator (4 in all)"
    assert said in last["message"], last


def test_retry_task_refuses_bad_states_and_steps(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)
    wf = make_workflow()
    running = submit(store, wf)
    claim(store)
    with pytest.raises(InputError, match="is processing"):
        store.transact_sync(t.retry_task, running, None, "operator")
    with pytest.raises(NotFound):
        store.transact_sync(t.retry_task, 999, None, "operator")
    failed = _errored_at_b(store, clock, wf, term)
    before = snapshot(store)
    with pytest.raises(InputError, match="has no step 'zz'; its steps are a, b, c"):
        store.transact_sync(t.retry_task, failed, "zz", "operator")
    with pytest.raises(InputError, match="step 'c' comes after step 'b'"):
        store.transact_sync(t.retry_task, failed, "c", "operator")
    assert snapshot(store) == before
    # from an earlier, completed step is allowed: it runs again
    store.transact_sync(t.retry_task, failed, "a", "operator")
    claim(store)
    assert step(store, failed, "a")["state"] == "running"


def test_a_reply_received_exactly_at_complete_by_is_accepted_and_one_just_after_is_stale(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """SCH4's boundary: "arrives before complete-by" includes the instant itself (the sweep
    expires an attempt only once complete_by < now). Found by mutation: `<=` made `<` was
    caught only by the randomised model test, after minutes of shrinking."""
    on_time = submit(store, make_workflow(budget=10.0))
    late = submit(store, make_workflow(budget=10.0))
    claim(store)
    clock.advance(10.0)
    reply(store, on_time, "a", "ok", {"n": 1})
    clock.advance(0.001)
    reply(store, late, "a", "ok", {"n": 2})
    r = apply(store)
    assert (r.accepted, r.stale) == (1, 1), r
    assert step(store, on_time, "a")["state"] == "completed"
    assert step(store, late, "a")["state"] == "running"  # the supervisor's, once it sweeps


def test_a_retry_from_an_earlier_step_runs_it_and_every_later_step_again_with_fresh_budgets(
    store: Store, make_workflow: Factory
) -> None:
    """OPS2, found by mutation: a retry that reset only the step it names (not the steps after
    it) left b ``completed`` and c ``failed``, so the task went on from a state that was no longer
    true; and the request of a step run again must carry only the results of steps completed
    before it (SCH3), not those of the later steps of the first run."""
    task_id = submit(store, make_workflow())
    claim(store)
    complete(store, task_id, "a", {"a": 1})
    claim(store)
    complete(store, task_id, "b", {"b": 2})
    claim(store)
    reply(store, task_id, "c", "error", error="bad sku")
    apply(store)
    assert states(store, task_id) == ("error", ["completed", "completed", "failed"])
    used = {s["name"]: s["failure_count"] for s in steps(store, task_id)}

    assert store.transact_sync(t.retry_task, task_id, "a", "operator") == "pending"
    assert states(store, task_id) == ("pending", ["pending", "pending", "pending"])
    for s in steps(store, task_id):  # each failure budget starts again from what it had used
        assert s["failure_offset"] == used[s["name"]], s
    for name, result in (("a", {"a": 10}), ("b", {"b": 20})):
        claim(store)
        payload = json.loads(last_request(store, task_id, name)["payload"])
        before = {"a": {}, "b": {"a": {"a": 10}}}[name]
        assert payload["results"] == before, payload  # nothing of the first run's later steps
        complete(store, task_id, name, result)
    claim(store)
    assert json.loads(last_request(store, task_id, "c")["payload"])["results"] == {
        "a": {"a": 10},
        "b": {"b": 20},
    }
    complete(store, task_id, "c")
    assert states(store, task_id) == ("processed", ["completed", "completed", "completed"])


@pytest.mark.parametrize("end", ["cancelled", "compensated"])
def test_retry_of_an_undone_task_is_refused_and_writes_nothing(
    store: Store, make_workflow: Factory, end: str
) -> None:
    """Its effects were undone. Run again, its steps would carry the same idempotency keys, which
    an idempotent service answers from its record of the first call without applying them: the
    task would end processed over undone effects (REL2). It used to restart from its first step."""
    task_id = submit(store, make_workflow(steps={"b": {"on_error": "compensate"}}))
    claim(store)
    complete(store, task_id, "a")
    if end == "cancelled":
        store.transact_sync(t.cancel_task, task_id, "operator")
        complete(store, task_id, "b")  # b's reply comes: then b and a are undone
    else:
        reply(store, task_id, "b", "error", error="card declined")  # b's on_error: compensate
        apply(store)
    complete(store, task_id, "b")
    complete(store, task_id, "a")
    assert task(store, task_id)["state"] == end
    before = snapshot(store)
    for step_name in (None, "a", "b"):
        with pytest.raises(InputError, match=f"is {end}: its effects were undone.*submit a new task"):
            store.transact_sync(t.retry_task, task_id, step_name, "operator")
    assert snapshot(store) == before


# -- fencing and batches -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["old-term", "other-holder", "expired", "taken-over"])
def test_sweep_with_a_lease_not_held_raises_lost_ownership_and_writes_nothing(
    store: Store, clock: FakeClock, make_workflow: Factory, case: str
) -> None:
    term = lease(store, ttl=60.0)
    submit(store, make_workflow())
    claim(store)
    clock.advance(30.0)  # the attempt is long expired; the lease still has 30 s
    me, use = SUP, term
    if case == "old-term":
        use = term - 1
    elif case == "other-holder":
        me = "sup-2:2:ddd"
    elif case == "expired":
        clock.advance(30.0)
    else:
        clock.advance(30.0)
        assert lease(store, holder="sup-2:2:ddd") == term + 1
    before = snapshot(store)
    n_events = count(store, "events")
    with pytest.raises(LostOwnership, match="supervisor"):
        sweep(store, use, me=me)
    assert snapshot(store) == before
    assert count(store, "events") == n_events


def test_sweep_is_bounded_by_its_batch_size(store: Store, clock: FakeClock, make_workflow: Factory) -> None:
    term = lease(store)
    ids = [submit(store, make_workflow()) for _ in range(5)]
    claim(store)
    clock.advance(10.5)
    assert [sweep(store, term, limit=2).rescued for _ in range(4)] == [2, 2, 1, 0]
    assert all(step(store, i, "a")["failure_count"] == 1 for i in ids)


def expired_backlog(
    store: Store, clock: FakeClock, make_workflow: Factory, batch: int
) -> tuple[int, Supervisor]:
    """Five tasks whose first attempts have expired, the supervisor's lease, and a supervisor
    that sweeps ``batch`` of them per transaction."""
    term = lease(store)
    for _ in range(5):
        submit(store, make_workflow())
    claim(store)
    clock.advance(10.5)
    return term, Supervisor(store, SUP, clock=clock, settings=SupervisorSettings(batch=batch))


def test_supervisor_sweeps_batch_after_batch_until_done(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term, sup = expired_backlog(store, clock, make_workflow, batch=2)
    sizes: list[int] = []
    real = store.sweep_expired

    async def spy(*args: Any) -> SweepResult:
        r = await real(*args)
        sizes.append(r.rescued)
        return r

    store.sweep_expired = spy  # type: ignore[method-assign,assignment]
    assert run(sup.sweep(term)).rescued == 5
    assert sizes == [2, 2, 1]


def test_each_committed_sweep_batch_is_progress_for_the_lease(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """A backlog swept batch after batch used to report progress only at the end: at a second per
    batch, ten batches passed stall_after (10 s) and the healthy leader gave up its lease."""
    from stepwarden.leader import Leadership

    term, sup = expired_backlog(store, clock, make_workflow, batch=1)
    leadership = Leadership("supervisor", SUP, term, clock)
    silent: list[float] = []
    real = store.sweep_expired

    async def slow(*args: Any) -> SweepResult:
        silent.append(clock.monotonic() - leadership.last_progress)
        clock.advance(1.0)  # each batch takes a second
        return await real(*args)

    store.sweep_expired = slow  # type: ignore[method-assign,assignment]
    assert run(sup.sweep(term, leadership)).rescued == 5
    assert len(silent) == 6 and max(silent) <= 1.0, silent


def test_a_worker_that_beats_again_after_its_verdict_is_not_rescued_nor_its_lease_taken(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """The verdict "no heartbeat for 3.5 s" is read before the rescue's transaction; a beat may
    commit in between (the worker's transactions waited on the same lock). The rescue and the
    lease take-over check the heartbeat again: before, the live worker's step was redone and the
    failure counted against its budget."""
    term = lease(store)
    task_id = submit(store, make_workflow())
    claim(store)
    run(store.worker_beat(AGENT, ["agent"], ["svc"]))
    assert len(take(store)) == 1
    clock.advance(3.5)  # silent past dead_after (3 s): judged dead...
    run(store.worker_beat(AGENT, ["agent"], ["svc"]))  # ...and then it beats
    rescue = store.transact_sync(
        t.rescue_orphans, SUP, "supervisor", term, AGENT, "no heartbeat for 3.5s", 10, random.Random(0), 3.0
    )
    assert rescue.rescued == 0 and step(store, task_id, "a")["failure_count"] == 0
    clock.advance(3.5)  # silent again, for real this time
    rescue = store.transact_sync(
        t.rescue_orphans, SUP, "supervisor", term, AGENT, "no heartbeat for 3.5s", 10, random.Random(0), 3.0
    )
    assert rescue.rescued == 1
    # the same for a lease whose holder beats again after it was judged
    other = "alerts"
    run(store.acquire_lease(other, AGENT, 60.0))
    held = store.transact_sync(t.lease_holder, other)
    assert held is not None
    clock.advance(3.5)
    run(store.worker_beat(AGENT, ["agent"], ["svc"]))
    assert store.transact_sync(t.take_lease, other, SUP, AGENT, int(held["term"]), 10.0, 3.0) is None
    clock.advance(3.5)
    assert store.transact_sync(t.take_lease, other, SUP, AGENT, int(held["term"]), 10.0, 3.0) is not None


def test_a_sweep_that_ends_a_task_says_which_for_the_processs_metrics_and_spans(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """Found by review: a task ended by the supervisor (its last attempt past complete-by) was
    counted by no worker's metrics and had no task span, as a task ended by a reply has; the
    sweep's result now names it."""
    term = lease(store)
    once = make_workflow("a", budget=10.0, retry=Retry(max_failures=1))
    twice = make_workflow("a", name="twice", budget=10.0)
    ended, retried = submit(store, once), submit(store, twice)
    claim(store)
    clock.advance(10.5)
    r = sweep(store, term)
    assert (r.rescued, r.finished) == (2, [(ended, "error")]), r
    assert task(store, ended)["state"] == "error" and task(store, retried)["state"] == "pending"


def test_a_step_rescued_from_a_dead_worker_is_retried_at_once_without_back_off(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """Found by mutation: a dead worker's step is rescued without waiting for its complete-by and
    counted as a failure, but retried at once: the service did nothing wrong, so there is nothing
    to spare it from. With the step's back-off (10 s in make_workflow's policy) the rescue's
    head start was lost."""
    term = lease(store)
    task_id = submit(store, make_workflow())
    claim(store)
    run(store.worker_beat(AGENT, ["agent"], ["svc"]))
    assert len(take(store)) == 1  # AGENT holds the step, then dies
    clock.advance(3.5)
    rescue = store.transact_sync(
        t.rescue_orphans, SUP, "supervisor", term, AGENT, "process gone", 10, random.Random(0), 3.0
    )
    assert rescue.rescued == 1 and step(store, task_id, "a")["failure_count"] == 1
    row = task(store, task_id)
    assert row["state"] == "pending" and row["waiting"] == 0
    assert row["run_at"] == pytest.approx(clock.wall()), (row["run_at"], clock.wall())
    [retry] = q(store, "SELECT detail FROM events WHERE task_id = ? AND kind = 'retry_scheduled'", task_id)
    assert json.loads(retry["detail"])["delay"] == 0, retry
    assert claim(store) == 1  # claimable now, not 10 s later


# -- pruning finished tasks (the leader keeps the hot tables small) ----------------------------------


def prune(store: Store, term: int, retention: float, limit: int = 100, me: str = SUP) -> int:
    return store.transact_sync(t.prune, me, "supervisor", term, retention, limit)


def finish(store: Store, wf: Workflow) -> int:
    task_id = submit(store, wf, reply_to="app")  # status messages too
    claim(store)
    for name in ("a", "b", "c"):
        take(store)
        complete(store, task_id, name)
    assert task(store, task_id)["state"] == "processed"
    return task_id


def rows_of(store: Store, task_id: int) -> dict[str, int]:
    tables = ("steps", "requests", "replies", "events", "messages")
    out = {
        tb: q(store, f"SELECT count(*) AS n FROM {tb} WHERE task_id = ?", task_id)[0]["n"] for tb in tables
    }
    out["tasks"] = q(store, "SELECT count(*) AS n FROM tasks WHERE id = ?", task_id)[0]["n"]
    return out


def test_prune_deletes_finished_tasks_past_retention_with_all_their_rows_and_keeps_the_rest(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    wf = make_workflow()
    term = lease(store)
    old = [finish(store, wf) for _ in range(3)]
    errored = submit(store, wf)
    claim(store)
    store.transact_sync(
        lambda tx: tx.sql(
            "UPDATE tasks SET state = 'error', finished_at = ? WHERE id = ?", (clock.wall(), errored)
        )
    )
    clock.advance(3600)
    recent = finish(store, wf)
    running = submit(store, wf)
    claim(store)
    assert all(n > 0 for n in rows_of(store, old[0]).values())

    assert prune(store, term, retention=1800) == 3
    for task_id in old:
        assert rows_of(store, task_id) == dict.fromkeys(
            ("steps", "requests", "replies", "events", "messages", "tasks"), 0
        )
    for task_id in (errored, recent, running):  # an error waits for an operator; the others are young
        assert rows_of(store, task_id)["tasks"] == 1 and rows_of(store, task_id)["steps"] == 3
    assert prune(store, term, retention=1800) == 0


def test_a_prune_that_deletes_messages_a_named_consumer_has_not_read_says_so_once_per_consumer(
    store: Store, clock: FakeClock, make_workflow: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """Documented: a consumer that lags by more than the retention misses the pruned messages. It
    was silent; the leader now warns, per consumer, with how many it lost. A consumer that read
    them all, or a queue nobody follows by name, gives no warning."""
    from stepwarden import replies

    wf = make_workflow()
    term = lease(store)
    old = [finish(store, wf) for _ in range(2)]
    store.transact_sync(replies.sequence, "app")
    positions = [int(r["seq"]) for r in q(store, "SELECT seq FROM messages WHERE queue = 'app' ORDER BY seq")]
    per_task = len(positions) // len(old)
    assert per_task >= 3 and len(positions) == per_task * len(old)
    store.transact_sync(replies.ack, "app", "slow", positions[1])  # read 2 of them
    store.transact_sync(replies.ack, "app", "fast", positions[-1])  # read them all
    clock.advance(3600)
    caplog.set_level(logging.WARNING, logger="stepwarden")
    sup = Supervisor(store, SUP, clock=clock, settings=SupervisorSettings(retention=1800, prune_batch=1))
    assert run(sup.prune(term)) == 2  # one task per transaction: the counts add up over them
    said = [r.getMessage() for r in caplog.records if "had not read" in r.getMessage()]
    assert said == [
        f"supervisor {SUP} pruned {len(positions) - 2} message(s) of reply queue 'app' that consumer"
        f" 'slow' had not read (it acknowledged up to position {positions[1]}): their tasks finished"
        " more than the retention (30.0m) ago; read the queue more often, or raise the retention"
    ]
    assert q(store, "SELECT count(*) AS n FROM messages")[0]["n"] == 0

    # An abandoned consumer (nothing removes its cursor) is not warned about at every prune (found
    # by review): at most once an hour, with the count since the last warning.
    def prune_more(tasks: int, after: float) -> list[str]:
        for _ in range(tasks):
            finish(store, wf)
        store.transact_sync(replies.sequence, "app")
        clock.advance(after)
        caplog.clear()
        run(sup.prune(term))
        return [r.getMessage() for r in caplog.records if "had not read" in r.getMessage()]

    # Half an hour on (past the retention): 'fast' has not read the new task's messages either
    # (its first warning); 'slow''s are counted, not said.
    [first] = prune_more(1, 1801)
    assert f"pruned {per_task} message(s) of reply queue 'app' that consumer 'fast'" in first, first
    [again] = prune_more(1, 1801)  # an hour after its warning: 'slow' again, with both tasks'
    assert f"pruned {2 * per_task} message(s) of reply queue 'app' that consumer 'slow'" in again, again


def test_a_reply_whose_task_was_pruned_meanwhile_is_deleted_not_left_behind(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """On PostgreSQL the prune skips a reply a reply batch holds (it must not wait for it) and
    deletes the task: the batch then finds the task gone. The reply goes too, with no event: no
    later prune would find it by its task."""
    wf = make_workflow()
    term = lease(store)
    gone = finish(store, wf)
    kept = submit(store, wf)
    clock.advance(100)
    assert prune(store, term, retention=10) == 1
    store.transact_sync(
        lambda tx: tx.sql(
            "INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, sent_by,"
            " received_at) VALUES (?, ?, 0, 1, 'do', 'ok', 'a late one', ?)",
            (424242, gone, clock.wall()),
        )
    )
    result = apply(store)
    assert (result.accepted, result.stale) == (0, 1)
    assert count(store, "replies") == 0
    assert q(store, "SELECT COUNT(*) AS n FROM events WHERE task_id = ?", gone)[0]["n"] == 0
    assert states(store, kept)[0] == "pending"


def test_prune_is_bounded_per_transaction_and_fenced_by_the_term(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    wf = make_workflow()
    term = lease(store)
    done = [finish(store, wf) for _ in range(5)]
    clock.advance(100)
    assert prune(store, term, retention=10, limit=2) == 2
    assert [rows_of(store, i)["tasks"] for i in done] == [0, 0, 1, 1, 1]  # oldest first
    with pytest.raises(LostOwnership):
        prune(store, term + 1, retention=10, limit=2)  # not the current term: nothing deleted
    assert [rows_of(store, i)["tasks"] for i in done] == [0, 0, 1, 1, 1]
    assert prune(store, term, retention=10, limit=10) == 3


# -- a worker that runs both roles takes its own dispatches in the same transaction ------------------


def test_a_scheduler_round_takes_the_requests_it_dispatches_up_to_the_room_given(
    store: Store, make_workflow: Factory
) -> None:
    wf = make_workflow()
    ids = [submit(store, wf) for _ in range(3)]
    applied, claimed, taken = run(store.schedule_and_take(ME, 10, {"svc": room(2)}))
    assert claimed == 3 and applied.accepted == 0
    assert [(m.task_id, m.attempt, m.agent) for m in taken] == [(ids[0], 1, "svc"), (ids[1], 1, "svc")]
    rows = q(store, "SELECT task_id, state, taken_by FROM requests ORDER BY task_id")
    assert [(r["state"], r["taken_by"]) for r in rows] == [("taken", ME), ("taken", ME), ("queued", None)]
    assert [m.task_id for m in take(store)] == [ids[2]]  # the rest is left to any agent


def test_a_reply_batch_applies_and_takes_the_next_steps_in_one_transaction(
    store: Store, make_workflow: Factory
) -> None:
    wf = make_workflow()
    task_id = submit(store, wf)
    claim(store)
    (msg,) = run(store.claim_requests(ME, ["svc"], 5))
    applied, taken = run(store.send_replies_and_take(ME, [(msg.id, "ok", {"a": 1}, None)], {"svc": room(1)}))
    assert applied is not None and applied.accepted == 1
    # Step a completed and step b was dispatched and taken, all in that one commit.
    assert [(m.task_id, m.step_idx, m.attempt) for m in taken] == [(task_id, 1, 1)]
    assert states(store, task_id) == ("processing", ["completed", "running", "pending"])
    assert last_request(store, task_id, "b")["taken_by"] == ME
    # Nothing is taken for an agent without room, or one this worker does not run.
    applied, taken = run(store.send_replies_and_take(ME, [(taken[0].id, "ok", None, None)], {}))
    assert applied is not None and applied.accepted == 1 and taken == []
    assert last_request(store, task_id, "c")["state"] == "queued"


def test_a_batchs_own_replies_are_written_once_settled_after_the_waiting_ones(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """A worker that applies its own replies writes each one once, already accepted or stale,
    with who applied it and when; a reply another agent left waiting in the table for the same
    batch is applied first (it came first) and marked as before. An own reply from an attempt
    the supervisor has since replaced is recorded stale, with its event, and changes nothing."""
    wf = make_workflow()
    term = lease(store)
    first, second = submit(store, wf), submit(store, wf)
    claim(store)
    by_task = {m.task_id: m for m in take(store)}
    run(store.send_replies(AGENT, [(by_task[first].id, "ok", {"by": "other"}, None)], apply=False))
    clock.advance(1)
    applied = run(store.send_replies(ME, [(by_task[second].id, "ok", {"by": "me"}, None)], apply=True))
    assert applied is not None and (applied.accepted, applied.stale) == (2, 0)
    rows = q(
        store,
        "SELECT task_id, status, sent_by, applied_by, received_at, applied_at, result"
        " FROM replies ORDER BY id",
    )
    assert [(r["task_id"], r["status"], r["sent_by"], r["applied_by"]) for r in rows] == [
        (first, "accepted", AGENT, ME),
        (second, "accepted", ME, ME),
    ]
    assert rows[1]["received_at"] == rows[1]["applied_at"] == clock.wall()
    assert json.loads(rows[1]["result"]) == {"by": "me"}
    assert [states(store, i)[1][:2] for i in (first, second)] == [["completed", "running"]] * 2
    # An attempt rescued meanwhile: its late reply, sent by the applying worker, is stale.
    [late] = [m for m in take(store) if m.task_id == first]
    clock.advance(10.5)
    assert sweep(store, term).rescued >= 1
    before = step(store, first, "b")
    applied = run(store.send_replies(ME, [(late.id, "ok", None, None)], apply=True))
    assert applied is not None and (applied.accepted, applied.stale) == (0, 1)
    assert q(store, "SELECT status FROM replies WHERE request_id = ?", late.id)[0]["status"] == "stale"
    assert step(store, first, "b") == before
    stale = q(store, "SELECT kind, attempt FROM events WHERE task_id = ? AND kind = 'stale_reply'", first)
    assert [(e["kind"], e["attempt"]) for e in stale] == [("stale_reply", 1)]
    assert q(store, "SELECT state FROM requests WHERE id = ?", late.id)[0]["state"] in ("replied", "expired")


def test_own_replies_come_after_a_waiting_one_for_the_same_attempt_and_keep_their_order(
    store: Store, make_workflow: Factory
) -> None:
    """Within one task the reply that waited in the table is applied first (it came first): the
    batch's own reply for the same attempt is then a duplicate, recorded stale. Several own
    replies are written in the order they arrived, whatever their tasks' order."""
    wf = make_workflow()
    first, second, third = (submit(store, wf) for _ in range(3))
    claim(store)
    by_task = {m.task_id: m for m in take(store)}
    run(store.send_replies(AGENT, [(by_task[first].id, "ok", {"by": "other"}, None)], apply=False))
    own = [(by_task[i].id, "ok", {"by": "me"}, None) for i in (third, first, second)]
    applied = run(store.send_replies(ME, own, apply=True))
    assert applied is not None and (applied.accepted, applied.stale) == (3, 1)
    rows = q(store, "SELECT task_id, status, sent_by FROM replies ORDER BY id")
    assert [(r["task_id"], r["status"], r["sent_by"]) for r in rows] == [
        (first, "accepted", AGENT),
        (third, "accepted", ME),
        (first, "stale", ME),
        (second, "accepted", ME),
    ]
    assert json.loads(step(store, first, "a")["result"]) == {"by": "other"}


def test_an_own_reply_whose_request_is_gone_writes_nothing_and_the_rest_apply(
    store: Store, make_workflow: Factory
) -> None:
    """A reply for a request that no longer exists (pruned before the batch read it) finds no
    attempt to answer: nothing is written for it, and the batch's other replies still apply."""
    wf = make_workflow()
    gone, kept = submit(store, wf), submit(store, wf)
    claim(store)
    by_task = {m.task_id: m for m in take(store)}
    store.transact_sync(lambda tx: tx.sql("DELETE FROM requests WHERE id = ?", (by_task[gone].id,)))
    replies = [(by_task[gone].id, "ok", None, None), (by_task[kept].id, "ok", None, None)]
    applied = run(store.send_replies(ME, replies, apply=True))
    assert applied is not None and (applied.accepted, applied.stale) == (1, 0)
    assert [r["task_id"] for r in q(store, "SELECT task_id FROM replies")] == [kept]
    assert states(store, gone)[1][0] == "running"
    assert states(store, kept)[1][:2] == ["completed", "running"]


def test_an_own_reply_for_a_pruned_task_writes_nothing(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """The request of an own reply can outlive its task only inside a prune's window; the batch then
    finds the task gone and records nothing (nothing would read it, no prune would find it)."""
    wf = make_workflow()
    task_id = submit(store, wf)
    claim(store)
    [msg] = take(store)
    store.transact_sync(lambda tx: tx.sql("DELETE FROM events WHERE task_id = ?", (task_id,)))
    store.transact_sync(lambda tx: tx.sql("DELETE FROM steps WHERE task_id = ?", (task_id,)))
    store.transact_sync(lambda tx: tx.sql("DELETE FROM tasks WHERE id = ?", (task_id,)))
    applied = run(store.send_replies(ME, [(msg.id, "ok", None, None)], apply=True))
    assert applied is not None and (applied.accepted, applied.stale) == (0, 1)
    assert count(store, "replies") == 0


def test_of_two_candidates_taking_a_dead_holders_lease_exactly_one_wins(store: Store) -> None:
    term = lease(store, holder="dead:1:aaa")
    first = store.transact_sync(t.take_lease, "supervisor", "sup-b:2:bbb", "dead:1:aaa", term, 5.0)
    second = store.transact_sync(t.take_lease, "supervisor", "sup-c:3:ccc", "dead:1:aaa", term, 5.0)
    assert first is not None and first[0] == term + 1 and second is None
    # A take naming a holder or term that is no longer current changes nothing either.
    assert store.transact_sync(t.take_lease, "supervisor", "sup-c:3:ccc", "sup-b:2:bbb", term, 5.0) is None
    row = q(store, "SELECT holder, term FROM leases WHERE name = 'supervisor'")[0]
    assert (row["holder"], row["term"]) == ("sup-b:2:bbb", term + 1)
    terms = q(store, "SELECT term, holder, ended_at FROM lease_terms ORDER BY term")
    assert [(r["term"], r["holder"], r["ended_at"] is not None) for r in terms] == [
        (term, "dead:1:aaa", True),
        (term + 1, "sup-b:2:bbb", False),
    ]
    with pytest.raises(LostOwnership):  # the old term's writes are refused from now on
        sweep(store, term, me="dead:1:aaa")


def test_a_renewal_or_resignation_of_an_earlier_term_by_the_same_holder_changes_nothing(
    store: Store, clock: FakeClock
) -> None:
    """LEAD1: a term is the fencing token, also against the same holder. A process that resigned
    term 1 and took term 2 (its leader loop restarted) may still have term 1's renewal or
    resignation in flight: matched by holder alone (found by mutation), the stale resignation
    expired the new term at once, and a stale renewal extended it as if term 1 were alive."""
    me = "sup-1:1:ccc"
    first = lease(store, holder=me, ttl=10.0)
    run(store.resign_lease("supervisor", me, first))
    second = lease(store, holder=me, ttl=10.0)
    assert second == first + 1

    def expires() -> float:
        return float(q(store, "SELECT expires_at FROM leases WHERE name = 'supervisor'")[0]["expires_at"])

    before = expires()
    clock.advance(2.0)
    assert run(store.renew_lease("supervisor", me, first, 10.0)) is False
    assert expires() == before, "a renewal naming the ended term extended the new one"
    run(store.resign_lease("supervisor", me, first))
    assert expires() == before, "a resignation naming the ended term ended the new one"
    assert run(store.renew_lease("supervisor", me, second, 10.0)) is True
    assert expires() > before
