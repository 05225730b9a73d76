"""A stopping worker hands back the attempts it dispatched that no agent has taken (DEP4).

``store.agents.hand_back_dispatched`` on both stores: only requests still queued, dispatched by
the stopping worker and within their complete-by are handed back, uncounted, their tasks
claimable at once; a request another worker's agent took, one another scheduler dispatched and
one past its complete-by (the supervisor's) are left as they are. On PostgreSQL, a request that
another agent takes while the hand-back runs is left to that agent: the take from the queue is
conditional and waits for the other session's row lock, then sees the request taken.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from test_store import submit

from stepwarden.clock import FakeClock
from stepwarden.store import Store, open_store
from stepwarden.store import transitions as t
from stepwarden.store.agents import HandBack, hand_back_dispatched
from stepwarden.testing.postgres import wait_for_lock_waiter
from stepwarden.workflow import Workflow

ME = "leaving:1:aaa"  # the stopping worker (a scheduler)
OTHER = "staying:2:bbb"  # another scheduler
AGENT = "agent:3:ccc"  # another worker's agent
WHY = "dispatched by a worker that stopped before an agent took it"


def q(store: Store, sql: str, *params: Any) -> list[dict[str, Any]]:
    return store.transact_sync(lambda tx: tx.sql(sql, params))


def request_of(store: Store, task_id: int) -> dict[str, Any]:
    rows = q(store, "SELECT * FROM requests WHERE task_id = ? ORDER BY id", task_id)
    return rows[-1]


def hand_back(store: Store, limit: int = 100) -> HandBack:
    return store.transact_sync(hand_back_dispatched, ME, WHY, limit, random.Random(0))


def test_only_queued_live_requests_this_worker_dispatched_are_handed_back(
    store: Store, clock: FakeClock, make_workflow: Callable[..., Workflow]
) -> None:
    wf = make_workflow("a", "b", budget=10.0)
    short = make_workflow("a", "b", name="short", budget=1.0)
    taken, queued, expired = submit(store, wf), submit(store, wf), submit(store, short)
    assert store.transact_sync(t.claim_and_dispatch, ME, 10) == 3
    others = submit(store, wf)
    assert store.transact_sync(t.claim_and_dispatch, OTHER, 10) == 1
    (msg,) = asyncio.run(store.claim_requests(AGENT, ["svc"], 1))  # the oldest: task `taken`
    assert msg.task_id == taken
    clock.advance(2)  # the short workflow's attempt is past its complete-by: the supervisor's

    out = hand_back(store)
    assert (out.found, out.handed) == (1, 1)
    assert out.applied is not None and out.applied.accepted == 1

    # Handed back: step and task pending and unlocked, no failure counted, the request replied.
    t_row = q(store, "SELECT state, locked_by, failure_count FROM tasks WHERE id = ?", queued)[0]
    assert (t_row["state"], t_row["locked_by"], t_row["failure_count"]) == ("pending", None, 0)
    s_row = q(
        store, "SELECT state, locked_by, failure_count FROM steps WHERE task_id = ? AND idx = 0", queued
    )
    assert [(s["state"], s["locked_by"], s["failure_count"]) for s in s_row] == [("pending", None, 0)]
    r_row = request_of(store, queued)
    assert (r_row["state"], r_row["outcome"]) == ("replied", "released")
    replies = q(store, "SELECT outcome, status, sent_by, error FROM replies WHERE task_id = ?", queued)
    assert [(r["outcome"], r["status"], r["sent_by"], r["error"]) for r in replies] == [
        ("released", "accepted", ME, WHY)
    ]
    kinds = [e["kind"] for e in q(store, "SELECT kind FROM events WHERE task_id = ? ORDER BY id", queued)]
    assert kinds[-1] == "released" and "retry_scheduled" not in kinds

    # Left alone: taken by another worker's agent, dispatched by another scheduler, expired.
    assert (request_of(store, taken)["state"], request_of(store, taken)["taken_by"]) == ("taken", AGENT)
    assert request_of(store, others)["state"] == "queued"
    assert request_of(store, expired)["state"] == "queued"
    for task_id, owner in ((taken, ME), (others, OTHER), (expired, ME)):
        row = q(store, "SELECT state, locked_by FROM tasks WHERE id = ?", task_id)[0]
        assert (row["state"], row["locked_by"]) == ("processing", owner)

    # Claimable at once, by any scheduler: a fresh attempt of the same step.
    assert store.transact_sync(t.claim_and_dispatch, OTHER, 10) == 1
    again = request_of(store, queued)
    assert (again["attempt"], again["state"], again["dispatched_by"]) == (2, "queued", OTHER)
    assert (hand_back(store).found, hand_back(store).handed) == (0, 0)


def test_a_request_taken_while_the_hand_back_waits_for_it_is_left_to_its_agent(
    pg_url: str, clock: FakeClock, make_workflow: Callable[..., Workflow]
) -> None:
    store = open_store(pg_url, clock=clock)
    try:
        task_id = submit(store, make_workflow("a", budget=10.0))
        assert store.transact_sync(t.claim_and_dispatch, ME, 10) == 1
        request = request_of(store, task_id)["id"]
        out: list[HandBack | BaseException] = []

        def run() -> None:
            try:
                out.append(hand_back(store))
            except BaseException as e:  # reported by the assertion below
                out.append(e)

        with psycopg.connect(pg_url) as other:  # another worker's agent, mid-take
            other.execute(
                "UPDATE requests SET state = 'taken', taken_by = %s, taken_at = 0 WHERE id = %s",
                (AGENT, request),
            )
            th = threading.Thread(target=run)
            th.start()
            wait_for_lock_waiter(pg_url)  # the hand-back read it queued and waits for its row
            other.commit()
            th.join(timeout=10)
        assert len(out) == 1 and isinstance(out[0], HandBack), out
        assert (out[0].found, out[0].handed) == (1, 0)
        row = request_of(store, task_id)
        assert (row["state"], row["taken_by"], row["outcome"]) == ("taken", AGENT, None)
        step = q(store, "SELECT state, locked_by FROM steps WHERE task_id = ?", task_id)[0]
        assert (step["state"], step["locked_by"]) == ("running", ME)
        assert not q(store, "SELECT id FROM replies WHERE task_id = ?", task_id)
    finally:
        store.close()


def test_a_step_handed_back_untaken_counts_as_never_having_reached_its_service(
    store: Store, make_workflow: Callable[..., Workflow]
) -> None:
    """Found by review (CMP4, OPS3): the hand-back takes the requests in the stopping worker's
    name to reply for them, and they kept it as their taker, so a cancel afterwards named the
    step in ``not_undone`` ("its effect may still stand") though no agent ever took it."""
    wf = make_workflow("a", "b", steps={"b": {"compensate": None}})
    task_id = submit(store, wf, reply_to="web-1")
    assert store.transact_sync(t.claim_and_dispatch, ME, 10) == 1
    (msg,) = asyncio.run(store.claim_requests(AGENT, ["svc"], 1))
    asyncio.run(store.send_reply(AGENT, msg.id, "ok", {"done": "a"}, None))
    store.transact_sync(t.apply_replies, ME, 10, random.Random(0))  # a done, b dispatched by ME
    assert request_of(store, task_id)["step_idx"] == 1
    assert hand_back(store).handed == 1
    row = request_of(store, task_id)
    assert (row["state"], row["outcome"]) == ("replied", "released")
    assert (row["taken_by"], row["taken_at"]) == (None, None)  # no agent took it
    assert store.transact_sync(t.cancel_task, task_id, "operator") == "compensating"
    assert store.transact_sync(t.claim_and_dispatch, OTHER, 10) == 1  # a's undo
    (undo,) = asyncio.run(store.claim_requests(AGENT, ["svc"], 1))
    assert undo.kind == "undo" and undo.step_idx == 0
    asyncio.run(store.send_reply(AGENT, undo.id, "ok", None, None))
    store.transact_sync(t.apply_replies, OTHER, 10, random.Random(0))
    last = q(store, "SELECT kind, body FROM messages ORDER BY id DESC LIMIT 1")[0]
    assert last["kind"] == "cancelled" and "not_undone" not in last["body"], last
