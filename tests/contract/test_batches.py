"""Many tasks moving in one transaction end exactly as if each had moved alone.

On PostgreSQL a round's writes of one kind go out as one set-based statement (``batches.sql``);
these tests drive rounds and reply batches of several tasks, mixing the common path with stale
replies, failures and finished tasks, and check every row a user would look at."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from test_store import ME, Factory, alerts, event_kinds, q, room, run, states, steps, submit, take

from stepwarden.clock import FakeClock
from stepwarden.store import Store, open_store
from stepwarden.store import transitions as t
from stepwarden.store.supervision import AGED_RECORDS


def test_a_round_of_many_tasks_dispatches_each_its_own_request(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    wf = make_workflow()
    ids = [submit(store, wf, {"order": n}) for n in range(7)]
    _, claimed, taken = run(store.schedule_and_take(ME, 50, {"svc": room(4)}))
    assert claimed == 7 and len(taken) == 4
    reqs = q(store, "SELECT * FROM requests ORDER BY id")
    # One request per task, in claim order (ids follow it), each with its own task's input.
    assert [r["task_id"] for r in reqs] == ids
    for n, r in enumerate(reqs):
        assert (r["step_idx"], r["attempt"], r["kind"], r["operation"]) == (0, 1, "do", "do_a")
        assert json.loads(r["payload"]) == {"input": {"order": n}, "results": {}}
        assert r["idempotency_key"] == f"{r['task_id']}:a"
        assert r["complete_by"] == pytest.approx(clock.wall() + 10.0, abs=1e-6)
    assert [r["state"] for r in reqs] == ["taken"] * 4 + ["queued"] * 3
    for task_id in ids:
        assert states(store, task_id) == ("processing", ["running", "pending", "pending"])
        t = q(store, "SELECT locked_by, complete_by FROM tasks WHERE id = ?", task_id)[0]
        assert t["locked_by"] == ME and t["complete_by"] == pytest.approx(clock.wall() + 10.0, abs=1e-6)
        assert event_kinds(store, task_id) == ["received", "claimed", "dispatched"]


def test_a_reply_batch_of_many_tasks_moves_each_one_alone(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    wf = make_workflow(steps={"a": {"on_error": "compensate"}})
    one = make_workflow("a", name="one")
    ids = [submit(store, wf, {"order": n}) for n in range(5)]
    last = submit(store, one, {"order": 5})
    run(store.schedule_and_take(ME, 50, {}))
    msgs = {m.task_id: m for m in take(store, limit=10)}
    assert sorted(msgs) == sorted([*ids, last])
    clock.advance(1.0)
    replies: list[tuple[int, str, Any, str | None]] = [
        (msgs[ids[0]].id, "ok", {"r": 0}, None),
        (msgs[ids[1]].id, "ok", {"r": 1}, None),
        (msgs[ids[2]].id, "error", None, "card declined"),  # permanent: compensate (nothing to undo)
        (msgs[ids[3]].id, "ok", {"r": 3}, None),
        (msgs[ids[3]].id, "ok", {"r": "again"}, None),  # a duplicate of a reply already applied
        (msgs[last].id, "ok", {"r": 5}, None),  # its only step: the task ends
        # ids[4] gets no reply in this batch
    ]
    applied, taken = run(store.send_replies_and_take(ME, replies, {"svc": room(10)}))
    assert applied is not None
    assert (applied.accepted, applied.stale) == (5, 1)
    assert applied.finished == [(last, "processed")]
    for n in (0, 1, 3):
        a, b, c = steps(store, ids[n])
        assert (a["state"], json.loads(a["result"])) == ("completed", {"r": n})
        assert (b["state"], b["attempt"], c["state"]) == ("running", 1, "pending")
        req_b = q(store, "SELECT * FROM requests WHERE task_id = ? AND step_idx = 1", ids[n])[0]
        assert json.loads(req_b["payload"]) == {"input": {"order": n}, "results": {"a": {"r": n}}}
        tail = ["dispatched", "step_completed", "dispatched"] + (["stale_reply"] if n == 3 else [])
        assert event_kinds(store, ids[n])[-len(tail) :] == tail
    # The next steps (and the undo) were dispatched and taken in that same transaction.
    got = sorted((m.task_id, m.step_idx, m.kind) for m in taken)
    assert got == sorted([(ids[0], 1, "do"), (ids[1], 1, "do"), (ids[2], 0, "undo"), (ids[3], 1, "do")])
    # The permanent error begins compensation: step a (started) is being undone.
    assert states(store, ids[2]) == ("compensating", ["compensating", "skipped", "skipped"])
    undo = q(store, "SELECT kind, operation FROM requests WHERE task_id = ? ORDER BY id", ids[2])
    assert [(r["kind"], r["operation"]) for r in undo] == [("do", "do_a"), ("undo", "undo_a")]
    assert states(store, ids[4]) == ("processing", ["running", "pending", "pending"])
    assert states(store, last) == ("processed", ["completed"])
    assert event_kinds(store, last)[-2:] == ["step_completed", "processed"]
    rows = q(store, "SELECT request_id, status FROM replies ORDER BY id")
    assert [r["status"] for r in rows] == ["accepted"] * 4 + ["stale", "accepted"]
    outcomes = q(
        store,
        "SELECT task_id, outcome, state FROM requests WHERE step_idx = 0 AND kind = 'do' ORDER BY task_id",
    )
    assert [(r["outcome"], r["state"]) for r in outcomes] == [
        ("ok", "replied"),
        ("ok", "replied"),
        ("error", "replied"),
        ("ok", "replied"),
        (None, "taken"),
        ("ok", "replied"),
    ]
    assert alerts(store) == []


def test_a_reply_whose_steps_did_not_come_with_the_batch_is_applied_after_reading_them(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """A reply batch's steps are read by a second statement (on PostgreSQL in the same round
    trip, after the first has locked their tasks). Should a task's steps not come with it, the
    task is read on its own, and its reply is applied like the others, not taken for stale."""
    wf = make_workflow()
    ids = [submit(store, wf, {"order": n}) for n in range(3)]
    run(store.schedule_and_take(ME, 50, {}))
    msgs = {m.task_id: m for m in take(store, limit=10)}
    clock.advance(1.0)
    replies = [(msgs[i].id, "ok", {"r": n}, None) for n, i in enumerate(ids)]
    run(store.send_replies(ME, replies, apply=False))

    class StepsMissing:  # the transaction, except that one task's steps did not come
        def __init__(self, tx: Any) -> None:
            self.tx = tx

        def __getattr__(self, name: str) -> Any:
            return getattr(self.tx, name)

        def both(self, first: Any, second: Any) -> tuple[list[Any], list[Any]]:
            replies, step_rows = self.tx.both(first, second)
            return replies, [r for r in step_rows if r["task_id"] != ids[1]]

    applied = store.transact_sync(lambda tx: t.apply_replies(StepsMissing(tx), ME, 10, random.Random(1)))
    assert (applied.accepted, applied.stale) == (3, 0)
    for n, task_id in enumerate(ids):
        a, b, _ = steps(store, task_id)
        assert (a["state"], json.loads(a["result"])) == ("completed", {"r": n})
        assert (b["state"], b["attempt"]) == ("running", 1)
        assert event_kinds(store, task_id)[-2:] == ["step_completed", "dispatched"]
    assert [r["status"] for r in q(store, "SELECT status FROM replies ORDER BY id")] == ["accepted"] * 3


def test_a_worker_s_own_replies_mark_their_requests_replied_applied_or_not(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """Applied in the transaction that records it, a reply marks its request replied with its
    outcome in one write; one that is not applied (too late: stale) still marks it replied, so
    the request no longer counts as held by the worker."""
    wf = make_workflow(budget=5.0)
    ids = [submit(store, wf, {"order": n}) for n in range(2)]
    run(store.schedule_and_take(ME, 50, {}))
    msgs = {m.task_id: m for m in take(store, limit=10)}
    clock.advance(1.0)
    applied, _ = run(store.send_replies_and_take(ME, [(msgs[ids[0]].id, "ok", None, None)], {}))
    assert applied is not None and (applied.accepted, applied.stale) == (1, 0)
    clock.advance(10.0)  # past the second request's complete-by
    applied, _ = run(store.send_replies_and_take(ME, [(msgs[ids[1]].id, "ok", None, None)], {}))
    assert applied is not None and (applied.accepted, applied.stale) == (0, 1)
    rows = q(store, "SELECT task_id, state, outcome FROM requests WHERE step_idx = 0 ORDER BY task_id")
    assert [(r["state"], r["outcome"]) for r in rows] == [("replied", "ok"), ("replied", None)]


def test_the_rows_of_a_statement_sent_with_the_commit_come_after_the_commit(store: Store) -> None:
    def fn(tx: Any) -> Any:
        later = tx.at_commit("now")
        with pytest.raises(RuntimeError, match="before the commit"):
            later()
        return later

    rows = store.transact_sync(fn)()
    assert len(rows) == 1 and rows[0]["now"] > 0


def test_two_writes_of_one_row_in_one_transaction_keep_their_order(
    store: Store, make_workflow: Factory
) -> None:
    """Deferred writes of one query go out together; two of them naming the same row must still
    apply in the order they were made (the last one wins), as they do one by one."""
    wf = make_workflow()
    a, b = submit(store, wf), submit(store, wf)

    def writes(tx: Any) -> None:
        for task_id, first in ((a, "processing"), (b, "compensating")):
            tx.put("task_in_flight", task_id=task_id, state=first, me="x", complete_by=1.0)
        tx.put("task_in_flight", task_id=a, state="compensating", me="y", complete_by=2.0)
        tx.put("task_in_flight", task_id=b, state="processing", me="y", complete_by=3.0)

    store.transact_sync(writes)
    got = {r["id"]: r for r in q(store, "SELECT id, state, locked_by, complete_by FROM tasks")}
    assert (got[a]["state"], got[a]["locked_by"], got[a]["complete_by"]) == ("compensating", "y", 2.0)
    assert (got[b]["state"], got[b]["locked_by"], got[b]["complete_by"]) == ("processing", "y", 3.0)


def test_a_read_sees_the_deferred_writes_before_it(store: Store, make_workflow: Factory) -> None:
    wf = make_workflow()
    task_id = submit(store, wf)

    def write_then_read(tx: Any) -> Any:
        tx.put("task_in_flight", task_id=task_id, state="processing", me="x", complete_by=5.0)
        return tx.one("task_for_update", task_id=task_id)

    row = store.transact_sync(write_then_read)
    assert row is not None and (row["state"], row["locked_by"]) == ("processing", "x")


def test_a_write_that_is_not_deferred_applies_after_the_deferred_ones_before_it(
    store: Store, make_workflow: Factory
) -> None:
    """Deferred writes wait for the next read, commit or other write: a write of another kind made
    after them must find them done, or it would be overwritten by one made before it."""
    wf = make_workflow()
    task_id = submit(store, wf)

    def writes(tx: Any) -> None:
        tx.put("task_in_flight", task_id=task_id, state="processing", me="x", complete_by=5.0)  # deferred
        tx.put("release_task", task_id=task_id, state="pending", delay=0, failed=1, error="why")

    store.transact_sync(writes)
    row = q(store, "SELECT state, locked_by, failure_count, last_error FROM tasks WHERE id = ?", task_id)[0]
    assert row == {"state": "pending", "locked_by": None, "failure_count": 1, "last_error": "why"}


def test_a_count_and_raw_sql_see_the_deferred_writes_before_them(
    store: Store, make_workflow: Factory
) -> None:
    wf = make_workflow()
    task_id = submit(store, wf)

    def write_then_count(tx: Any) -> tuple[int, list[Any]]:
        tx.put("task_in_flight", task_id=task_id, state="processing", me="x", complete_by=5.0)
        n = tx.run("finish_task", task_id=task_id, state="processed", error=None)  # not deferred via run
        tx.put("task_in_flight", task_id=task_id, state="processing", me="y", complete_by=6.0)
        return n, tx.sql("SELECT locked_by FROM tasks WHERE id = ?", (task_id,))

    n, rows = store.transact_sync(write_then_count)
    assert n == 1 and [r["locked_by"] for r in rows] == ["y"]


def test_the_set_based_forms_reach_their_rows_by_index_not_by_a_scan(
    pg_url: str, make_workflow: Factory
) -> None:
    """The planner guesses 100 rows for a JSON array: without naming the keys, an update of a few
    rows scanned the whole table, and every round grew slower as the store filled."""
    store = open_store(pg_url)
    try:
        wf = make_workflow()
        for n in range(20):
            submit(store, wf, {"order": n})
        run(store.schedule_and_take(ME, 20, {}))
        run(store.send_replies(ME, [(m.id, "ok", None, None) for m in take(store, limit=10)], apply=False))
        # ... among 20,000 finished tasks, as a store holds after a while
        for sql in (
            "INSERT INTO tasks (workflow, workflow_version, state, input, priority, run_at, created_at,"
            " updated_at, finished_at) SELECT 'wf', 1, 'processed', '{}', 0, 0, 0, 0, 0"
            " FROM generate_series(1, 20000)",
            "INSERT INTO steps (task_id, idx, name, agent, operation, budget, policy, on_error, state)"
            " SELECT id, 0, 'a', 'svc', 'svc.do_a', 10, '{}', 'error', 'completed' FROM tasks"
            " WHERE state = 'processed'",
            "INSERT INTO requests (task_id, step_idx, attempt, kind, agent, operation, payload, policy,"
            " idempotency_key, priority, complete_by, state, dispatched_by, dispatched_at)"
            " SELECT id, 0, 1, 'do', 'svc', 'do_a', '{}', '{}', id || ':a', 0, 0, 'replied', 'x', 0"
            " FROM tasks WHERE state = 'processed'",
            "INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, sent_by,"
            " received_at, status) SELECT id, task_id, 0, 1, 'do', 'ok', 'x', 0, 'accepted'"
            " FROM requests WHERE state = 'replied'",
            "ANALYZE",
        ):
            q(store, sql)
        one = {
            "task_id": 7, "idx": 1, "attempt": 1, "state": "completed", "expect": "running", "me": "x",
            "complete_by": 1.0, "now": 1.0, "result": None, "error": None, "id": 7, "status": "accepted",
            "outcome": "ok", "request_id": 7, "kind": "do", "agent": "svc", "operation": "do_a",
            "payload": "{}", "policy": "{}", "key": "7:a", "priority": 0, "actor": "x", "detail": None,
            "queue": "q", "correlation_id": None, "body": "{}",
        }  # fmt: skip
        queries = {k: v for k, v in store.queries.items() if k.endswith("__many")}  # type: ignore[attr-defined]
        assert len(queries) >= 9
        # ... and the reads and deletes that take a list of task ids (a round's steps, a reply
        # batch's tasks, a prune batch): the same guess made them scan too.
        by_ids = {
            k: v
            for k, v in store.queries.items()  # type: ignore[attr-defined]
            if k in ("steps_of_tasks", "new_replies_with_tasks", "steps_of_new_replies")
            or (k.startswith("prune_") and k.removeprefix("prune_") not in AGED_RECORDS)
        }
        assert len(by_ids) == 13  # prune_unread_messages among them: the prune warns of unread messages
        queries.update(by_ids)
        rows = json.dumps([dict(one, task_id=7 + i, id=7 + i, request_id=7 + i) for i in range(8)])
        ids = json.dumps([7 + i for i in range(8)])
        for name, sql in queries.items():

            def explain(tx: Any, sql: str = sql) -> list[Any]:
                # The store's sessions price sequential scans out (enable_seqscan = off, see
                # deploying.md); the shape of each statement must make the index win on its own.
                tx.conn.execute("SET LOCAL enable_seqscan = on")
                return list(
                    tx.conn.execute(
                        "EXPLAIN " + sql, {"rows": rows, "ids": ids, "limit": 8, "own": rows, "me": "x"}
                    ).fetchall()
                )

            plan = "\n".join(str(r["QUERY PLAN"]) for r in store.transact_sync(explain))
            for table in ("tasks", "steps", "requests", "replies"):
                assert f"Seq Scan on {table}" not in plan, f"{name}:\n{plan}"
    finally:
        store.close()


def test_a_write_that_fails_with_the_commit_leaves_nothing_and_the_store_goes_on(
    store: Store, make_workflow: Factory
) -> None:
    """On PostgreSQL a transaction's kept writes (events, messages) and its COMMIT share one round
    trip: a write failing there must still fail the whole transaction, and the pooled connection
    must come back clean for the next one."""
    wf = make_workflow()
    task_id = submit(store, wf, {"n": 1})
    before = event_kinds(store, task_id)

    def doomed(tx: Any) -> None:
        tx.put("finish_task", task_id=task_id, state="cancelled", error=None)
        tx.later("insert_event", task_id=task_id, idx=None, attempt=None, kind="x", actor=ME, detail=None)
        # queue is NOT NULL: this kept write fails, in the round trip that carries the COMMIT
        tx.later("insert_message", queue=None, task_id=task_id, correlation_id=None, kind="x", body="{}")

    for _ in range(3):  # more times than the pool has connections: none is left broken
        with pytest.raises(Exception, match=r"(?i)null"):
            store.transact_sync(doomed)
    assert states(store, task_id)[0] == "pending"
    assert event_kinds(store, task_id) == before
    _, claimed, _ = run(store.schedule_and_take(ME, 50, {}))
    assert claimed == 1 and states(store, task_id)[0] == "processing"
