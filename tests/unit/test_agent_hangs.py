"""A service that hangs until complete-by (AGT3, AGT4): the agent sends nothing back, and the
call still counts as a failure of the service, so repeated hangs open the circuit breaker and the
next requests fail fast instead of each holding a slot for its whole budget.

Agent deadlines are real time, so the budgets here are short (0.2 s) and the store on the real
clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from test_agent_role import ME, dispatch, finish, kinds, replies, request_states, until

from stepwarden.agent import Agent, AgentRole, Request
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
    rt_store: Store, make_workflow: Factory
) -> None:
    dispatch(rt_store, make_workflow, n=2, budget=0.2, tries=1)
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
        dispatch(rt_store, make_workflow, n=2, budget=0.2, tries=1)
        assert await role.pull() == 0
        assert len(calls) == 2

    asyncio.run(body())
    assert request_states(rt_store) == ["taken", "taken", "queued", "queued"]


def test_one_hang_counts_as_one_failure_of_the_instance_and_the_breaker(
    rt_store: Store, make_workflow: Factory
) -> None:
    """Below the threshold the breaker stays closed, with the hang counted: the next failure in a
    row opens it; and operators see the instance's failure in the store."""
    dispatch(rt_store, make_workflow, n=1, budget=0.2, tries=1)
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
