"""An operation's failure is replied whatever its exception does when it is described (AGT5).

An exception whose ``__str__`` or ``__repr__`` raises (a bug in an exception class, a message
built from a closed resource) used to end its attempt with no reply at all: describing it raised,
the error escaped to the role's catch-all, and the request stayed taken until complete-by, its
permanent failure retried at every attempt. Each test pulls one request, waits for its call to
end, and reads the reply the store holds.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_agent_calls import run_requests
from test_agent_role import Dispatch, replies, request_states

from stepwarden.agent import Agent, Request
from stepwarden.errors import Transient
from stepwarden.store import Store


class Unreadable(Exception):
    """An exception whose text cannot be read."""

    def __str__(self) -> str:
        raise RuntimeError("the text needs a connection that is closed")


class UnreadableTransient(Transient):
    def __str__(self) -> str:
        raise RuntimeError("broken")


class NoRepr(Exception):
    """An exception whose repr raises (its text is fine)."""

    def __repr__(self) -> str:
        raise RuntimeError("broken repr")


class BadAnswer:
    """What a buggy classify returns: neither "transient" nor "permanent", and no repr either."""

    def __repr__(self) -> str:
        raise RuntimeError("broken repr")


def _fails_with(agent: Agent, error: BaseException, plain: bool) -> None:
    if plain:

        def do_s(req: Request) -> None:
            raise error

        agent.operation(do_s)
    else:

        async def do_s_async(req: Request) -> None:
            raise error

        agent.operation(do_s_async, name="do_s")


@pytest.mark.parametrize("plain", [False, True], ids=["async", "plain"])
def test_a_failure_whose_text_cannot_be_read_is_replied_as_an_error_at_once(
    rt_store: Store, dispatch_requests: Dispatch, plain: bool
) -> None:
    dispatch_requests(rt_store, tries=4)
    agent = Agent("svc")
    _fails_with(agent, Unreadable(), plain)
    run_requests(rt_store, agent)
    assert [(r["outcome"], r["error"]) for r in replies(rt_store)] == [
        ("error", "Unreadable: <its text could not be read: RuntimeError in Unreadable.__str__>")
    ]
    assert request_states(rt_store) == ["replied"]


def test_a_transient_failure_whose_text_cannot_be_read_is_retried_then_replied(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(rt_store, tries=2)
    agent = Agent("svc")
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        calls.append(1)
        raise UnreadableTransient()

    run_requests(rt_store, agent)
    assert calls == [1, 1]  # still transient: tried again inside the attempt
    assert [(r["outcome"], r["error"]) for r in replies(rt_store)] == [
        ("retry", "transient: <its text could not be read: RuntimeError in UnreadableTransient.__str__>")
    ]


@pytest.mark.parametrize("plain", [False, True], ids=["async", "plain"])
def test_a_failure_whose_repr_raises_is_replied_with_its_text(
    rt_store: Store, dispatch_requests: Dispatch, plain: bool
) -> None:
    dispatch_requests(rt_store, tries=4)
    agent = Agent("svc")
    _fails_with(agent, NoRepr("card declined"), plain)
    run_requests(rt_store, agent)
    assert [(r["outcome"], r["error"]) for r in replies(rt_store)] == [("error", "NoRepr: card declined")]


def raises_unreadable(exc: BaseException) -> str:
    raise Unreadable()


def answers_unreadable(exc: BaseException) -> Any:
    return BadAnswer()


@pytest.mark.parametrize(
    ("classify", "says"),
    [
        (
            raises_unreadable,
            "classify raised Unreadable: <its text could not be read: RuntimeError in Unreadable.__str__>",
        ),
        (
            answers_unreadable,
            "classify returned <a BadAnswer whose repr raised RuntimeError>, not 'transient' or 'permanent'",
        ),
    ],
    ids=["raises", "bad-value"],
)
def test_a_classify_whose_failure_cannot_be_read_still_makes_the_failure_permanent(
    rt_store: Store, dispatch_requests: Dispatch, classify: Any, says: str
) -> None:
    dispatch_requests(rt_store, tries=4)
    agent = Agent("svc", classify=classify)

    @agent.operation
    async def do_s(req: Request) -> None:
        raise ValueError("boom")

    run_requests(rt_store, agent)
    assert [(r["outcome"], r["error"]) for r in replies(rt_store)] == [
        ("error", f"{says} (judging ValueError: boom)")
    ]
