"""The half-open trial of a shared circuit breaker (AGT3, REL3): exactly one call, and a verdict
the store always gets.

- A trial's verdict whose write is lost (the store unreachable, a connection dropped) is owed:
  written again, with back-off on the agent's clock, until the store answers. Lost, it left the
  breaker half-open with this instance's trial, and no instance called the service for
  ``trial_ttl`` (60 s) although it was back. A late verdict closes or reopens only the trial it
  is about, never one another instance took since.
- While the breaker is not closed, only the trial's own first try reaches the service: the other
  attempts running on the instance that holds the trial fail fast too.

Time is a FakeClock driven by ``fake_time`` (the role's clock and the store's), so the cool-off,
the back-off of the owed writes and ``trial_ttl`` are crossed without sleeping; where the store's
statements decide, the tests run on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_agent_role import (
    ME,
    Dispatch,
    WrappedStore,
    down_once,
    finish,
    kinds,
    make_role,
    open_breaker,
    replies,
    until,
)

from stepwarden.agent import Agent, AgentRole, Request
from stepwarden.clock import FakeClock
from stepwarden.errors import Transient
from stepwarden.policies import Backoff
from stepwarden.store import Store, open_store
from stepwarden.store import agents as sa

OTHER = "agent-2:2:def"
# Once the store answers again, an owed verdict is written within this (agent_health.REPAY_MAX).
REPAID_WITHIN = 4.0
LOST = "could not record the breaker trial's verdict"


@pytest.fixture
def any_store(store_url: str, clock: FakeClock) -> Iterator[Store]:
    """A fresh store on SQLite and on PostgreSQL, its database clock the test's FakeClock."""
    s = open_store(store_url, clock=clock)
    yield s
    s.close()


class Outage(WrappedStore):
    """The store, except that the transactions ``lost`` picks fail, their connection lost before
    they commit, while ``down`` is set (``lost_writes`` counts them). Its transactions in flight
    are counted, so that ``fake_time.settle`` waits for them on either store."""

    def __init__(self, store: Store, lost: Callable[..., bool]) -> None:
        super().__init__(store)
        self.lost, self.down = lost, True
        self.lost_writes = 0
        self.inflight = 0

    async def transact(self, fn: Any, *args: Any, **kw: Any) -> Any:
        self.inflight += 1
        try:
            if self.down and self.lost(fn, *args):
                self.lost_writes += 1
                raise ConnectionError("server closed the connection unexpectedly")
            return await self.store.transact(fn, *args, **kw)
        finally:
            self.inflight -= 1


def trial_reports(fn: Any, *args: Any) -> bool:
    return fn is sa.report and args[1].trial


def give_backs(fn: Any, *args: Any) -> bool:
    return fn is sa.return_trials


def nothing(fn: Any, *args: Any) -> bool:
    return False


def tracked(fake_time: Any, store: Store, lost: Callable[..., bool] = nothing) -> Outage:
    """``store`` behind an :class:`Outage`, known to ``fake_time``."""
    out = Outage(store, lost)
    fake_time.stores.append(out)
    return out


def breaker(store: Store) -> dict[str, Any]:
    [b] = store.transact_sync(sa.list_agents)["breakers"]
    return b


def successes(store: Store, worker: str) -> int:
    """The calls ``worker`` has recorded as answered."""
    instances = store.transact_sync(sa.list_agents, True)["instances"]
    return sum(i["successes_total"] for i in instances if i["worker"] == worker)


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(1 for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage())


def test_a_trial_success_whose_write_was_lost_closes_the_breaker_once_the_store_answers(
    any_store: Store,
    clock: FakeClock,
    fake_time: Any,
    dispatch_requests: Dispatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The service is back and the trial call says so, but the store never gets the verdict:
    the agent must not stay stopped for ``trial_ttl``. It writes the verdict again until the
    store answers (logging the outage once, not per write), and the breaker closes for all."""
    dispatch_requests(any_store, tries=1, budget=600.0)
    agent, calls = down_once()
    flaky = tracked(fake_time, any_store, trial_reports)

    async def body() -> None:
        role = make_role(flaky, agent, clock=clock)  # type: ignore[arg-type]
        await open_breaker(role)
        dispatch_requests(any_store, tries=1, budget=600.0)
        clock.advance(10.0)
        assert await role.pull() == 1  # the trial
        await finish(role)
        assert len(calls) == 2, "the trial call reached the service, and it answered"
        await fake_time.run_for(8.0)  # the store is still unreachable
        assert (breaker(any_store)["state"], breaker(any_store)["trial_by"]) == ("half_open", ME)
        flaky.down = False
        await fake_time.run_for(REPAID_WITHIN)
        b = breaker(any_store)
        assert (b["state"], b["trial_by"]) == ("closed", None), "the trial's success was never recorded"
        assert role.breakers["svc"].state == "closed"
        # the service is back for every instance: their pulls take its requests again
        dispatch_requests(any_store, n=2, tries=1, budget=600.0)
        other = AgentRole(any_store, {"svc": agent}, OTHER, clock=clock)
        assert await other.pull() == 2
        await finish(other)

    asyncio.run(body())
    assert flaky.lost_writes >= 3  # written again while the store was away
    assert warnings_of(caplog, LOST) == 1  # one outage, one warning
    assert [k for k in kinds(any_store) if k.startswith("breaker")] == [
        "breaker_opened",
        "breaker_trial",
        "breaker_closed",
    ]
    assert [r["outcome"] for r in replies(any_store)] == ["retry", "ok", "ok", "ok"]


def test_a_trial_failure_whose_write_was_lost_reopens_the_breaker_for_one_cool_off(
    any_store: Store, clock: FakeClock, fake_time: Any, dispatch_requests: Dispatch
) -> None:
    """The trial call fails and its verdict's write is lost: written again, it reopens the
    breaker for one cool-off, after which another instance may try, rather than after
    ``trial_ttl``. The trial's attempt itself makes no second call: its later tries fail fast."""
    dispatch_requests(any_store, tries=1, budget=600.0)
    agent = Agent("svc", breaker_threshold=1, breaker_cool_off=10.0)
    calls: list[int] = []
    trial_task = 0

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(req.task_id)
        raise Transient("down")

    flaky = tracked(fake_time, any_store, trial_reports)

    async def body() -> None:
        nonlocal trial_task
        role = make_role(flaky, agent, clock=clock)  # type: ignore[arg-type]
        await open_breaker(role)
        [trial_task] = dispatch_requests(any_store, tries=3, budget=600.0)
        clock.advance(10.0)
        assert await role.pull() == 1  # the trial
        await fake_time.run_for(2.0)
        await finish(role)
        assert calls.count(trial_task) == 1, "a trial attempt makes one call"
        flaky.down = False
        await fake_time.run_for(REPAID_WITHIN)
        b = breaker(any_store)
        assert (b["state"], b["trial_by"]) == ("open", None), "the trial's failure was never recorded"
        assert b["retry_in"] is not None and b["retry_in"] <= 10.0
        await fake_time.run_for(10.0)
        dispatch_requests(any_store, tries=1, budget=600.0)
        other = AgentRole(any_store, {"svc": agent}, OTHER, clock=clock)
        assert await other.pull() == 0  # its first pull reads the shared breaker: cool-off over
        assert await other.pull() == 1  # the next trial, one cool-off later
        await finish(other)

    asyncio.run(body())
    [trial_reply] = [r for r in replies(any_store) if r["task_id"] == trial_task]
    assert trial_reply["outcome"] == "retry" and "circuit breaker" in trial_reply["error"]
    assert [k for k in kinds(any_store) if k.startswith("breaker")] == [
        "breaker_opened",
        "breaker_trial",
        "breaker_reopened",
        "breaker_trial",
        "breaker_reopened",
    ]


def test_a_give_back_whose_write_was_lost_is_written_again(
    any_store: Store,
    clock: FakeClock,
    fake_time: Any,
    dispatch_requests: Dispatch,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trial's request ended without calling the service (too little time left) and the
    give-back of its trial is lost: written again, the trial is anyone's at once."""
    dispatch_requests(any_store, tries=1, budget=600.0)
    agent, calls = down_once()
    flaky = tracked(fake_time, any_store, give_backs)

    async def body() -> None:
        role = make_role(flaky, agent, clock=clock)  # type: ignore[arg-type]
        await open_breaker(role)
        dispatch_requests(any_store, tries=1, budget=10.5)  # 0.5 s left after the cool-off
        clock.advance(10.0)
        monkeypatch.setattr("stepwarden.agent_attempt.MIN_TRY_LEFT", 1.0)  # too little to try
        assert await role.pull() == 1  # the trial
        await finish(role)
        monkeypatch.undo()
        assert len(calls) == 1 and flaky.lost_writes == 1
        flaky.down = False
        await fake_time.run_for(REPAID_WITHIN)
        b = breaker(any_store)
        assert (b["state"], b["trial_by"]) == ("open", None), "the trial was never given back"
        dispatch_requests(any_store, tries=1, budget=600.0)
        assert await role.pull() == 1  # the next trial, with no cool-off
        await finish(role)
        assert len(calls) == 2 and role.breakers["svc"].state == "closed"

    asyncio.run(body())
    assert "breaker_trial_returned" in kinds(any_store)


def test_a_late_verdict_never_settles_a_trial_taken_since(
    any_store: Store, clock: FakeClock, fake_time: Any, dispatch_requests: Dispatch
) -> None:
    """The store is away for longer than ``trial_ttl``: meanwhile the instance that owes a
    success claims no new trial of its own (the store would take the late verdict for the new
    trial's), another instance takes the trial, and the late success, written when the store
    answers, does not close the breaker under that trial, which then fails and reopens it."""
    dispatch_requests(any_store, tries=1, budget=600.0)
    agent = Agent("svc", breaker_threshold=1, breaker_cool_off=10.0)
    calls: list[int] = []
    gate = asyncio.Event()

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(req.task_id)
        if len(calls) == 2:
            return "up"  # this instance's trial
        if len(calls) == 3:
            await gate.wait()  # the other instance's trial, slow
        raise Transient("down")

    flaky = tracked(fake_time, any_store, trial_reports)
    steady = tracked(fake_time, any_store)

    async def body() -> None:
        role = make_role(flaky, agent, clock=clock)  # type: ignore[arg-type]
        await open_breaker(role)
        dispatch_requests(any_store, tries=1, budget=600.0)
        clock.advance(10.0)
        assert await role.pull() == 1  # the trial: it succeeds, its verdict is not recorded
        await finish(role)
        await fake_time.run_for(64.0)  # past trial_ttl (60 s)
        dispatch_requests(any_store, tries=1, budget=600.0)
        assert await role.pull() == 0, "it owes the last trial's verdict: no new trial"
        other = AgentRole(steady, {"svc": agent}, OTHER, clock=clock)  # type: ignore[arg-type]
        assert await other.pull() == 0  # its first pull reads the shared breaker
        assert await other.pull() == 1  # the trial is the other instance's now
        await until(lambda: len(calls) == 3)
        flaky.down = False
        await fake_time.run_for(REPAID_WITHIN)  # the late success is written...
        assert successes(any_store, ME) == 1
        b = breaker(any_store)
        assert (b["state"], b["trial_by"]) == ("half_open", OTHER)  # ... and closes nothing
        gate.set()
        await finish(other)
        await fake_time.settle()
        b = breaker(any_store)
        assert (b["state"], b["trial_by"]) == ("open", None)

    asyncio.run(body())
    assert [k for k in kinds(any_store) if k.startswith("breaker")] == [
        "breaker_opened",
        "breaker_trial",
        "breaker_trial",
        "breaker_reopened",
    ]


@pytest.mark.parametrize("store_back", [True, False])
def test_a_stopping_instance_writes_an_owed_verdict_once_more_and_leaves_nothing_running(
    any_store: Store,
    clock: FakeClock,
    fake_time: Any,
    dispatch_requests: Dispatch,
    caplog: pytest.LogCaptureFixture,
    store_back: bool,
) -> None:
    """The writes again end at the worker's stop, which makes one last one: the store may be
    back while the next write waits out its back-off. Still away, the verdict is given up (the
    trial opens to the others after ``trial_ttl``, as when an instance dies) and said so."""
    dispatch_requests(any_store, tries=1, budget=600.0)
    agent, _ = down_once()
    flaky = tracked(fake_time, any_store, trial_reports)

    async def body() -> None:
        role = make_role(flaky, agent, clock=clock)  # type: ignore[arg-type]
        await open_breaker(role)
        dispatch_requests(any_store, tries=1, budget=600.0)
        clock.advance(10.0)
        assert await role.pull() == 1
        await finish(role)
        await fake_time.run_for(8.0)  # the next write waits its back-off
        flaky.down = not store_back
        await asyncio.wait_for(role.health.stop(), 5.0)
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("health-")]
        assert breaker(any_store)["state"] == ("closed" if store_back else "half_open")

    asyncio.run(body())
    assert ("on stopping" in caplog.text) is not store_back


def test_while_the_trial_runs_the_other_attempts_of_its_instance_fail_fast(
    tracked_store: Store, clock: FakeClock, fake_time: Any, dispatch_requests: Dispatch
) -> None:
    """The instance that holds the half-open trial also runs attempts that were in their retry
    loop when the breaker opened. Their tries while the trial runs must fail fast, not call the
    service as if the breaker were closed: the trial is exactly one call. Once it succeeds, they
    call again, and succeed."""
    backoff = Backoff(initial=1.0, maximum=1.0, jitter=0.0)
    [busy] = dispatch_requests(tracked_store, tries=100, budget=600.0, backoff=backoff)
    agent = Agent("svc", concurrency=3, breaker_threshold=1, breaker_cool_off=10.0)
    service = {"up": False, "trial running": False}
    during_trial: list[int] = []  # calls made while the trial call ran, by the other attempt

    async def body() -> None:
        gate = asyncio.Event()

        @agent.operation
        async def do_s(req: Request) -> str:
            if req.task_id != busy:  # the trial's request
                service["trial running"] = True
                await gate.wait()
                service.update({"up": True, "trial running": False})
                return "up"
            if service["trial running"]:
                during_trial.append(req.task_id)
            if not service["up"]:
                raise Transient("down")
            return "ok"

        role = make_role(tracked_store, agent, clock=clock)
        assert await role.pull() == 1  # its first try fails: the breaker opens
        await fake_time.settle()
        assert breaker(tracked_store)["state"] == "open"
        [trial_task] = dispatch_requests(tracked_store, tries=1, budget=600.0)
        await fake_time.run_for(10.0)  # the cool-off; the busy attempt's tries fail fast
        assert await role.pull() == 1  # the trial
        await until(lambda: service["trial running"])
        await fake_time.run_for(5.0)  # five more tries of the busy attempt while the trial runs
        assert during_trial == [], "calls reached the service while the half-open trial ran"
        gate.set()
        await fake_time.run_for(2.0)
        await finish(role)
        assert breaker(tracked_store)["state"] == "closed"
        outcomes = {r["task_id"]: r["outcome"] for r in replies(tracked_store)}
        assert outcomes == {busy: "ok", trial_task: "ok"}

    asyncio.run(body())
    assert [k for k in kinds(tracked_store) if k.startswith("breaker")] == [
        "breaker_opened",
        "breaker_trial",
        "breaker_closed",
    ]


def test_a_verdict_whose_write_fails_after_the_stop_passed_says_it_is_given_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The trial's verdict was still being written when the worker stopped, and the write failed
    after ``stop`` had made its last one: the warning promised to write it again until the store
    answered, but nothing would. It now says what happens instead: the trial opens to the other
    instances after ``trial_ttl``."""
    from stepwarden.agent import Agent
    from stepwarden.agent_health import AgentHealth
    from stepwarden.agent_settings import AgentSettings
    from stepwarden.clock import SYSTEM_CLOCK

    class SlowThenLost:
        def __init__(self) -> None:
            self.release = asyncio.Event()
            self.calls: list[str] = []

        async def transact(self, fn: Any, *args: Any, **kw: Any) -> Any:
            self.calls.append(fn.__name__)
            if fn is sa.report:
                await self.release.wait()
                raise ConnectionError("server closed the connection unexpectedly")
            return None

    async def body() -> None:
        store = SlowThenLost()
        health = AgentHealth(store, "me:1:x", {"svc": Agent("svc")}, SYSTEM_CLOCK, AgentSettings())  # type: ignore[arg-type]
        health.breakers["svc"].trial = True
        health.report_soon("svc", True, None, trial=True)  # the trial call answered
        await health.stop()  # waits 2 s for the write in flight, then goes on without it
        store.release.set()
        await asyncio.sleep(0)
        for t in [t for t in asyncio.all_tasks() if t.get_name().startswith("health-report")]:
            await t
        assert not health._repaying, "nothing writes it again after the stop"

    asyncio.run(body())
    assert warnings_of(caplog, "the trial opens to other instances after trial_ttl") == 1
    assert warnings_of(caplog, "writing it again until the store answers") == 0
