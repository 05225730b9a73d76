"""The workers' fleet check (``stepwarden.fleet``): work that waits on a role no live worker runs.
Found by review: a fleet without a scheduler left tasks pending, one without a supervisor left
expired attempts running, and no process said a word. Run on both stores, the clock faked."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from stepwarden.clock import FakeClock
from stepwarden.fleet import CHECK_EVERY, LATE, WARN_AGAIN_EVERY, FleetCheck
from stepwarden.liveness import SILENT_AFTER
from stepwarden.store import Store
from stepwarden.store import transitions as t
from stepwarden.store.supervision import fleet_gaps
from stepwarden.workflow import Workflow, encode_input

Factory = Callable[..., Workflow]
OPTS: dict[str, Any] = {"correlation_id": None, "idempotency_key": None, "priority": 0, "reply_to": None}


def gaps(store: Store) -> tuple[bool, bool]:
    return store.transact_sync(fleet_gaps, SILENT_AFTER, LATE)


def beat(store: Store, me: str, roles: list[str]) -> None:
    asyncio.run(store.worker_beat(me, roles, ["svc"] if "agent" in roles else []))


def test_work_waiting_on_a_missing_role_is_found_and_only_then(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    beat(store, "agents-1:1:aaa", ["agent"])
    wf = make_workflow("a", budget=10.0)
    store.transact_sync(t.submit, wf, encode_input({}), **OPTS)
    assert gaps(store) == (False, False)  # ready, but not for long yet
    clock.advance(LATE + 1)
    beat(store, "agents-1:1:aaa", ["agent"])
    assert gaps(store) == (True, False)  # no scheduler, and a task waited past LATE

    beat(store, "sched-1:1:bbb", ["scheduler", "agent"])
    assert gaps(store) == (False, False)
    store.transact_sync(t.claim_and_dispatch, "sched-1:1:bbb", 10)  # running, complete_by in 10 s
    clock.advance(10 + LATE + 1)
    for me, roles in (("agents-1:1:aaa", ["agent"]), ("sched-1:1:bbb", ["scheduler", "agent"])):
        beat(store, me, roles)
    assert gaps(store) == (False, True)  # no supervisor, and an attempt long past its complete-by

    beat(store, "sup-1:1:ccc", ["supervisor"])
    assert gaps(store) == (False, False)
    clock.advance(SILENT_AFTER + 1)  # every worker silent: none is live any more
    assert gaps(store) == (False, True)  # the task is claimed (its step runs): only the rescue waits


class _Scripted:
    """A store whose ``fleet_gaps`` answers come from a script."""

    def __init__(self, answers: list[tuple[bool, bool]]) -> None:
        self.answers = answers
        self.reads = 0

    async def transact(self, fn: Any, *args: Any) -> tuple[bool, bool]:
        assert fn is fleet_gaps
        self.reads += 1
        return self.answers.pop(0)


def test_a_gap_is_warned_about_once_then_every_ten_minutes_and_its_end_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stepwarden")
    clock = FakeClock()
    store = _Scripted([(True, False)] * 11 + [(False, False)] * 2)
    check = FleetCheck(store, clock, "w:1:a")  # type: ignore[arg-type]

    async def run() -> None:
        await check.maybe_check()  # the first minute is the fleet's to start
        assert store.reads == 0
        for _ in range(13):
            clock.advance(CHECK_EVERY)
            await check.maybe_check()
            await check.maybe_check()  # not read again within the minute

    asyncio.run(run())
    assert store.reads == 13
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    warnings = [m for level, m in said if level == "WARNING"]
    assert len(warnings) == 2, said  # at the first look, and 10 minutes (WARN_AGAIN_EVERY) later
    assert WARN_AGAIN_EVERY == 10 * CHECK_EVERY
    assert warnings[0].startswith("worker w:1:a: no live worker runs the scheduler role, and tasks ready")
    assert [m for level, m in said if level == "INFO"] == [
        "worker w:1:a: no work waits on a missing scheduler any more"
    ]


def test_a_task_whose_back_off_ended_counts_as_waiting_on_a_missing_scheduler(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """Found by review: only a scheduler clears a task's waiting mark once its back-off ends, so
    the check that read ready tasks alone missed every task that was backing off when the last
    scheduler left."""
    beat(store, "agents-1:1:aaa", ["agent"])
    task_id, _ = store.transact_sync(t.submit, make_workflow("a"), encode_input({}), **OPTS)
    due = clock.wall() + 10.0
    store.transact_sync(
        lambda tx: tx.sql("UPDATE tasks SET waiting = 1, run_at = ? WHERE id = ?", (due, task_id))
    )
    clock.advance(10 + LATE - 1)
    beat(store, "agents-1:1:aaa", ["agent"])
    assert gaps(store) == (False, False)  # its back-off ended less than LATE ago
    clock.advance(2)
    beat(store, "agents-1:1:aaa", ["agent"])
    assert gaps(store) == (True, False)


def test_the_check_runs_as_a_task_of_its_own_and_a_failed_look_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It runs beside the heartbeat, never in its loop (found by review: its reads wait on the
    roles' lane, and a beat held behind them made a busy worker look dead); a look that fails is
    the store's outage, logged by the roles, and the next look comes a minute later."""
    caplog.set_level(logging.WARNING, logger="stepwarden")
    clock = FakeClock()

    class Failing(_Scripted):
        async def transact(self, fn: Any, *args: Any) -> tuple[bool, bool]:
            self.reads += 1
            if self.reads == 1:
                raise ConnectionError("the store is down")
            return (True, False)

    store = Failing([])
    check = FleetCheck(store, clock, "w:1:a")  # type: ignore[arg-type]

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(check.run(stop))
        for reads in (1, 2):
            clock.advance(CHECK_EVERY)
            for _ in range(200):  # until the look has happened: the task runs on the loop
                if store.reads >= reads:
                    break
                await asyncio.sleep(0.005)
            assert store.reads == reads
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(run())
    assert [r.getMessage()[:40] for r in caplog.records] == ["worker w:1:a: no live worker runs the sc"]
