"""A reply the store fails to take is tried again until its request's complete-by, and never
after it (AGT4, REL3); a stop hands back only the attempts still in time.

The sender's back-off runs on the role's clock: these tests give the role a fake clock that
records every sleep as it begins (:class:`Sleeps`) and move it by exactly that sleep
(:func:`drive`), so an outage of many seconds takes milliseconds and no test waits on a guess.
The store itself is on the real clock (its complete-by is a few seconds of real time away and
never reached), the operations answer at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from test_agent_role import Dispatch, LostCommits, finish, make_role, replies, request_states, until

from stepwarden.agent import Agent, AgentSettings, Request
from stepwarden.clock import FakeClock
from stepwarden.store import Store


class Sleeps(FakeClock):
    """A fake clock that records each sleep as it begins, for :func:`drive` to end: ``slept``
    holds them all, ``advanced`` how many of them the clock has been moved by."""

    def __init__(self) -> None:
        super().__init__()
        self.slept: list[float] = []
        self.advanced = 0

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        await super().sleep(seconds)


async def drive(clock: Sleeps, done: Callable[[], bool], timeout: float = 5.0) -> None:
    """Until ``done()``: whenever a sleep on ``clock`` begins, advance the clock by that sleep,
    and by nothing else (fake time passes only while something waits on it). Fails after
    ``timeout`` seconds of real time."""
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, f"condition not met in time; last sleeps: {clock.slept[-20:]}"
        if len(clock.slept) > clock.advanced:
            clock.advance(max(0.0, clock.slept[clock.advanced]))
            clock.advanced += 1
        await asyncio.sleep(0.001)


def at_once() -> Agent:
    agent = Agent("svc", concurrency=4)

    @agent.operation
    async def do_s(req: Request) -> dict[str, int]:
        return {"n": int(req.input["n"])}

    return agent


def test_a_reply_whose_send_failed_is_not_sent_after_complete_by(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """The call answered in time; the reply's transaction lost its connection; complete-by
    passes while the sender waits to try again. The agent sends nothing past complete-by (AGT4):
    the attempt is the supervisor's. (It used to try again regardless: the auditor's reply was
    received 0.1 s after complete-by.)"""
    dispatch_requests(rt_store, 1, budget=10.0)
    clock = Sleeps()
    lossy = LostCommits(rt_store, "send_replies", fail=1)  # only the first try is lost

    async def body() -> None:
        role = make_role(lossy, at_once(), clock=clock)  # type: ignore[arg-type]
        assert await role.pull() == 1
        await until(lambda: lossy.calls == 1 and bool(clock.slept))  # failed; waiting to try again
        clock.advance(11.0)  # complete-by (10 s from the pull) passes during that wait
        await finish(role)
        assert lossy.calls == 1, "a reply was sent after its complete-by"

    asyncio.run(body())
    assert replies(rt_store) == []
    assert request_states(rt_store) == ["taken"]  # for the supervisor to rescue


def test_a_reply_is_tried_until_the_store_answers_within_complete_by(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """The store is unreachable for eight tries (about 6 s of the 10 s budget): the reply of a
    call that ran goes through when it is back, and the attempt completes. (It used to be given
    up after 5 tries, ~2 s, and the attempt then waited out complete-by and counted as failed.)"""
    dispatch_requests(rt_store, 1, budget=10.0)
    clock = Sleeps()
    lossy = LostCommits(rt_store, "send_replies", fail=8)

    async def body() -> None:
        role = make_role(lossy, at_once(), clock=clock)  # type: ignore[arg-type]
        assert await role.pull() == 1
        await drive(clock, lambda: not role.tasks)
        assert lossy.calls == 9  # eight lost, the ninth committed
        assert clock.monotonic() - 1000.0 < 10.0  # within complete-by, on the role's clock
        assert max(clock.slept) <= 1.2  # capped back-off: the store is tried at least every 1.2 s

    asyncio.run(body())
    assert [(r["outcome"], r["result"]) for r in replies(rt_store)] == [("ok", '{"n":0}')]
    assert request_states(rt_store) == ["replied"]


def test_a_reply_whose_failed_try_waited_long_for_the_store_is_still_sent_when_it_is_back(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """Found by review on PostgreSQL: a 5.6 s outage, complete-by 10 s. The failed try had waited
    5 s for a connection (the pool's timeout), and the next try was asked for as much time to
    spare: with 4.7 s still left once the server was back, the reply was dropped ("complete-by
    passed"), and the step ran a second time. A try that failed for want of the store needs what
    a try took when the store answered, not its own wait."""
    dispatch_requests(rt_store, 1, budget=10.0)
    clock = Sleeps()

    def waits_for_a_connection(*args: Any, **kw: Any) -> bool:
        clock.advance(5.0)  # this try waited out the pool's timeout, then failed
        return True

    lossy = LostCommits(rt_store, "send_replies", fail=1, when=waits_for_a_connection)

    async def body() -> None:
        role = make_role(lossy, at_once(), clock=clock)  # type: ignore[arg-type]
        assert await role.pull() == 1
        await drive(clock, lambda: not role.tasks)
        assert lossy.calls == 2  # the one that waited and failed, then the one that went through

    asyncio.run(body())
    assert [(r["outcome"], r["result"]) for r in replies(rt_store)] == [("ok", '{"n":0}')]
    assert request_states(rt_store) == ["replied"]


def test_a_batch_drops_the_replies_past_complete_by_and_keeps_trying_the_others(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """Two replies in one batch, complete-by 2 s and 30 s, while the store is down for about
    3.5 s: each reply is tried until its own complete-by. The first is dropped once its time is
    up, and only the second goes through."""
    dispatch_requests(rt_store, 1, budget=2.0)
    (long,) = dispatch_requests(rt_store, 1, budget=30.0)
    clock = Sleeps()
    sizes: list[tuple[float, int]] = []  # (role's clock, replies) of every reply transaction

    def record(me: str, items: Any, **kw: Any) -> bool:
        sizes.append((clock.monotonic(), len(items)))
        return True

    lossy = LostCommits(rt_store, "send_replies", fail=6, when=record)

    async def body() -> None:
        role = make_role(lossy, at_once(), clock=clock, settings=AgentSettings(reply_linger=1.0))  # type: ignore[arg-type]
        assert await role.pull() == 2
        await drive(clock, lambda: not role.tasks)

    asyncio.run(body())
    assert [(r["task_id"], r["outcome"]) for r in replies(rt_store)] == [(long, "ok")]
    assert request_states(rt_store) == ["taken", "replied"]
    assert sizes[0][1] == 2 and sizes[-1][1] == 1, sizes
    # never sent with the first reply once its 2 s were up
    assert all(n == 1 for at, n in sizes if at - 1000.0 >= 2.0), sizes


def test_a_stop_with_the_store_down_gives_up_the_replies_within_its_bound(
    rt_store: Store,
    dispatch_requests: Dispatch,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A reply may be tried for as long as its complete-by (here a minute): a stop does not wait
    that long. The sender stops trying at the stop's bound for replies (REPLIES_WAIT), the role
    returns, and the attempt is left taken, to expire: its call ran, so it is not released as if
    it never had. (A regression guard: the old sender gave up after 5 tries anyway.)"""
    monkeypatch.setattr("stepwarden.agent_role.REPLIES_WAIT", 0.3)
    dispatch_requests(rt_store, 1, budget=60.0)
    lossy = LostCommits(rt_store, "send_replies", fail=10**6)

    async def body() -> None:
        stop = asyncio.Event()
        settings = AgentSettings(shutdown_grace=0.1, poll_interval=0.01)
        role = make_role(lossy, at_once(), settings=settings)  # type: ignore[arg-type]
        running = asyncio.create_task(role.run(stop))
        await until(lambda: lossy.calls >= 1, timeout=5)
        stop.set()
        began = time.monotonic()
        await asyncio.wait_for(running, 10)
        assert time.monotonic() - began < 3.0  # grace 0.1 + cancel + replies 0.3 + stop record
        sender = role._sender
        assert sender is not None
        await until(lambda: sender.done(), timeout=3)  # and it stopped trying: no more than a back-off later

    asyncio.run(body())
    assert replies(rt_store) == []
    assert request_states(rt_store) == ["taken"]
    assert "the agent stopped before the store took them" in caplog.text


def test_a_stop_does_not_release_an_attempt_past_its_complete_by(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """A call that ended silent at complete-by, whose end still waits for its health report when
    the stop comes: past complete-by the agent sends nothing, not even a release (AGT4; it used
    to hand the attempt back, uncounted, after its complete-by)."""
    dispatch_requests(rt_store, 1, budget=0.3)
    agent = Agent("svc", concurrency=1)

    @agent.operation
    async def do_s(req: Request) -> None:
        await asyncio.sleep(30)  # hangs past complete-by: cancelled there, nothing sent

    async def body() -> None:
        stop = asyncio.Event()
        role = make_role(rt_store, agent, settings=AgentSettings(shutdown_grace=0.1, poll_interval=0.01))
        held = asyncio.Event()

        def slow_report(agent: str, ok: bool, error: str | None = None, trial: bool = False) -> Any:
            async def report() -> None:
                held.set()
                await asyncio.sleep(30)  # a store slow to count the failure

            return asyncio.create_task(report())

        role.health.report_soon = slow_report  # type: ignore[method-assign]
        running = asyncio.create_task(role.run(stop))
        await asyncio.wait_for(held.wait(), 5)  # the call ended silent at complete-by
        assert role.tasks, "the call's end should still wait for its report"
        stop.set()
        await asyncio.wait_for(running, 5)

    asyncio.run(body())
    assert replies(rt_store) == []
    assert request_states(rt_store) == ["taken"]  # the supervisor's, as any expired attempt
