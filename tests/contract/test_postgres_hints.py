"""On PostgreSQL a worker transaction that dispatches requests and, with the same commit, takes
requests for its own slots wakes the other workers (NOTIFY on ``stepwarden_requests``) only if
some requests are left for them: the hint is decided after the take, in the COMMIT's round trip.
A submission wakes the schedulers (``stepwarden_tasks``) only if no claimable task was already
waiting: one that is waiting has had its own hint, and a scheduler that claims anything runs
another round after its gather window, which sees the new task.

Notifications arrive in commit order, so each check commits a marker notification of its own
after the transaction under test and reads up to it: no waiting for a hint that may not come."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import psycopg
import pytest
from test_store import ME, Factory, room, run, submit

from stepwarden.clock import FakeClock
from stepwarden.store import Store
from stepwarden.store.postgres import PostgresStore

CHANNEL = "stepwarden_requests"
TASKS = "stepwarden_tasks"


@pytest.fixture(params=["pipelined", "pooled"])
def store_url(request: pytest.FixtureRequest, pg_url: str) -> str:
    """Directly (pipelined: the take and the hint travel with COMMIT) and as behind a
    transaction-mode pooler (no pipeline: each statement its own round trip)."""
    return pg_url if request.param == "pipelined" else pg_url + "?pooler=transaction"


def _listening(pg_url: str, channel: str) -> Iterator[psycopg.Connection]:
    conn = psycopg.connect(pg_url, autocommit=True)
    conn.execute(f"LISTEN {channel}")
    yield conn
    conn.close()


@pytest.fixture
def listener(pg_url: str) -> Iterator[psycopg.Connection]:
    yield from _listening(pg_url, CHANNEL)


@pytest.fixture
def task_listener(pg_url: str) -> Iterator[psycopg.Connection]:
    yield from _listening(pg_url, TASKS)


def hints(listener: psycopg.Connection, pg_url: str, channel: str = CHANNEL) -> int:
    """How many hints were committed before now (a marker of our own ends the reading)."""
    with psycopg.connect(pg_url, autocommit=True) as other:
        other.execute("SELECT pg_notify(%s, 'marker')", (channel,))
    for seen, n in enumerate(listener.notifies(timeout=10)):
        if n.payload == "marker":
            return seen
    raise AssertionError("the marker notification did not arrive within 10 s")


def test_no_hint_when_the_same_commit_takes_every_request_it_dispatched(
    store: Store, make_workflow: Factory, listener: psycopg.Connection, pg_url: str
) -> None:
    wf = make_workflow()
    submit(store, wf)
    assert hints(listener, pg_url) == 0
    _, claimed, taken = run(store.schedule_and_take(ME, 50, {"svc": room(1)}))
    assert claimed == 1 and len(taken) == 1
    assert hints(listener, pg_url) == 0


def test_a_hint_when_requests_are_left_for_other_workers(
    store: Store, make_workflow: Factory, listener: psycopg.Connection, pg_url: str
) -> None:
    wf = make_workflow()
    submit(store, wf, {"n": 1})
    submit(store, wf, {"n": 2})
    _, claimed, taken = run(store.schedule_and_take(ME, 50, {"svc": room(1)}))  # room for one of two
    assert claimed == 2 and len(taken) == 1
    assert hints(listener, pg_url) == 1
    _, claimed, taken = run(store.schedule_and_take(ME, 50, {}))  # nothing left to claim or take
    assert (claimed, taken) == (0, [])
    assert hints(listener, pg_url) == 0


def test_a_hint_when_this_worker_takes_nothing(
    store: Store, make_workflow: Factory, listener: psycopg.Connection, pg_url: str
) -> None:
    submit(store, make_workflow())
    _, claimed, taken = run(store.schedule_and_take(ME, 50, {}))
    assert claimed == 1 and taken == []
    assert hints(listener, pg_url) == 1


def test_no_hint_for_requests_left_that_have_expired(
    store: Store, clock: FakeClock, make_workflow: Factory, listener: psycopg.Connection, pg_url: str
) -> None:
    """A queued request past its complete-by waits for the supervisor, not for a worker."""
    wf = make_workflow()
    submit(store, wf, {"n": 1})
    run(store.schedule_and_take(ME, 50, {}))  # dispatched, left queued: a hint
    assert hints(listener, pg_url) == 1
    clock.advance(11.0)  # past that request's complete-by (10 s)
    second = submit(store, wf, {"n": 2})
    _, claimed, taken = run(store.schedule_and_take(ME, 50, {"svc": room(1)}))
    assert claimed == 1 and [m.task_id for m in taken] == [second]
    assert hints(listener, pg_url) == 0


def test_a_submission_hints_only_when_no_claimable_task_is_waiting(
    store: Store, make_workflow: Factory, task_listener: psycopg.Connection, pg_url: str
) -> None:
    wf = make_workflow()
    submit(store, wf, {"n": 1})
    assert hints(task_listener, pg_url, TASKS) == 1  # onto an empty queue
    submit(store, wf, {"n": 2})
    submit(store, wf, {"n": 3})
    assert hints(task_listener, pg_url, TASKS) == 0  # the first is waiting: its hint covers them
    assert run(store.schedule_and_take(ME, 50, {}))[1] == 3
    submit(store, wf, {"n": 4})
    assert hints(task_listener, pg_url, TASKS) == 1  # the waiting ones were claimed


def test_a_submission_hints_when_the_waiting_tasks_are_not_claimable_yet(
    store: Store, make_workflow: Factory, task_listener: psycopg.Connection, pg_url: str, clock: FakeClock
) -> None:
    """A task waiting for its retry back-off (run_at ahead) wakes nobody now: it does not stand in
    for a hint."""
    wf = make_workflow()
    first = submit(store, wf, {"n": 1})
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE tasks SET run_at = %s WHERE id = %s", (clock.wall() + 60, first))
    hints(task_listener, pg_url, TASKS)
    submit(store, wf, {"n": 2})
    assert hints(task_listener, pg_url, TASKS) == 1


def test_a_worker_listens_only_on_the_channels_of_its_roles(pg_url: str) -> None:
    """Every transaction that finishes a task notifies ``stepwarden_done`` (for the reply queues'
    readers); a worker's LISTEN session must not be sent those, one per reply batch."""
    from stepwarden.store import open_store
    from stepwarden.store.base import WORK_CHANNELS

    store = open_store(pg_url)

    async def main() -> list[str]:
        woken: list[str] = []
        stop = asyncio.Event()
        listening = asyncio.create_task(store.listen(woken.append, stop, WORK_CHANNELS))
        deadline = asyncio.get_running_loop().time() + 10
        while len(woken) < len(WORK_CHANNELS):  # it wakes every channel once it listens
            assert asyncio.get_running_loop().time() < deadline, woken
            await asyncio.sleep(0.01)
        woken.clear()
        with psycopg.connect(pg_url, autocommit=True) as other:
            other.execute("SELECT pg_notify('stepwarden_done', '')")
            other.execute("SELECT pg_notify('stepwarden_tasks', '')")  # after the other: a marker
        while not woken:
            assert asyncio.get_running_loop().time() < deadline, "the tasks hint never came"
            await asyncio.sleep(0.01)
        stop.set()
        await listening
        return woken

    try:
        assert asyncio.run(main()) == ["stepwarden_tasks"]
    finally:
        store.close()


def test_a_waiting_task_that_is_not_a_fresh_submission_does_not_stand_in_for_a_hint(
    store: Store, make_workflow: Factory, task_listener: psycopg.Connection, pg_url: str, clock: FakeClock
) -> None:
    """Only a submission made in the last second and untouched since is a sign that a scheduler
    was woken for it: not an operator's retry (no hint of its own), not one left waiting for long."""
    wf = make_workflow()
    first = submit(store, wf, {"n": 1})
    with psycopg.connect(pg_url, autocommit=True) as conn:  # as an operator's retry leaves it
        conn.execute("UPDATE tasks SET run_at = 0, updated_at = updated_at + 1 WHERE id = %s", (first,))
    hints(task_listener, pg_url, TASKS)
    submit(store, wf, {"n": 2})
    assert hints(task_listener, pg_url, TASKS) == 1
    clock.advance(2)  # the second has waited 2 s: whatever woke for it did not take it
    submit(store, wf, {"n": 3})
    assert hints(task_listener, pg_url, TASKS) == 1


def test_a_submission_inside_a_caller_s_transaction_always_hints(
    store: Store, make_workflow: Factory, task_listener: psycopg.Connection, pg_url: str
) -> None:
    """What is waiting when the statement runs may be claimed long before the caller commits."""
    from stepwarden.store import transitions as t

    wf = make_workflow()
    submit(store, wf, {"n": 1})  # waiting, fresh
    hints(task_listener, pg_url, TASKS)
    assert isinstance(store, PostgresStore)
    with psycopg.connect(pg_url) as conn:
        tx = store.tx_on(conn)
        t.submit(tx, wf, '{"n": 2}', correlation_id=None, idempotency_key=None, priority=0, reply_to=None)
        tx.flush()
        tx.send_notifications()
        conn.commit()
    assert hints(task_listener, pg_url, TASKS) == 1
