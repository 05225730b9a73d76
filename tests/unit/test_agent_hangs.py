"""A service that hangs until complete-by (AGT3, AGT4): the agent sends nothing back, and the
call still counts as a failure of the service, so repeated hangs open the circuit breaker and the
next requests fail fast instead of each holding a slot for its whole budget.

Agent deadlines are real time, so the budgets here are short (0.2 s) and the store on the real
clock."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from test_agent_role import ME, Dispatch, finish, kinds, replies, request_states, until

from stepwarden.agent import Agent, AgentRole, Request
from stepwarden.errors import Transient
from stepwarden.store import Store
from stepwarden.workflow import Workflow

Factory = Callable[..., Workflow]


def breaker_row(store: Store) -> dict[str, Any]:
    [row] = store.transact_sync(lambda tx: tx.sql("SELECT state, failures, opens FROM agent_breakers"))
    return dict(row)


def instance_row(store: Store) -> dict[str, Any]:
    [row] = store.transact_sync(
        lambda tx: tx.sql(
            "SELECT failures, failures_total, healthy FROM agent_instances WHERE worker = ?", (ME,)
        )
    )
    return dict(row)


def hanging(agent: Agent, calls: list[str]) -> None:
    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(req.idempotency_key)
        await asyncio.Event().wait()  # the remote service never answers
        return "never"


def test_hangs_to_complete_by_open_the_breaker_and_later_requests_fail_fast(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(rt_store, n=2, budget=0.2, tries=1)
    agent = Agent("svc", breaker_threshold=2, breaker_cool_off=60.0)
    calls: list[str] = []
    hanging(agent, calls)

    async def body() -> None:
        role = AgentRole(rt_store, {"svc": agent}, ME)
        assert await role.pull() == 2
        await finish(role, timeout=3.0)
        assert len(calls) == 2
        assert replies(rt_store) == []  # AGT4: nothing sent back at complete-by
        await until(lambda: role.breakers["svc"].state == "open", timeout=3.0)
        assert breaker_row(rt_store)["state"] == "open" and breaker_row(rt_store)["opens"] == 1
        await until(lambda: "breaker_opened" in kinds(rt_store), timeout=3.0)
        # the breaker is shared through the store: the next requests are not pulled, so no call
        # hangs on the service again for a whole budget
        dispatch_requests(rt_store, n=2, budget=0.2, tries=1)
        assert await role.pull() == 0
        assert len(calls) == 2

    asyncio.run(body())
    assert request_states(rt_store) == ["taken", "taken", "queued", "queued"]


def test_one_hang_counts_as_one_failure_of_the_instance_and_the_breaker(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """Below the threshold the breaker stays closed, with the hang counted: the next failure in a
    row opens it; and operators see the instance's failure in the store."""
    dispatch_requests(rt_store, n=1, budget=0.2, tries=1)
    agent = Agent("svc", breaker_threshold=3, breaker_cool_off=60.0)
    calls: list[str] = []
    hanging(agent, calls)

    async def body() -> None:
        role = AgentRole(rt_store, {"svc": agent}, ME)
        assert await role.pull() == 1
        await finish(role, timeout=3.0)
        await until(lambda: instance_row(rt_store)["failures_total"] == 1, timeout=3.0)

    asyncio.run(body())
    assert breaker_row(rt_store) == {"state": "closed", "failures": 1, "opens": 0}
    assert instance_row(rt_store)["failures"] == 1
    assert replies(rt_store) == []


def test_a_trial_call_that_hangs_reopens_the_breaker_once_and_sends_nothing(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """After the cool-off one instance makes the half-open trial; the service hangs on it too. At
    complete-by the trial is cancelled, nothing is sent, and the breaker opens again, counted once
    (the hang's failure gives the trial's verdict; the end of the trial adds no second one)."""
    agent = Agent("svc", breaker_threshold=1, breaker_cool_off=0.3)
    calls: list[str] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(req.idempotency_key)
        if len(calls) == 1:
            raise Transient("down")
        await asyncio.Event().wait()  # the trial hangs
        return "never"

    async def body() -> None:
        role = AgentRole(rt_store, {"svc": agent}, ME)
        dispatch_requests(rt_store, n=1, budget=5.0, tries=1)
        assert await role.pull() == 1
        await finish(role)
        await until(lambda: breaker_row(rt_store)["opens"] == 1, timeout=3.0)
        # the cool-off over first: a request dispatched before it would have run out of budget
        await until(lambda: time.monotonic() >= role.breakers["svc"].retry_at, timeout=3.0)
        dispatch_requests(rt_store, n=1, budget=0.3, tries=1)
        assert await role.pull() == 1  # this instance wins the half-open trial
        await finish(role, timeout=3.0)
        assert len(calls) == 2
        await until(lambda: "breaker_reopened" in kinds(rt_store), timeout=3.0)

    asyncio.run(body())
    assert breaker_row(rt_store)["state"] == "open"
    assert [k for k in kinds(rt_store) if k.startswith("breaker_")] == [
        "breaker_opened",
        "breaker_trial",
        "breaker_reopened",
    ]
    assert [r["outcome"] for r in replies(rt_store)] == ["retry"]  # the trial sent nothing
    assert request_states(rt_store) == ["replied", "taken"]
