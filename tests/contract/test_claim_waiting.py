"""Tasks waiting out a back-off stay out of the claim's way (SCH1, SUB5), on both stores.

An outage of one service leaves its tasks waiting, each until its retry is due. The claim used to
read them all, in priority order, to find the ones that were due: 30,000 of them cost every round
10 ms under SQLite's write lock, idle rounds included, so one service's outage slowed every other
workflow's claims. A task released with a delay is now marked waiting and kept in an index of its
own, ordered by when it is due: the claim reads the ready tasks' index as before and only the
due end of the waiting one.

What a claim reads is counted by the database, not timed: on PostgreSQL the rows its plan read
from ``tasks`` (``EXPLAIN ANALYZE``), on SQLite the virtual machine's steps for the statement.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from test_store import ME, Factory, apply, claim, event_kinds, race_two_schedulers, reply, submit, task

from stepwarden.clock import FakeClock
from stepwarden.policies import Backoff, Retry
from stepwarden.store import Store, open_store
from stepwarden.store.base import Tx


class _RolledBack(Exception):
    pass


def _read_by_plan(plan: dict[str, Any]) -> int:
    """Rows of ``tasks`` that a PostgreSQL plan's scans read, the filtered-out ones included."""
    own = 0
    if plan.get("Relation Name") == "tasks" and plan["Node Type"] != "ModifyTable":
        own = int(plan["Actual Rows"]) * int(plan.get("Actual Loops", 1)) + int(
            plan.get("Rows Removed by Filter", 0)
        )
    return own + sum(_read_by_plan(p) for p in plan.get("Plans", []))


def claim_cost(store: Store, limit: int = 10) -> tuple[int, list[int]]:
    """What one claim of up to ``limit`` tasks reads, and the ids it would claim; rolled back."""
    out: dict[str, Any] = {}

    def measure(tx: Tx) -> None:
        if store.dialect == "postgres":
            text = store.queries["claim_tasks"]  # type: ignore[attr-defined]  # psycopg's placeholders
            text = text.replace("%(me)s", f"'{ME}'").replace("%(limit)s", str(limit))
            mine = "SELECT id FROM tasks WHERE locked_by = ? ORDER BY id"
            before = {r["id"] for r in tx.sql(mine, (ME,))}
            row = tx.sql("EXPLAIN (ANALYZE, FORMAT JSON) " + text)[0]
            plan = next(iter(row.values()))
            plan = json.loads(plan) if isinstance(plan, str) else plan
            out["cost"] = _read_by_plan(plan[0]["Plan"])
            out["ids"] = [r["id"] for r in tx.sql(mine, (ME,)) if r["id"] not in before]
        else:
            conn = store._conn()  # type: ignore[attr-defined]  # this thread's: the one tx runs on
            steps = [0]

            def count() -> int:
                steps[0] += 1
                return 0

            conn.set_progress_handler(count, 1)
            try:
                rows = tx.all("claim_tasks", me=ME, limit=limit)
            finally:
                conn.set_progress_handler(None, 0)
            out["cost"], out["ids"] = steps[0], sorted(r["id"] for r in rows)
        raise _RolledBack

    with pytest.raises(_RolledBack):
        store.transact_sync(measure)
    return int(out["cost"]), list(out["ids"])


def waiting(store: Store, n: int, *, priority: int, delay: float) -> list[int]:
    """``n`` tasks released by the store's own ``release_task`` (as a failed attempt is) to wait
    ``delay`` seconds; written behind the store's back first, as claimed tasks, to be quick."""

    def make(tx: Tx) -> list[int]:
        ids = []
        for _ in range(n):
            row = tx.sql(
                "INSERT INTO tasks (workflow, workflow_version, state, input, priority, locked_by, run_at,"
                " created_at, updated_at) VALUES ('old', 1, 'processing', '{}', ?, 'gone:1:x', 0, 0, 0)"
                " RETURNING id",
                (priority,),
            )
            ids.append(int(row[0]["id"]))
        for task_id in ids:
            tx.put("release_task", task_id=task_id, state="pending", delay=delay, failed=1, error="502")
        return ids

    return store.transact_sync(make)


def test_a_claim_reads_no_more_with_thousands_of_tasks_waiting_out_a_back_off(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    wf = make_workflow("a")
    ready = [submit(store, wf, {"n": n}) for n in range(3)]
    waiting(store, 20, priority=5, delay=600.0)  # higher priority than the ready ones, not due
    few_cost, few_ids = claim_cost(store)
    assert few_ids == ready, "a waiting task was claimed before it was due, or a ready one left"
    waiting(store, 3000, priority=5, delay=600.0)
    many_cost, many_ids = claim_cost(store)
    assert many_ids == ready
    assert many_cost < 2 * few_cost + 50, (
        f"the claim read {many_cost} with 3,020 tasks waiting against {few_cost} with 20:"
        " it reads the waiting tasks"
    )
    # An idle round (nothing ready, nothing due) reads next to nothing either.
    assert claim(store, limit=10) == 3
    idle_cost, idle_ids = claim_cost(store)
    assert idle_ids == [] and idle_cost <= few_cost, (idle_cost, few_cost)


def test_a_due_waiting_task_is_claimed_in_priority_order_with_the_ready_ones(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """Two indexes, one order: a due task of higher priority comes before a ready one of lower
    priority, and a ready task of higher priority before a due one; one not yet due is left."""
    quick = make_workflow("a")  # its first retry waits 10 s
    slow = make_workflow(
        "a", name="slow", retry=Retry(max_failures=5, backoff=Backoff(1000.0, maximum=1000.0, jitter=0))
    )
    high_due = submit(store, quick, {"n": 1}, priority=5)
    not_due = submit(store, slow, {"n": 2}, priority=7)
    assert claim(store) == 2
    for task_id in (high_due, not_due):
        reply(store, task_id, "a", "retry", error="transient: 502")
    apply(store)
    assert [task(store, i)["state"] for i in (high_due, not_due)] == ["pending", "pending"]
    low_ready = submit(store, quick, {"n": 3}, priority=0)
    high_ready = submit(store, quick, {"n": 4}, priority=9)
    clock.advance(10.0)
    order = []
    for _ in range(3):
        assert claim(store, limit=1) == 1
        taken = [
            i
            for i in (high_ready, high_due, low_ready)
            if task(store, i)["state"] == "processing" and i not in order
        ]
        assert len(taken) == 1, taken
        order += taken
    assert order == [high_ready, high_due, low_ready]
    assert claim(store) == 0, "the task not yet due was claimed"
    clock.advance(990.0)
    assert claim(store) == 1 and task(store, not_due)["state"] == "processing"


def test_an_upgrade_to_schema_6_marks_the_tasks_already_waiting(store_url: str, tmp_path: Any) -> None:
    """A store of schema 5 with a task waiting out a back-off (run_at ahead, unlocked): the
    upgrade marks it waiting, so the claim leaves it until it is due, then takes it. (On the real
    clock: a migration reads the database's own.)"""
    if store_url.startswith("postgres"):
        url = store_url
        empty = open_store(url, migrate=False)
        empty.transact_sync(lambda tx: (tx.sql("DROP SCHEMA public CASCADE"), tx.sql("CREATE SCHEMA public")))
        empty.close()
    else:
        url = f"sqlite:///{tmp_path / 'old.db'}"
    old: Any = open_store(url, migrate=False)
    try:
        assert old.migrate(target=5) == 5
        now = time.time()

        def seed(tx: Tx) -> None:
            for run_at, priority in ((now + 3600.0, 9), (now - 1.0, 0)):
                tx.sql(
                    "INSERT INTO tasks (workflow, workflow_version, state, input, priority, run_at,"
                    " created_at, updated_at) VALUES ('wf', 1, 'pending', '{}', ?, ?, ?, ?)",
                    (priority, run_at, now, now),
                )

        old.transact_sync(seed)
        assert old.migrate(target=6) == 1
        rows = old.transact_sync(lambda tx: tx.sql("SELECT priority, waiting FROM tasks ORDER BY priority"))
        assert [(r["priority"], r["waiting"]) for r in rows] == [(0, 0), (9, 1)]
        claimed = old.transact_sync(lambda tx: tx.all("claim_tasks", me=ME, limit=10))
        assert [r["priority"] for r in claimed] == [0], "the task waiting an hour was claimed"
    finally:
        old.close()


def test_two_schedulers_claim_ready_and_due_tasks_each_exactly_once(
    store_url: str, clock: FakeClock, make_workflow: Factory
) -> None:
    """The two arms each skip what another scheduler holds (PostgreSQL: SKIP LOCKED in both; a
    row one arm locked and the merge left out is only skipped until that transaction ends): with
    due and ready tasks mixed, two schedulers racing take every task once between them."""
    s1, s2 = open_store(store_url, clock=clock), open_store(store_url, clock=clock)
    try:
        wf = make_workflow("a")  # its first retry waits 10 s
        due = [submit(s1, wf, {"n": n}, priority=n % 3) for n in range(20)]
        assert claim(s1, limit=50) == 20
        for task_id in due:
            reply(s1, task_id, "a", "retry", error="transient: 502")
        apply(s1)
        ready = [submit(s1, wf, {"n": 100 + n}, priority=n % 3) for n in range(20)]
        clock.advance(10.0)
        got = race_two_schedulers(s1, s2)
        assert got.get("s0", 0) + got.get("s1", 0) == 40, got
        for task_id in due + ready:
            view = task(s1, task_id)
            assert view["state"] == "processing" and view["locked_by"] in ("s0", "s1"), view
            claims = [k for k in event_kinds(s1, task_id) if k == "claimed"]
            assert len(claims) == (2 if task_id in due else 1), (task_id, claims)
    finally:
        s1.close()
        s2.close()
