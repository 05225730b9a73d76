"""Each store's own id (schema 8): what tells one store's task 1 from another's, in the global
idempotency key that agents may send to a service several stores call (REL2) and in trace ids."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepwarden.agent import Agent, AgentRole, Request
from stepwarden.clock import FakeClock
from stepwarden.errors import StoreError
from stepwarden.store import Store, open_store
from stepwarden.store import transitions as t
from stepwarden.workflow import Workflow, encode_input


def another_store_url(store_url: str, tmp_path: Path, request: pytest.FixtureRequest, n: int) -> str:
    """A store made from nothing, as a second deployment's would be (not a copy of this one)."""
    if store_url.startswith("sqlite"):
        return f"sqlite:///{tmp_path / f'other-{n}.db'}"
    return str(request.getfixturevalue("make_pg_db")(empty=True))


def identity(url: str) -> str:
    s = open_store(url)
    try:
        return asyncio.run(s.identity())
    finally:
        s.close()


def test_each_store_made_has_its_own_id_which_stays(
    store_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ids = [identity(another_store_url(store_url, tmp_path, request, n)) for n in range(3)]
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids), ids
    assert len(set(ids)) == 3, "two stores made apart share an id"
    first = another_store_url(store_url, tmp_path, request, 0) if store_url.startswith("sqlite") else None
    if first is not None:  # the same file opened again (and migrated again: nothing to do)
        assert identity(first) == ids[0]
    mine = identity(store_url)
    assert identity(store_url) == mine, "reopening a store changed its id"


def test_the_id_is_one_row_that_a_second_cannot_join(store: Store) -> None:
    def add(tx: Any) -> None:
        tx.sql("INSERT INTO store_identity (one, id) VALUES (2, 'ffffffffffffffff')")

    with pytest.raises(Exception, match=r"(?i)check|constraint"):
        store.transact_sync(add)
    assert len(store.transact_sync(lambda tx: tx.sql("SELECT id FROM store_identity"))) == 1


def test_a_store_whose_identity_row_was_deleted_says_so(store_url: str) -> None:
    s = open_store(store_url)
    try:
        s.transact_sync(lambda tx: tx.sql("DELETE FROM store_identity"))
        with pytest.raises(StoreError, match="no identity"):
            asyncio.run(s.identity())
    finally:
        s.close()


def test_a_request_carries_the_store_id_and_a_global_key(
    store_url: str, tmp_path: Path, request: pytest.FixtureRequest, make_workflow: Callable[..., Workflow]
) -> None:
    """Two stores, each with its task 1 and step ``s``: the same ``idempotency_key`` (``1:s``),
    as SPEC's key format gives, but different global keys, so a service both call applies both."""
    keys: list[tuple[str, str, str]] = []
    agent = Agent("svc")

    @agent.operation
    async def do_s(req: Request) -> None:
        keys.append((req.store_id, req.idempotency_key, req.global_idempotency_key))

    for n in range(2):
        clock = FakeClock()
        store = open_store(another_store_url(store_url, tmp_path, request, n), clock=clock)
        try:
            wf = make_workflow("s", budget=60.0, compensate=False)
            task_id, _ = store.transact_sync(
                t.submit,
                wf,
                encode_input({}),
                correlation_id=None,
                idempotency_key=None,
                priority=0,
                reply_to=None,
            )
            assert task_id == 1

            async def body(store: Store, clock: FakeClock) -> None:
                role = AgentRole(store, {"svc": agent}, "agent:1:abcdef", clock=clock)
                assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 1
                assert await role.pull() == 1
                await asyncio.wait(set(role.tasks), timeout=5)

            asyncio.run(body(store, clock))
            assert keys[-1][0] == identity(store.url)
        finally:
            store.close()
    (a_id, a_key, a_global), (b_id, b_key, b_global) = keys
    assert a_key == b_key == "1:s"
    assert a_global == f"{a_id}:1:s" and b_global == f"{b_id}:1:s" and a_global != b_global


def test_a_request_made_by_hand_keeps_its_key() -> None:
    """A handler's own unit test builds a Request without a store: the global key is the key."""
    req = Request(1, "s", 1, "do", "1:s", {}, {}, None, 0.0, 0.0)
    assert req.global_idempotency_key == "1:s"


def test_a_worker_gives_every_request_the_store_id_however_it_was_taken(store_url: str) -> None:
    """In one worker that schedules and runs agents, requests mostly reach the agent role through
    the scheduler's own take (its reservation), not a pull: each must carry the id all the same."""
    from stepwarden import App, Step

    app = App(store_url)
    ops = app.agent("ops")
    seen: list[str] = []

    @ops.operation
    async def noop(req: Request) -> None:
        seen.append(req.global_idempotency_key)

    app.workflow("two", [Step("a", "ops.noop", complete_by=10), Step("b", "ops.noop", complete_by=10)])

    async def body() -> None:
        stop = asyncio.Event()
        worker = app.worker(name="ident")
        run = asyncio.create_task(worker.run(stop))
        try:
            ids = [await app.submit_async("two", {"n": n}) for n in range(5)]
            end = asyncio.get_running_loop().time() + 20
            while any(app.task(i)["state"] != "processed" for i in ids):
                assert asyncio.get_running_loop().time() < end, "tasks not processed in time"
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            await asyncio.wait_for(run, 30)

    try:
        asyncio.run(body())
        store_id = asyncio.run(app.store.identity())
    finally:
        app.close()
    assert len(seen) == 10 and all(k.startswith(f"{store_id}:") for k in seen), seen
