"""The records that outlive their tasks are pruned too (``transitions.prune_records``): without it a
long-lived store grows by every worker ever started, every lease term, every breaker event and
every alert, however small the live work. Run on both stores, with the database clock faked."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from stepwarden.alerts import expire, record_delivered
from stepwarden.clock import FakeClock
from stepwarden.errors import LostOwnership
from stepwarden.store import Store, open_store
from stepwarden.store import agents as agent_store
from stepwarden.store import transitions as t
from stepwarden.store.agents import InstanceSpec
from stepwarden.supervisor import Supervisor, SupervisorSettings
from stepwarden.testing.postgres import wait_for_lock_waiter
from stepwarden.workflow import Workflow, encode_input

SUP = "sup-1:1:ccc"
OLD = "old-1:1:ddd"
LIVE = "live-1:1:eee"
DAY = 86400.0
Factory = Callable[..., Workflow]


def lease(store: Store, holder: str = SUP) -> int:
    got = asyncio.run(store.acquire_lease("supervisor", holder, 1e9))
    assert got is not None
    return int(got[0])


def prune_records(store: Store, term: int, retention: float = DAY, limit: int = 100) -> dict[str, int]:
    return store.transact_sync(t.prune_records, SUP, "supervisor", term, retention, limit)


def count(store: Store, sql: str, *params: Any) -> int:
    return int(store.transact_sync(lambda tx: tx.sql("SELECT COUNT(*) AS n FROM " + sql, params))[0]["n"])


def worker(store: Store, me: str, agent: str = "svc") -> None:
    asyncio.run(store.worker_beat(me, ["agent"], [agent]))
    spec = InstanceSpec(agent=agent, capacity=4, threshold=5, cool_off=30.0)
    store.transact_sync(agent_store.register, me, [spec])


def submit(store: Store, wf: Workflow) -> int:
    opts: dict[str, Any] = {"correlation_id": None, "idempotency_key": None, "priority": 0, "reply_to": None}
    return int(store.transact_sync(t.submit, wf, encode_input({"order": 1}), **opts)[0])


def failed_task(store: Store, wf: Workflow) -> int:
    """A task in ``error`` with its alert, as an exhausted step leaves it."""
    task_id = submit(store, wf)

    def fail(tx: Any) -> None:
        tx.sql("UPDATE tasks SET state = 'error' WHERE id = ?", (task_id,))
        t.alert(tx, "step_failed", task_id, "a", "the service said no")

    store.transact_sync(fail)
    return task_id


def test_workers_silent_past_the_retention_go_with_their_agent_instances(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)
    worker(store, OLD)
    holder = "held-1:1:fff"
    worker(store, holder)
    task_id = submit(store, make_workflow())
    store.transact_sync(t.claim_and_dispatch, "sched-1:1:aaa", 10)
    assert len(asyncio.run(store.claim_requests(holder, ["svc"], 10))) == 1  # it dies holding a step
    clock.advance(2 * DAY)
    worker(store, LIVE)

    done = prune_records(store, term)

    assert done["workers"] == 1 and done["agent_instances"] == 1
    assert count(store, "workers WHERE id = ?", OLD) == 0
    assert count(store, "agent_instances WHERE worker = ?", OLD) == 0
    # the one holding a taken step stays until the step is rescued, and so does its instance
    assert count(store, "workers WHERE id = ?", holder) == 1
    assert count(store, "agent_instances WHERE worker = ?", holder) == 1
    assert count(store, "workers WHERE id = ?", LIVE) == 1
    assert count(store, "agent_instances WHERE worker = ?", LIVE) == 1
    assert count(store, "steps WHERE task_id = ?", task_id) == 3


def test_a_worker_pruned_while_stalled_registers_again_at_its_next_beat(
    store: Store, clock: FakeClock
) -> None:
    """A worker stopped (SIGSTOP) past the retention is pruned like a dead one. When it resumes,
    its next heartbeat brings back its worker row and its agent instances, with their load, so
    operators see its capacity again without a restart."""
    term = lease(store)
    worker(store, OLD)
    clock.advance(2 * DAY)
    assert prune_records(store, term)["agent_instances"] == 1

    asyncio.run(store.worker_beat(OLD, ["agent"], ["svc"], load={"svc": (4, 3)}))

    assert count(store, "workers WHERE id = ? AND stopped_at IS NULL", OLD) == 1
    rows = store.transact_sync(
        lambda tx: tx.sql(
            "SELECT capacity, inflight, healthy, heartbeat_at FROM agent_instances WHERE worker = ?", (OLD,)
        )
    )
    assert [(r["capacity"], r["inflight"], r["healthy"]) for r in rows] == [(4, 3, 1)]
    assert float(rows[0]["heartbeat_at"]) >= clock.wall() - 1


def test_events_with_no_task_and_ended_lease_terms_go_by_age(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    term = lease(store)

    def events(tx: Any) -> None:
        t.event(tx, "breaker_opened", None, OLD, agent="svc")
        t.event(tx, "instance_unhealthy", None, OLD, agent="svc")

    store.transact_sync(events)
    task_id = failed_task(store, make_workflow())
    store.transact_sync(lambda tx: t.event(tx, "note", task_id, OLD))
    asyncio.run(store.resign_lease("supervisor", SUP, term))
    term = lease(store)  # the first term ended, a second began
    clock.advance(2 * DAY)
    store.transact_sync(lambda tx: t.event(tx, "breaker_closed", None, LIVE, agent="svc"))
    before = count(store, "events WHERE task_id IS NOT NULL")

    done = prune_records(store, term, limit=100)

    assert done["taskless_events"] >= 2
    assert count(store, "events WHERE task_id IS NULL AND kind = 'breaker_closed'") == 1  # young
    assert count(store, "events WHERE task_id IS NULL AND at < ?", clock.wall() - DAY) == 0
    assert count(store, "events WHERE task_id IS NOT NULL") == before  # a task's events go with it
    terms = store.transact_sync(lambda tx: tx.sql("SELECT term, ended_at FROM lease_terms ORDER BY term"))
    assert [r["term"] for r in terms] == [term] and terms[0]["ended_at"] is None  # the one in force


def test_alerts_no_one_needs_go_with_their_deliveries_and_an_open_one_stays(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """An acknowledged alert, or one whose task was pruned, is history once past the retention. An
    unacknowledged alert of a task still in ``error`` is the operator's to-do: it stays."""
    term = lease(store)
    wf = make_workflow()
    acked, waiting, gone, young = (failed_task(store, wf) for _ in range(4))

    def setup(tx: Any) -> None:
        ids = {r["task_id"]: r["id"] for r in tx.sql("SELECT id, task_id FROM alerts")}
        tx.sql("UPDATE alerts SET acked_at = created_at, acked_by = 'op' WHERE task_id = ?", (acked,))
        tx.sql("UPDATE tasks SET state = 'cancelled', finished_at = created_at WHERE id = ?", (gone,))
        tx.run("alert_sink_register", name="hook")
        for task_id in (acked, gone):
            tx.run("alert_delivered", sink="hook", alert_id=ids[task_id], me=SUP)

    store.transact_sync(setup)
    clock.advance(2 * DAY)
    young_alert = failed_task(store, wf)
    ack = "UPDATE alerts SET acked_at = created_at WHERE task_id = ?"
    store.transact_sync(lambda tx: tx.sql(ack, (young_alert,)))
    assert store.transact_sync(t.prune, SUP, "supervisor", term, DAY, 100) == 1  # the cancelled task

    done = prune_records(store, term)

    assert done["alerts"] == 2
    left = store.transact_sync(lambda tx: tx.sql("SELECT task_id FROM alerts ORDER BY id"))
    assert [r["task_id"] for r in left] == [waiting, young, young_alert]
    assert count(store, "alert_deliveries") == 0
    assert prune_records(store, term)["alerts"] == 0


def test_an_unacknowledged_alert_of_no_task_stays_past_the_retention(store: Store, clock: FakeClock) -> None:
    """Found by review (OPS4): a breaker_opened alert has no task, so "its task is gone" held for
    it vacuously, and it was pruned after the retention though no one had acknowledged it. Once
    acknowledged, it goes as any other."""
    term = lease(store)
    store.transact_sync(t.alert, "breaker_opened", None, None, "breaker of 'pay' opened")
    clock.advance(2 * DAY)
    assert prune_records(store, term)["alerts"] == 0
    assert [r["kind"] for r in store.transact_sync(lambda tx: tx.sql("SELECT kind FROM alerts"))] == [
        "breaker_opened"
    ]
    store.transact_sync(lambda tx: tx.sql("UPDATE alerts SET acked_at = created_at, acked_by = 'op'"))
    assert prune_records(store, term)["alerts"] == 1


def test_record_pruning_is_bounded_per_transaction_oldest_first_and_fenced_by_the_term(
    store: Store, clock: FakeClock
) -> None:
    term = lease(store)  # its lease_acquired event is the oldest
    for i in range(4):
        clock.advance(1)
        store.transact_sync(t.event, "breaker_opened", None, OLD, n=i)
    clock.advance(2 * DAY)
    with pytest.raises(LostOwnership):
        prune_records(store, term + 1, limit=2)
    assert count(store, "events WHERE task_id IS NULL") == 5
    assert prune_records(store, term, limit=2)["taskless_events"] == 2
    kept = store.transact_sync(lambda tx: tx.sql("SELECT kind, detail FROM events ORDER BY id"))
    left = [(r["kind"], json.loads(r["detail"])["n"]) for r in kept]
    assert left == [("breaker_opened", n) for n in (1, 2, 3)]


def test_the_leaders_prune_reaches_the_records_once_the_task_backlog_is_done(
    store: Store, clock: FakeClock
) -> None:
    term = lease(store)

    def events(tx: Any) -> None:
        for i in range(7):
            t.event(tx, "breaker_opened", None, OLD, n=i)

    store.transact_sync(events)
    clock.advance(2 * DAY)
    sup = Supervisor(
        store, SUP, clock=clock, settings=SupervisorSettings(retention=DAY, prune_batch=3, prune_rounds=10)
    )
    assert asyncio.run(sup.prune(term)) == 0  # no finished task: the rounds go to the records
    assert count(store, "events WHERE kind = 'breaker_opened'") == 0


def test_on_postgres_an_alert_being_delivered_and_its_prune_never_leave_a_delivery_behind(
    pg_url: str, clock: FakeClock, make_workflow: Factory
) -> None:
    """The prune passes by an alert a delivery holds (it must not wait: it is fenced by a lease it
    has to keep renewing), and a delivery that comes while the prune holds the alert waits for it,
    then finds it gone. A plain read there saw the alert in its snapshot and recorded a delivery
    for an alert deleted a moment later: a row nothing would ever prune."""
    store = open_store(pg_url, clock=clock)
    try:
        term = lease(store)
        failed_task(store, make_workflow())
        alert_id = int(store.transact_sync(lambda tx: tx.sql("SELECT id FROM alerts"))[0]["id"])
        store.transact_sync(lambda tx: tx.sql("UPDATE alerts SET acked_at = created_at"))
        store.transact_sync(lambda tx: tx.run("alert_sink_register", name="hook"))
        clock.advance(2 * DAY)
        with psycopg.connect(pg_url) as delivering:  # between a delivery's hold and its commit
            delivering.execute("SELECT id FROM alerts WHERE id = %s FOR KEY SHARE", (alert_id,))
            assert prune_records(store, term)["alerts"] == 0  # passed by, without waiting
        with psycopg.connect(pg_url) as pruning:  # a prune between its delete and its commit
            pruning.execute("SELECT id FROM alerts WHERE id = %s FOR UPDATE", (alert_id,))
            pruning.execute("DELETE FROM alerts WHERE id = %s", (alert_id,))
            late = threading.Thread(
                target=store.transact_sync, args=(record_delivered, "hook", alert_id, SUP), daemon=True
            )
            late.start()
            wait_for_lock_waiter(pg_url)
            pruning.commit()
        late.join(10)
        assert not late.is_alive()
        assert count(store, "alert_deliveries") == 0 and count(store, "alerts") == 0
    finally:
        store.close()


def test_on_postgres_an_expired_alert_pruned_meanwhile_gets_no_give_up_row(
    pg_url: str, clock: FakeClock, make_workflow: Factory
) -> None:
    """The give-up of alerts past max_age reads them locked: one the prune has deleted but not yet
    committed is waited for and then left out, not given a delivery row that outlives it."""
    store = open_store(pg_url, clock=clock)
    try:
        failed_task(store, make_workflow())
        alert_id = int(store.transact_sync(lambda tx: tx.sql("SELECT id FROM alerts"))[0]["id"])
        store.transact_sync(lambda tx: tx.run("alert_sink_register", name="hook"))
        clock.advance(2 * DAY)
        with psycopg.connect(pg_url) as pruning:
            pruning.execute("SELECT id FROM alerts WHERE id = %s FOR UPDATE", (alert_id,))
            pruning.execute("DELETE FROM alerts WHERE id = %s", (alert_id,))
            found: list[dict[str, list[int]]] = []
            late = threading.Thread(
                target=lambda: found.append(store.transact_sync(expire, ["hook"], 10, DAY, SUP)), daemon=True
            )
            late.start()
            wait_for_lock_waiter(pg_url)
            pruning.commit()
        late.join(10)
        assert found == [{}]
        assert count(store, "alert_deliveries") == 0
    finally:
        store.close()
