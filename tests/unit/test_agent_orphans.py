"""Requests taken by a transaction that failed after it committed (a connection lost in the round
trip that carries COMMIT): the store says this worker holds them, and nothing runs them. The agent
hands them back at once, so the step gets a new attempt with no failure counted, instead of
waiting for complete-by and counting a failure for a call that never started."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from test_agent_role import ME, Dispatch, Factory, LostCommits, make_role, until

from stepwarden.agent import Agent, AgentRole, AgentSettings, Request
from stepwarden.clock import FakeClock
from stepwarden.errors import Transient
from stepwarden.scheduler import SchedulerRole
from stepwarden.store import Store, open_store
from stepwarden.store import transitions as t
from stepwarden.store.agents import Want


@pytest.fixture(params=["sqlite", "postgres"])
def both_stores(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A store on the real clock (the agent's deadlines are real time), on each backend."""
    url = (
        f"sqlite:///{tmp_path / 'agent.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    s = open_store(url)
    yield s
    s.close()


# A worker that schedules too (its replies applied in their own transaction), polling briskly.
BUSY = AgentSettings(apply_replies=True, poll_interval=0.01, idle_poll_max=0.02)


def _recording_agent(concurrency: int) -> tuple[Agent, list[tuple[int, int]]]:
    """Agent ``svc`` whose no-op operation records (task, attempt) of every call."""
    agent = Agent("svc", concurrency=concurrency)
    ran: list[tuple[int, int]] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        ran.append((req.task_id, req.attempt))

    return agent, ran


def _processed(store: Store) -> int:
    return len(_rows(store, "SELECT id FROM tasks WHERE state = 'processed'"))


async def _run_until_processed(
    role: AgentRole, store: Store, n: int, schedule: Callable[[], Awaitable[object]]
) -> None:
    """Run the agent role, and a scheduler round after round, until ``n`` tasks are processed and
    the role has nothing left running or to send (15 s at most)."""
    stop = asyncio.Event()
    running = asyncio.create_task(role.run(stop))
    try:
        deadline = asyncio.get_running_loop().time() + 15
        while _processed(store) < n:
            assert asyncio.get_running_loop().time() < deadline, _rows(store, "SELECT * FROM requests")
            await schedule()
            await asyncio.sleep(0.01)
        await until(lambda: not role.tasks and not role._outbox, timeout=5)
    finally:
        stop.set()
        await running


def _rows(store: Store, sql: str) -> list[dict[str, Any]]:
    return store.transact_sync(lambda tx: tx.sql(sql))


def test_requests_a_lost_commit_took_are_released_at_once_with_no_failure_counted(
    both_stores: Store, dispatch_requests: Dispatch
) -> None:
    rt_store = both_stores
    ids = dispatch_requests(rt_store, 4, budget=60.0, tries=4)  # complete-by far beyond the test
    agent, ran = _recording_agent(2)

    store = LostCommits(rt_store, "send_replies_and_take", fail=1, committed=True)

    async def body() -> None:
        role = make_role(store, agent, settings=BUSY)  # type: ignore[arg-type]
        rng = random.Random(0)

        async def schedule() -> None:  # the scheduler, by hand: it applies what the agent releases
            await asyncio.to_thread(rt_store.transact_sync, t.schedule, "sched", 100, rng)

        # The first two run; their reply batch takes the other two and commits, and its answer
        # is lost.
        await _run_until_processed(role, rt_store, 4, schedule)

    asyncio.run(body())
    assert store.calls >= 2
    first, lost = ids[:2], ids[2:]
    # each ran once; the two the lost commit took ran as attempt 2, the released attempt 1 unused
    assert sorted(ran) == sorted([(i, 1) for i in first] + [(i, 2) for i in lost])
    tasks = _rows(rt_store, "SELECT id, failure_count FROM tasks ORDER BY id")
    assert [r["failure_count"] for r in tasks] == [0, 0, 0, 0]
    released = _rows(
        rt_store, "SELECT task_id, outcome, error FROM replies WHERE outcome = 'released' ORDER BY task_id"
    )
    assert [r["task_id"] for r in released] == lost
    assert all("commit was not confirmed" in r["error"] for r in released)
    assert not _rows(rt_store, "SELECT id FROM requests WHERE state = 'taken'")
    assert not _rows(rt_store, "SELECT id FROM events WHERE kind = 'rescued'")


def test_the_sweep_leaves_running_calls_and_expired_attempts_alone(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """Of what this worker holds in the store, only the live attempts it does not run are released:
    not a call it is running, not an attempt past complete-by (the supervisor rescues that one,
    and counts it)."""
    running_id, other = dispatch_requests(rt_store, 2, budget=60.0, tries=4)
    agent = Agent("svc", concurrency=1)
    gate = asyncio.Event()

    @agent.operation
    async def do_s(req: Request) -> None:
        await gate.wait()

    def hold_other(complete_by: str) -> None:  # as a lost commit would leave it, for this worker
        rt_store.transact_sync(
            lambda tx: tx.sql(
                f"UPDATE requests SET state = 'taken', taken_by = ?, complete_by = {complete_by} "
                "WHERE task_id = ?",
                (ME, other),
            )
        )

    def released() -> list[int]:
        return [
            r["task_id"] for r in _rows(rt_store, "SELECT task_id FROM replies WHERE outcome = 'released'")
        ]

    async def body() -> None:
        role = make_role(rt_store, agent)
        assert await role.pull() == 1  # capacity 1: the first task's request, now running
        assert [m.task_id for m in role.tasks.values()] == [running_id]
        hold_other("sw_now() - 1")  # expired
        role._takes_unknown = True
        await role._release_unknown_takes()
        assert role._takes_unknown is False
        assert released() == []  # neither the running call nor the expired attempt
        hold_other("sw_now() + 60")  # the same, still live: this one is lost, and released
        role._takes_unknown = True
        await role._release_unknown_takes()
        assert released() == [other]
        gate.set()
        await until(lambda: not role.tasks, timeout=5)

    asyncio.run(body())


def rooms(reserved: Mapping[str, Want]) -> dict[str, int]:
    return {name: want.room for name, want in reserved.items()}


class _Local:
    def __init__(self) -> None:
        self.accepted: list[bool] = []

    def reserve(self) -> dict[str, Want]:
        return {"svc": Want(2, ops='["do_s"]')}

    async def workflows_of(self, msgs: list[Any]) -> dict[int, str]:
        return {}

    def accept(
        self,
        msgs: list[Any],
        reserved: Mapping[str, Want],
        failed: bool = False,
        workflows: Mapping[int, str] | None = None,
    ) -> None:
        self.accepted.append(failed)


def test_a_scheduler_round_that_fails_tells_its_agents_the_take_is_unknown(rt_store: Store) -> None:
    local = _Local()
    role = SchedulerRole(LostCommits(rt_store, "schedule_and_take", fail=1), "sched", local=local)  # type: ignore[arg-type]
    with pytest.raises(ConnectionError):
        asyncio.run(role.tick())
    assert local.accepted == [True]


class _InstantBackoff(FakeClock):
    """A fake clock whose sleeps pass at once: the reply sender tries until complete-by (a
    minute here, so that only the agent's memory of the call keeps the sweep off it) in no time."""

    async def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)


def test_a_call_that_ran_but_whose_reply_never_got_through_is_not_released(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """It ran (its effect may be done): released as never started, its failure would go
    uncounted. It stays taken, for the supervisor to rescue at complete-by and count."""
    (task,) = dispatch_requests(rt_store, 1, budget=60.0, tries=4)
    agent = Agent("svc", concurrency=1)
    ran: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        ran.append(req.task_id)

    store = LostCommits(rt_store, "send_replies_and_take", fail=10**6)  # every try of the sender

    async def body() -> None:
        settings = AgentSettings(apply_replies=True)
        role = make_role(store, agent, settings=settings, clock=_InstantBackoff())  # type: ignore[arg-type]
        assert await role.pull() == 1
        await until(lambda: not role.tasks, timeout=5)  # ran; the sender gave up at complete-by
        assert ran == [task] and store.calls > 5
        assert role._takes_unknown  # those failed batches held reservations
        await role._release_unknown_takes()
        assert not role._takes_unknown

    asyncio.run(body())
    assert not _rows(rt_store, "SELECT id FROM replies")
    assert [r["state"] for r in _rows(rt_store, "SELECT state FROM requests")] == ["taken"]


def test_the_sweep_waits_for_a_take_in_flight_and_holds_new_ones_back(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """A reservation out is a transaction that may still bring requests to run: the sweep waits
    for it, and no new one is handed out meanwhile."""
    dispatch_requests(rt_store, 1, budget=60.0, tries=4)
    agent = Agent("svc", concurrency=2)

    @agent.operation
    async def do_s(req: Request) -> None:
        return None

    async def body() -> None:
        role = make_role(rt_store, agent)
        await role.pull()
        await until(lambda: not role.tasks, timeout=5)
        reserved = role.reserve()
        assert rooms(reserved) == {"svc": 2} and reserved["svc"].ops == '["do_s"]'
        role._takes_unknown = True
        sweep = asyncio.create_task(role._release_unknown_takes())
        await until(lambda: role._sweeping)
        assert role.reserve() == {}  # held back while the sweep waits
        await asyncio.sleep(0.05)
        assert not sweep.done() and role._takes_unknown  # still waiting for that transaction
        role.accept([], reserved, failed=True)
        await asyncio.wait_for(sweep, 5)
        assert not role._takes_unknown and not role._sweeping
        assert rooms(role.reserve()) == {"svc": 2}

    asyncio.run(body())


def test_a_pull_that_failed_marks_its_take_unknown(rt_store: Store, dispatch_requests: Dispatch) -> None:
    """The agent's own pull, lost after its commit: what it took is released by the sweep."""
    (task,) = dispatch_requests(rt_store, 1, budget=60.0, tries=4)
    agent = Agent("svc", concurrency=1)

    @agent.operation
    async def do_s(req: Request) -> None:
        return None

    store = LostCommits(rt_store, "transact", fail=1, committed=True, when=_the_pull)

    async def body() -> None:
        role = make_role(store, agent)  # type: ignore[arg-type]
        await role.health.register({"svc": 1})
        with pytest.raises(ConnectionError):
            await role.pull()
        assert role._takes_unknown
        assert not role.tasks  # taken in the store, run by nobody here
        await role._release_unknown_takes()

    asyncio.run(body())
    released = _rows(rt_store, "SELECT task_id, outcome FROM replies")
    assert released == [{"task_id": task, "outcome": "released"}]


def _the_pull(fn: Any, *args: Any, **kw: Any) -> bool:
    return getattr(fn, "__name__", "") == "pull"  # the agent's own take (store/agents.py)


def _breaker(store: Store) -> dict[str, Any]:
    (row,) = _rows(store, "SELECT state, trial_by FROM agent_breakers WHERE agent = 'svc'")
    return row


def test_a_trial_won_by_a_pull_whose_commit_was_lost_is_given_back_at_once(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """After the cool-off, a pull wins the half-open trial and takes one request for it; its
    commit goes through, the answer is lost. The sweep hands the request back unrun, and the
    trial with it: another instance tries the service at once, not after ``trial_ttl``."""
    dispatch_requests(store, 1, budget=600.0, tries=1)
    agent = Agent("svc", breaker_threshold=1, breaker_cool_off=10.0)
    calls: list[str] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(req.idempotency_key)
        if len(calls) == 1:
            raise Transient("down")
        return "up"

    lossy = LostCommits(store, "transact", fail=1, committed=True, when=_the_pull)

    async def body() -> None:
        role = make_role(store, agent, clock=clock)
        other = AgentRole(store, {"svc": agent}, "agent-2:2:def", clock=clock)
        await role.health.register({"svc": 8})
        assert await role.pull() == 1
        await until(lambda: not role.tasks)
        assert _breaker(store)["state"] == "open"
        await other.health.register({"svc": 8})
        assert await other.pull() == 0  # it reads the shared breaker: open, cool-off running
        (trial_task,) = dispatch_requests(store, 1, budget=600.0, tries=1)
        clock.advance(10.0)
        role.store = role.health.store = lossy  # type: ignore[assignment]
        with pytest.raises(ConnectionError):
            await role.pull()  # won the trial and took its request; the answer lost
        assert _breaker(store) == {"state": "half_open", "trial_by": ME}
        assert not role.tasks and role.health.trials_unknown == {"svc"}
        await role._release_unknown_takes()
        assert _breaker(store) == {"state": "open", "trial_by": None}
        assert not role.health.trials_unknown
        # the request is back (a released reply, applied by a scheduler): the trial is anyone's
        store.transact_sync(t.schedule, "sched", 100, random.Random(0))
        assert await other.pull() == 1
        await until(lambda: not other.tasks)
        assert other.breakers["svc"].state == "closed"
        assert calls[-1] == f"{trial_task}:s"

    asyncio.run(body())
    assert "breaker_trial_returned" in [
        r["kind"] for r in _rows(store, "SELECT kind FROM events ORDER BY id")
    ]


def test_a_trial_the_instance_knows_it_holds_is_not_given_back(store: Store, clock: FakeClock) -> None:
    """The sweep can run after a later pull won a trial of the same agent (the sweep waited out a
    reservation, the pull went on): that trial is running here and keeps its claim."""
    agent = Agent("svc", breaker_threshold=1, breaker_cool_off=10.0)

    async def body() -> None:
        role = make_role(store, agent, clock=clock)
        await role.health.register({"svc": 8})
        store.transact_sync(
            lambda tx: tx.sql(
                "UPDATE agent_breakers SET state = 'half_open', trial_by = ?, retry_at = sw_now() + 60",
                (ME,),
            )
        )
        role.health.trials_unknown = {"svc"}
        role.breakers["svc"].trial = True  # won by the later pull, running
        await role.health.return_unknown_trials()
        assert _breaker(store) == {"state": "half_open", "trial_by": ME}
        role.breakers["svc"].trial = False  # not known here: given back
        role.health.trials_unknown = {"svc"}
        await role.health.return_unknown_trials()
        assert _breaker(store) == {"state": "open", "trial_by": None}

    asyncio.run(body())


def _open_past_cool_off(store: Store) -> None:
    store.transact_sync(
        lambda tx: tx.sql(
            "UPDATE agent_breakers SET state = 'open', failures = 1, opened_at = sw_now() - 20,"
            " retry_at = sw_now() - 1, trial_by = NULL WHERE agent = 'svc'"
        )
    )


def test_a_trial_a_later_pull_won_is_kept_while_its_report_is_in_flight(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """An unknown trial (a lost pull's) followed by a pull that wins the trial for real: that
    trial is known, and a sweep made while its report is being written (the mirror's ``trial``
    already cleared) must not give it back as unrun: its failure must reopen the breaker."""
    dispatch_requests(store, 1, budget=600.0, tries=1)
    agent = Agent("svc", breaker_threshold=1, breaker_cool_off=10.0)
    agent.operation(lambda req: None, name="do_s")  # a pull takes only operations the worker has

    async def body() -> None:
        role = make_role(store, agent, clock=clock)
        await role.health.register({"svc": 8})
        _open_past_cool_off(store)
        role.breakers["svc"].state = "open"  # as its last pull read it
        role.breakers["svc"].retry_at = clock.monotonic()
        dispatch_requests(store, 1, budget=600.0, tries=1)
        role.health.trials_unknown = {"svc"}  # a lost pull's, before this one
        got, trials, _, _ = await role.health.pull({"svc": 8})
        assert len(got) == 1 and trials == {"svc"}
        assert role.health.trials_unknown == set()
        role.breakers["svc"].trial = False  # as _send leaves it while the report is in flight
        await role.health.return_unknown_trials()
        assert _breaker(store) == {"state": "half_open", "trial_by": ME}

    asyncio.run(body())


def test_a_stopping_agent_gives_back_a_trial_a_lost_pull_may_have_won(store: Store, clock: FakeClock) -> None:
    """It sweeps no more: the trial is given back when it stops, not after trial_ttl."""
    agent = Agent("svc", breaker_threshold=1, breaker_cool_off=10.0)

    async def body() -> None:
        role = make_role(store, agent, clock=clock)
        await role.health.register({"svc": 8})
        store.transact_sync(
            lambda tx: tx.sql(
                "UPDATE agent_breakers SET state = 'half_open', trial_by = ?, retry_at = sw_now() + 60",
                (ME,),
            )
        )
        role.health.trials_unknown = {"svc"}
        await role.health.stop()
        assert _breaker(store) == {"state": "open", "trial_by": None}

    asyncio.run(body())


def test_requests_a_lost_scheduler_round_took_are_released_and_run_with_no_failure_counted(
    rt_store: Store, make_workflow: Factory
) -> None:
    """A worker that schedules and runs: its round claims, dispatches and takes for its own
    agent, commits, and the answer is lost. The agent releases what the round took; the next
    rounds dispatch and run them as attempt 2, with no failure counted."""
    wf = make_workflow("s", budget=60.0, compensate=False)
    ids = [
        rt_store.transact_sync(
            t.submit, wf, "{}", correlation_id=None, idempotency_key=None, priority=0, reply_to=None
        )[0]
        for _ in range(2)
    ]
    agent, ran = _recording_agent(2)

    store = LostCommits(rt_store, "schedule_and_take", fail=1, committed=True)

    async def body() -> None:
        role = make_role(store, agent, settings=BUSY)  # type: ignore[arg-type]
        await role.health.register({"svc": 2})
        sched = SchedulerRole(store, ME, local=role)  # type: ignore[arg-type]  # one worker: one name
        with pytest.raises(ConnectionError):
            await sched.tick()  # claimed, dispatched and took both, committed; the answer lost
        assert role._takes_unknown and not role.tasks
        await _run_until_processed(role, rt_store, 2, sched.tick)

    asyncio.run(body())
    assert sorted(ran) == [(i, 2) for i in ids]  # each ran once, as a new attempt
    tasks = _rows(rt_store, "SELECT failure_count FROM tasks ORDER BY id")
    assert [r["failure_count"] for r in tasks] == [0, 0]
    assert [
        r["outcome"] for r in _rows(rt_store, "SELECT outcome FROM replies WHERE outcome = 'released'")
    ] == [
        "released",
        "released",
    ]
