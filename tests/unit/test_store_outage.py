"""While the store is down, the roles' loops back off and say so twice: once when the failures
begin (a warning with the error), once when the store answers again (REL3).

They used to try again every ``idle_poll_max`` (0.25 s) for the whole outage, with a warning
per round (two a round for the agent: its pull, and its sweep for lost takes): 39 warnings in a
5 s outage from one agent role. Each test drives the role's fake clock by exactly the sleeps the
role begins (``drive``), so the waits it chose can be read back, and an outage of a minute
takes milliseconds.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from typing import Any

import pytest
from test_agent_reply_deadline import Sleeps, drive
from test_agent_role import WrappedStore, make_role

from stepwarden.agent import Agent, Request
from stepwarden.clock import STORE_RETRY, Outage
from stepwarden.errors import StoreMisconfigured
from stepwarden.scheduler import SchedulerRole
from stepwarden.stop_writes import StopWrites
from stepwarden.store import ApplyResult, Store

CAP = STORE_RETRY.maximum  # 5 s
JITTER = STORE_RETRY.jitter  # +-20 %


class Outages:
    """Takes a store down and brings it back; notes, for every call refused while it is down,
    how many sleeps the role's clock had begun: the sleep that follows a failed round is the
    next one, whatever else the role slept before."""

    def __init__(self, clock: Sleeps) -> None:
        self.clock = clock
        self.down = False
        self.failed_at: set[int] = set()  # a round's calls (a pull and a sweep) share one
        self.answered = 0  # calls that went through

    def check(self) -> None:
        if self.down:
            self.failed_at.add(len(self.clock.slept))
            raise ConnectionError("connection refused")
        self.answered += 1

    def waits(self) -> list[float]:
        """The sleeps that followed failed rounds (those begun so far)."""
        return [self.clock.slept[i] for i in sorted(self.failed_at) if i < len(self.clock.slept)]


class Down(WrappedStore):
    """The store, refusing every transaction while ``outages.down`` (a database unreachable)."""

    def __init__(self, store: Store, outages: Outages) -> None:
        super().__init__(store)
        self.outages = outages

    async def transact(self, fn: Any, *args: Any, **kw: Any) -> Any:
        self.outages.check()
        return await self.store.transact(fn, *args, **kw)

    async def requests_taken_by(self, me: str) -> Any:
        self.outages.check()
        return await self.store.requests_taken_by(me)


class Rounds:
    """A scheduler's store that has nothing to do, or is unreachable while ``outages.down``."""

    def __init__(self, outages: Outages) -> None:
        self.outages = outages

    async def schedule(self, me: str, limit: int) -> tuple[ApplyResult, int]:
        self.outages.check()
        return ApplyResult(), 0


def assert_backs_off(waits: list[float]) -> None:
    """From a quarter second, doubling, to the cap (each within the jitter)."""
    assert waits[0] <= 0.25 * (1 + JITTER), waits
    for a, b in itertools.pairwise(waits[:5]):
        assert b >= a * 2 * (1 - JITTER) / (1 + JITTER), waits  # grows
    assert all(CAP * (1 - JITTER) <= w <= CAP * (1 + JITTER) for w in waits[5:]), waits  # capped


def svc_agent() -> Agent:
    """An agent with one operation that does nothing: the roles' loops here call no service."""
    agent = Agent("svc")

    @agent.operation
    async def do_s(req: Request) -> None:
        return None

    return agent


def said(caplog: pytest.LogCaptureFixture, logger: str, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno == level]


async def outage(outages: Outages, caplog: pytest.LogCaptureFixture, logger: str) -> tuple[list[float], int]:
    """With the loop running on ``outages.clock``: take the store down for ten failed rounds,
    then bring it back for a few rounds. Returns the waits the loop chose while it was down, and
    how many rounds failed; checks that it warned once, naming the error."""
    clock = outages.clock
    await drive(clock, lambda: len(clock.slept) >= 3)  # a few idle polls: it is up
    outages.down = True
    await drive(clock, lambda: len(outages.waits()) >= 10)
    waits, failed = outages.waits(), len(outages.failed_at)
    assert_backs_off(waits)
    outages.down = False
    back = outages.answered
    await drive(clock, lambda: outages.answered >= back + 3)
    warnings = said(caplog, logger, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "ConnectionError('connection refused')" in warnings[0]
    return waits, failed


def assert_said_back(caplog: pytest.LogCaptureFixture, logger: str, failed: int) -> None:
    (back,) = said(caplog, logger, logging.INFO)
    found = re.search(r"the store answers again, after [\d.]+s of failed rounds \((\d+) of them\)", back)
    assert found and int(found[1]) == failed, back


def test_an_agent_role_backs_off_while_the_store_is_down_and_logs_the_outage_twice(
    rt_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stepwarden")
    agent = svc_agent()
    outages = Outages(Sleeps())

    async def body() -> tuple[list[float], int]:
        role = make_role(Down(rt_store, outages), agent, clock=outages.clock)  # type: ignore[arg-type]
        stop = asyncio.Event()
        running = asyncio.create_task(role.run(stop))
        try:
            return await outage(outages, caplog, "stepwarden.agent")
        finally:
            stop.set()
            await asyncio.wait_for(running, 5)

    _, failed = asyncio.run(body())
    assert_said_back(caplog, "stepwarden.agent", failed)


def test_a_scheduler_role_backs_off_while_the_store_is_down_and_starts_again_from_the_shortest_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stepwarden")
    outages = Outages(Sleeps())

    async def body() -> tuple[list[float], int, list[float]]:
        role = SchedulerRole(Rounds(outages), "sched", clock=outages.clock)  # type: ignore[arg-type]
        stop = asyncio.Event()
        running = asyncio.create_task(role.run(stop))
        try:
            waits, failed = await outage(outages, caplog, "stepwarden.scheduler")
            # a second outage: its waits start again from a quarter second
            outages.failed_at.clear()
            outages.down = True
            await drive(outages.clock, lambda: len(outages.waits()) >= 2)
            return waits, failed, outages.waits()
        finally:
            stop.set()
            await asyncio.wait_for(running, 5)

    _, failed, second = asyncio.run(body())
    assert_said_back(caplog, "stepwarden.scheduler", failed)
    assert second[0] <= 0.25 * (1 + JITTER), second
    assert len(said(caplog, "stepwarden.scheduler", logging.WARNING)) == 2  # one per outage


def test_the_outage_waits_grow_to_the_cap_and_start_over_once_the_store_answers() -> None:
    """The helper both loops share (and any other loop that polls the store may)."""
    clock = Sleeps()
    log = logging.getLogger("test.outage")
    outage = Outage(log, "role x", clock)
    waits = [outage.failed(ConnectionError("down")) for _ in range(8)]
    assert_backs_off(waits)
    outage.answered()
    assert outage.failed(ConnectionError("down")) <= 0.25 * (1 + JITTER)


def test_an_agent_roles_rounds_tell_the_stop_writes_whether_the_store_answers(rt_store: Store) -> None:
    """The agent loop shares what it sees of the store with the worker's stop writes: a failed
    pull gives them a brief try, the next pull that goes through the full wait again."""
    agent = svc_agent()
    outages = Outages(Sleeps())
    writes = StopWrites(full=5.0, brief=0.5)

    async def body() -> None:
        role = make_role(Down(rt_store, outages), agent, clock=outages.clock, stop_writes=writes)  # type: ignore[arg-type]
        stop = asyncio.Event()
        running = asyncio.create_task(role.run(stop))
        try:
            await drive(outages.clock, lambda: len(outages.clock.slept) >= 3)
            assert writes.answering
            outages.down = True
            await drive(outages.clock, lambda: not writes.answering)  # fails after 5 s if never
            assert outages.failed_at and writes.bound == 0.5
            outages.down = False
            back = outages.answered
            await drive(outages.clock, lambda: writes.answering)
            assert outages.answered > back and writes.bound == 5.0
        finally:
            stop.set()
            await asyncio.wait_for(running, 5)

    asyncio.run(body())


def test_an_agent_whose_slots_are_all_held_does_not_take_its_idle_rounds_for_the_store_answering(
    rt_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """With every slot held (a scheduler's transaction reserved them, and waits for a connection),
    a pull asks the store nothing. Its empty answer was taken for the store answering: in a 90 s
    outage the agent logged "the store answers again" twice while the server was down, and its
    back-off started over each time. Now only a round that asked the store ends the outage."""
    caplog.set_level(logging.INFO, logger="stepwarden")
    agent = Agent("svc", concurrency=2)

    @agent.operation
    async def do_s(req: Request) -> None:
        return None

    outages = Outages(Sleeps())

    async def body() -> None:
        role = make_role(Down(rt_store, outages), agent, clock=outages.clock)  # type: ignore[arg-type]
        stop = asyncio.Event()
        running = asyncio.create_task(role.run(stop))
        try:
            await drive(outages.clock, lambda: len(outages.clock.slept) >= 3)  # up, registered
            outages.down = True
            await drive(outages.clock, lambda: len(outages.failed_at) >= 2)
            reserved = role.reserve()  # a scheduler's round takes every free slot, and waits
            assert reserved["svc"].room == 2
            slept = len(outages.clock.slept)
            await drive(outages.clock, lambda: len(outages.clock.slept) >= slept + 3, timeout=20)
            assert said(caplog, "stepwarden.agent", logging.INFO) == [], "an outage ended while down"
            role.accept([], reserved, failed=True)  # the round failed: the slots are free again
            outages.down = False
            back = outages.answered
            await drive(outages.clock, lambda: outages.answered >= back + 2)
        finally:
            stop.set()
            await asyncio.wait_for(running, 5)

    asyncio.run(body())
    assert len(said(caplog, "stepwarden.agent", logging.INFO)) == 1  # the one true "answers again"
    assert len(said(caplog, "stepwarden.agent", logging.WARNING)) == 1


class Misconfigured(Outages):
    """A store that, once ``down``, refuses as a misconfigured one does: no wait heals it."""

    def check(self) -> None:
        if self.down:
            self.failed_at.add(len(self.clock.slept))
            raise StoreMisconfigured("reached through a transaction-mode pooler: add ?pooler=transaction")
        self.answered += 1


def test_a_misconfigured_store_ends_the_loops_instead_of_being_waited_out() -> None:
    """An outage heals; a store reached through a transaction-mode pooler without the URL's option
    does not, and some of its transactions go through: taken for an outage, it began and ended
    every few rounds in the log for as long as the worker ran. Each loop that waits out outages
    raises it at once, which ends the worker with its one line."""
    outage = Outage(logging.getLogger("test.outage"), "role x", Sleeps())
    with pytest.raises(StoreMisconfigured):
        outage.failed(StoreMisconfigured("no"))
    assert outage.failures == 0  # not counted as an outage either


def test_an_agent_role_and_a_scheduler_role_end_on_a_misconfigured_store(
    rt_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stepwarden")
    agent = svc_agent()

    async def ends(make: Any, misconfigured: Misconfigured) -> BaseException | None:
        stop = asyncio.Event()
        running = asyncio.create_task(make().run(stop))
        try:
            await drive(misconfigured.clock, lambda: len(misconfigured.clock.slept) >= 3)  # up, idle
            misconfigured.down = True
            await drive(misconfigured.clock, running.done)
        finally:
            stop.set()
        return running.exception()

    a = Misconfigured(Sleeps())
    s = Misconfigured(Sleeps())
    met_a = asyncio.run(ends(lambda: make_role(Down(rt_store, a), agent, clock=a.clock), a))  # type: ignore[arg-type]
    met_s = asyncio.run(ends(lambda: SchedulerRole(Rounds(s), "sched", clock=s.clock), s))  # type: ignore[arg-type]
    assert isinstance(met_a, StoreMisconfigured) and isinstance(met_s, StoreMisconfigured)
    # Not waited out: no outage begun in the log, no back-off slept.
    for logger in ("stepwarden.agent", "stepwarden.scheduler"):
        assert not [w for w in said(caplog, logger, logging.WARNING) if "a round on the store failed" in w]
    assert not a.waits() or max(a.waits()) < 0.2, a.waits()
    assert not s.waits(), s.waits()
