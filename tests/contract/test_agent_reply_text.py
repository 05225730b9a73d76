"""Error text from an operation reaches the store whatever it holds, and one reply the database
refuses cannot take the other replies of its batch down with it (both stores).

PostgreSQL refuses a NUL character in text (UntranslatableCharacter); a ``Permanent("bad \\x00
byte")`` once made the whole batch of replies fail on every try, so the good replies in it were
dropped too, and their attempts expired."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from stepwarden.agent import Agent, AgentRole, AgentSettings, Request
from stepwarden.errors import Permanent
from stepwarden.store import Store
from stepwarden.store import transitions as t

Dispatch = Callable[..., list[int]]  # the dispatch_requests fixture (tests/conftest.py)
Rows = Callable[[Store, str], list[dict[str, Any]]]  # the rows fixture (tests/conftest.py)

ME = "agent-1:1:abc"


@pytest.mark.parametrize("apply", [False, True], ids=["recorded", "applied"])
def test_a_nul_byte_in_an_error_is_stored_escaped_and_the_batch_goes_through(
    store: Store, dispatch_requests: Dispatch, rows: Rows, apply: bool
) -> None:
    dispatch_requests(store, 3, budget=30.0)
    agent = Agent("svc", concurrency=3)

    @agent.operation
    async def do_s(req: Request) -> str:
        if req.input["n"] == 0:
            raise Permanent("bad \x00 byte")
        if req.input["n"] == 1:
            raise ValueError("also \x00 here")
        return "fine"

    async def body() -> None:
        # a long linger: the three replies go in one batch
        settings = AgentSettings(apply_replies=apply, reply_linger=1.0)
        role = AgentRole(store, {"svc": agent}, ME, settings=settings)
        assert await role.pull() == 3
        _, pending = await asyncio.wait(set(role.tasks), timeout=10)
        assert not pending
        assert role.batches == 1

    asyncio.run(body())
    got = rows(store, "SELECT outcome, result, error FROM replies ORDER BY request_id")
    assert [(r["outcome"], r["result"], r["error"]) for r in got] == [
        ("error", None, "bad \\x00 byte"),
        ("error", None, "ValueError: also \\x00 here"),
        ("ok", '"fine"', None),
    ]
    if not apply:
        store.transact_sync(t.apply_replies, "sched", 10, random.Random(0))
    tasks = rows(store, "SELECT state, last_error FROM tasks ORDER BY id")
    assert [(r["state"], r["last_error"]) for r in tasks][2] == ("processed", None)
    assert "bad \\x00 byte" in tasks[0]["last_error"]
