"""A reply batch waits briefly (``AgentSettings.reply_linger``) for the calls still running, so
that slots refilled at different moments answer in one transaction instead of drifting into
groups that each pay a commit per cycle. A call slower than the linger is not waited for."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from test_agent_role import CountingTakes, Dispatch, make_role, run, until

from stepwarden.agent import Agent, AgentSettings, Request
from stepwarden.errors import InputError
from stepwarden.store import Store


def _staggered_agent(late: dict[int, int]) -> tuple[Agent, list[int]]:
    """Agent ``svc`` (4 slots) whose call returns at once, or, for a task in ``late``, after that
    many turns of the event loop: a moment later, as when slots were refilled apart."""
    agent = Agent("svc", concurrency=4)
    ran: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        if req.task_id in late:
            for _ in range(late[req.task_id]):
                await asyncio.sleep(0)
        ran.append(req.task_id)

    return agent, ran


def _gated_agent(concurrency: int, gated: int, gate: asyncio.Event) -> tuple[Agent, list[int]]:
    """Agent ``svc`` whose call for task ``gated`` waits for ``gate``; the others return at once.
    ``ran`` lists the tasks whose call has returned."""
    agent = Agent("svc", concurrency=concurrency)
    ran: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        if req.task_id == gated:
            await gate.wait()  # would never end if a batch waited for it
        ran.append(req.task_id)

    return agent, ran


@pytest.mark.parametrize("linger", [1.0, 0.0])
def test_calls_that_answer_a_moment_later_share_the_batch(
    rt_store: Store, dispatch_requests: Dispatch, linger: float
) -> None:
    """Two calls answer at once, one a few loop turns later and one a few more. With a linger,
    the first batch waits for both, not just the next, and carries all four replies; without one
    (0), the first two go alone."""
    ids = dispatch_requests(rt_store, 4, tries=4)
    agent, ran = _staggered_agent({ids[2]: 20, ids[3]: 40})
    spy = CountingTakes(rt_store)
    took: list[float] = []

    async def body() -> None:
        settings = AgentSettings(apply_replies=True, reply_linger=linger)
        role = make_role(spy, agent, settings=settings)  # type: ignore[arg-type]
        assert await role.pull() == 4
        started = time.monotonic()
        await until(lambda: len(ran) == 4 and not role.tasks and not role._outbox, timeout=10)
        took.append(time.monotonic() - started)
        assert not role._young
        assert (role.completed, role.batches) == (4, len(spy.batches))

    run(body())
    sizes = [sent for sent, *_ in spy.batches]
    assert sum(sizes) == 4
    if linger:
        assert sizes == [4], spy.batches
        assert took[0] < 0.5  # woken when the last call answered, not at the linger's end
    else:  # the two that answered at once go alone; the others follow as their commits allow
        assert sizes[0] == 2 and len(sizes) > 1, spy.batches


def test_a_call_slower_than_the_linger_is_not_waited_for(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """One call answers at once, the other only after the first batch has committed: the batch
    goes out once the linger has passed, with the one reply, and the slow call's reply follows
    in a batch of its own."""
    ids = dispatch_requests(rt_store, 2, tries=4)
    first_committed = asyncio.Event()
    agent, ran = _gated_agent(2, ids[1], first_committed)

    class Spy(CountingTakes):
        async def send_replies_and_take(self, me: str, replies: Any, take: Any, apply: bool = True) -> Any:
            out = await super().send_replies_and_take(me, replies, take, apply)
            first_committed.set()
            return out

    spy = Spy(rt_store)

    async def body() -> None:
        settings = AgentSettings(apply_replies=True, reply_linger=0.05)
        role = make_role(spy, agent, settings=settings)  # type: ignore[arg-type]
        assert await role.pull() == 2
        await until(lambda: len(ran) == 2 and not role.tasks and not role._outbox, timeout=10)

    run(body())
    assert ran == ids
    assert [sent for sent, *_ in spy.batches] == [1, 1]


def test_a_slow_call_delays_one_batch_not_every_batch(rt_store: Store, dispatch_requests: Dispatch) -> None:
    """One slot holds a call that runs for the whole test while the other three serve 30 quick
    ones, about ten batches: the first batch lingers for it, the later ones do not (they wait
    only for calls started since the batch before), so the 30 take far less than ten lingers."""
    ids = dispatch_requests(rt_store, 31, tries=4)
    release = asyncio.Event()
    agent, ran = _gated_agent(4, ids[0], release)

    spy = CountingTakes(rt_store)
    took: list[float] = []

    async def body() -> None:
        settings = AgentSettings(apply_replies=True, reply_linger=0.2)
        role = make_role(spy, agent, settings=settings)  # type: ignore[arg-type]
        started = time.monotonic()
        assert await role.pull() == 4
        await until(lambda: len(ran) == 30, timeout=20)
        took.append(time.monotonic() - started)
        release.set()
        await until(lambda: len(ran) == 31 and not role.tasks and not role._outbox, timeout=10)
        assert not role._young

    run(body())
    assert sorted(ran) == ids
    assert len(spy.batches) >= 9, spy.batches  # ten lingers would be 2 s
    assert took[0] < 1.2, (took, spy.batches)


@pytest.mark.parametrize("linger", [-0.001, 1.5])
def test_a_linger_out_of_range_is_refused(linger: float) -> None:
    with pytest.raises(InputError, match="reply_linger must be between 0 and 1 s"):
        AgentSettings(reply_linger=linger)


def test_the_linger_ends_when_the_agent_stops(rt_store: Store, dispatch_requests: Dispatch) -> None:
    """A stopping agent sends the replies it has at once, without lingering for a call that may
    not answer before the grace period ends."""
    ids = dispatch_requests(rt_store, 2, tries=4)
    release = asyncio.Event()
    agent, ran = _gated_agent(2, ids[1], release)

    spy = CountingTakes(rt_store)

    async def body() -> None:
        settings = AgentSettings(apply_replies=True, reply_linger=1.0, shutdown_grace=30.0)
        role = make_role(spy, agent, settings=settings)  # type: ignore[arg-type]
        assert await role.pull() == 2
        await until(lambda: len(ran) == 1 and len(role._outbox) == 1, timeout=10)
        await asyncio.sleep(0.05)
        assert spy.batches == []  # lingering for the second call
        drain = asyncio.create_task(role.drain())
        await until(lambda: len(spy.batches) == 1, timeout=0.8)  # before the linger would end
        assert spy.batches[0][:2] == (1, 0)  # one reply; a stopping agent takes nothing more
        release.set()
        await asyncio.wait_for(drain, 10)

    run(body())
    assert sorted(ran) == ids
    assert [sent for sent, *_ in spy.batches] == [1, 1]
