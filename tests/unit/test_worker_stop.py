"""A worker stopped while its own scheduler round is in flight (DEP4, AGT6).

The round reserved slots for the worker's agent before the stop; its transaction commits after
it. The agent's drain waits for it within the grace period and runs what it brought; past the
grace, what it brought is left taken for a rescue, never started on a drained agent (a plain
function would fail on the closed thread pool and end its task in error).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from stepwarden import App
from stepwarden.agent import AgentSettings
from stepwarden.errors import InputError
from stepwarden.worker import WorkerSettings
from stepwarden.workflow import Step

pytestmark = pytest.mark.timeout(60)


def make_app(tmp_path: Path, plain: bool) -> App:
    app = App(f"sqlite:///{tmp_path / 'w.db'}")
    svc = app.agent("svc", concurrency=2)

    def plain_op(req: Any) -> str:  # a plain function: runs in the agent's thread pool
        return "done"

    async def async_op(req: Any) -> str:
        return "done"

    svc.operation(plain_op if plain else async_op, name="do_a")
    app.workflow("wf", [Step("a", "svc.do_a", complete_by=30.0)])
    return app


async def until(pred: Callable[[], bool], timeout: float) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < end, "condition not met in time"
        await asyncio.sleep(0.005)


async def stop_during_round(app: App, grace: float, open_gate: str) -> int:
    """Hold the worker's first round that reserves agent slots, stop the worker, then let the
    round commit: ``open_gate`` "during" the drain, or "after" the drain has returned."""
    worker = app.worker(
        WorkerSettings(roles=("scheduler", "agent"), agent=AgentSettings(shutdown_grace=grace))
    )
    store = app.store
    through = store.schedule_and_take
    gate, held = asyncio.Event(), asyncio.Event()

    async def gated(me: str, limit: int, take: Any) -> Any:
        if take and not gate.is_set():
            held.set()
            await gate.wait()
        return await through(me, limit, take)

    store.schedule_and_take = gated  # type: ignore[method-assign]
    stop = asyncio.Event()
    run = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(held.wait(), 10)
    task_id = await app.submit_async("wf", {"x": 1})  # the held round is the one that claims it
    stop.set()  # SIGTERM while the round is in flight
    role = worker.agent_role
    assert role is not None
    if open_gate == "during":
        await until(lambda: role._stopping, 10)  # the drain has begun
        await asyncio.sleep(0.3)
        assert not role._drained, "the drain must wait for the round's reservation"
    else:
        await until(lambda: role._drained, 10)
    gate.set()
    await asyncio.wait_for(run, 30)
    return task_id


def rows(app: App, sql: str) -> list[dict[str, Any]]:
    return app.store.transact_sync(lambda tx: tx.sql(sql))


@pytest.mark.parametrize("plain", [False, True], ids=["async", "plain"])
def test_a_round_in_flight_at_the_stop_is_waited_for_and_its_requests_run(
    tmp_path: Path, plain: bool
) -> None:
    app = make_app(tmp_path, plain)
    # a long grace costs nothing: the drain ends as soon as the round's work is done
    task_id = asyncio.run(stop_during_round(app, grace=20.0, open_gate="during"))
    assert [(r["outcome"], r["error"]) for r in rows(app, "SELECT outcome, error FROM replies")] == [
        ("ok", None)
    ]
    assert app.task(task_id)["state"] == "processed"


@pytest.mark.parametrize("plain", [False, True], ids=["async", "plain"])
def test_requests_a_round_brings_after_the_drain_are_not_started(
    tmp_path: Path, plain: bool, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(tmp_path, plain)
    with caplog.at_level(logging.WARNING, logger="stepwarden.agent"):
        task_id = asyncio.run(stop_during_round(app, grace=0.2, open_gate="after"))
    assert rows(app, "SELECT outcome FROM replies") == []  # no error from a closed thread pool
    assert [r["state"] for r in rows(app, "SELECT state FROM requests")] == ["taken"]  # for a rescue
    assert app.task(task_id)["state"] == "processing"
    assert "taken after the stop, not started" in caplog.text


def test_a_role_or_agent_named_twice_counts_once() -> None:
    """``--roles scheduler,scheduler`` is a slip, not two schedulers: the heartbeat, the start
    line and the dashboard list each role and agent once, in the order given."""
    s = WorkerSettings(roles=("scheduler", "agent", "scheduler"), agents=("b", "a", "b"))
    assert s.roles == ("scheduler", "agent")
    assert s.agents == ("b", "a")
    with pytest.raises(InputError, match="unknown role"):
        WorkerSettings(roles=("scheduler", "schedular", "scheduler"))


class FlakyBeats:
    """The app's store, its heartbeat refused (connection refused) while ``down``; counts both."""

    def __init__(self, app: App) -> None:
        self.real = app.store.worker_beat
        self.down = True
        self.failed = 0
        self.ok = 0
        app.store.worker_beat = self.beat  # type: ignore[method-assign]

    async def beat(self, *args: Any, **kw: Any) -> Any:
        if self.down:
            self.failed += 1
            raise ConnectionError("connection refused")
        self.ok += 1
        return await self.real(*args, **kw)


def test_heartbeats_through_an_outage_log_it_twice_not_each_beat(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """REL3: a worker logged a warning at every failed heartbeat (one a second; 45 in one outage
    behind a pooler that answers at once). Now one warning when they begin to fail and one line
    when one goes through, as the roles' loops log an outage; it still beats at its pace."""
    caplog.set_level(logging.INFO, logger="stepwarden.worker")
    app = make_app(tmp_path, plain=False)
    worker = app.worker(WorkerSettings(roles=("scheduler",), heartbeat=0.01))
    beats = FlakyBeats(app)

    async def body() -> None:
        stop = asyncio.Event()
        beating = asyncio.create_task(worker._heartbeat(stop))
        try:
            await until(lambda: beats.failed >= 20, 10)
            beats.down = False
            await until(lambda: beats.ok >= 2, 5)
        finally:
            stop.set()
            await asyncio.wait_for(beating, 5)

    asyncio.run(body())
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "stepwarden.worker"]
    warnings = [m for level, m in lines if level >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "heartbeat: a round on the store failed; trying again every 0.01s" in warnings[0]
    assert "connection refused" in warnings[0]
    assert len([m for level, m in lines if "answers again" in m]) == 1, lines


def test_the_heartbeat_tells_the_stop_writes_whether_the_store_answers(tmp_path: Path) -> None:
    """A failed heartbeat gives the stop's first write only a brief try (the store is down: a
    full wait would only add to the stop), and the next heartbeat that goes through gives the
    writes their full wait back (the store is back: a write cut short would be lost for nothing)."""
    app = make_app(tmp_path, plain=False)
    worker = app.worker(WorkerSettings(roles=("scheduler",), heartbeat=0.02))
    beats = FlakyBeats(app)

    async def body() -> None:
        writes = worker.stop_writes
        stop = asyncio.Event()
        beating = asyncio.create_task(worker._heartbeat(stop))
        try:
            await until(lambda: beats.failed >= 1 and not beating.done(), 5)
            await until(lambda: not writes.answering, 5)
            assert writes.bound == writes.brief
            beats.down = False
            await until(lambda: beats.ok >= 1, 5)
            await until(lambda: writes.answering, 5)
            assert writes.bound == writes.full
        finally:
            stop.set()
            await asyncio.wait_for(beating, 5)

    asyncio.run(body())
    assert worker.stop_writes.missed == 0  # a heartbeat is not a stop write: none was given up
