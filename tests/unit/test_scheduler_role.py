"""The scheduler's pacing: after a round that found work it waits its gather window before the
next, so that work arriving meanwhile is claimed in one transaction; an idle scheduler starts at
once when woken. Against a stub store that records when each round ran (real time)."""

from __future__ import annotations

import asyncio
from typing import Any

from stepwarden.scheduler import SchedulerRole, SchedulerSettings
from stepwarden.store import ApplyResult


class RoundsStore:
    """``schedule`` claims from a queue that tests fill; records the loop time of every round."""

    def __init__(self) -> None:
        self.queue = 0
        self.rounds: list[tuple[float, int]] = []

    async def schedule(self, me: str, limit: int) -> tuple[ApplyResult, int]:
        claimed, self.queue = min(self.queue, limit), max(0, self.queue - limit)
        self.rounds.append((asyncio.get_running_loop().time(), claimed))
        return ApplyResult(), claimed


async def _until(check: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def _run(settings: SchedulerSettings, scenario: Any) -> RoundsStore:
    store = RoundsStore()

    async def main() -> None:
        role = SchedulerRole(store, "sched", settings=settings)  # type: ignore[arg-type]
        stop = asyncio.Event()
        running = asyncio.create_task(role.run(stop))
        try:
            await scenario(store, role)
        finally:
            stop.set()
            role.wake.set()
            await asyncio.wait_for(running, 5)

    asyncio.run(main())
    return store


def test_after_a_round_that_found_work_the_next_waits_the_gather_window() -> None:
    async def scenario(store: RoundsStore, role: SchedulerRole) -> None:
        store.queue = 120  # three rounds of 50, 50, 20, then an empty one
        role.wake.set()
        await _until(lambda: len(store.rounds) >= 4)

    store = _run(SchedulerSettings(batch=50, gather=0.05), scenario)
    assert [n for _, n in store.rounds[:4]] == [50, 50, 20, 0]
    gaps = [b - a for (a, _), (b, _) in zip(store.rounds, store.rounds[1:4], strict=False)]
    assert all(g >= 0.05 for g in gaps), gaps


def test_work_arriving_in_the_window_is_claimed_in_one_round() -> None:
    async def scenario(store: RoundsStore, role: SchedulerRole) -> None:
        store.queue = 1
        role.wake.set()
        await _until(lambda: len(store.rounds) >= 1)
        for _ in range(5):  # five submissions, each with its hint, while the scheduler gathers
            store.queue += 1
            role.wake.set()
            await asyncio.sleep(0.005)
        await _until(lambda: len(store.rounds) >= 3)

    store = _run(SchedulerSettings(gather=0.5), scenario)
    assert [n for _, n in store.rounds[:3]] == [1, 5, 0]


def test_an_idle_scheduler_starts_at_once_when_woken_and_gather_zero_runs_rounds_back_to_back() -> None:
    async def scenario(store: RoundsStore, role: SchedulerRole) -> None:
        await _until(lambda: len(store.rounds) >= 1)  # the first round finds nothing: idle
        await asyncio.sleep(0.05)
        store.queue = 100
        woken = asyncio.get_running_loop().time()
        role.wake.set()
        await _until(lambda: len(store.rounds) >= 4)
        assert store.rounds[1][0] - woken < 0.5  # woken, not the next poll (1 s)

    store = _run(SchedulerSettings(batch=50, gather=0, poll_interval=1.0, idle_poll_max=1.0), scenario)
    assert [n for _, n in store.rounds[1:4]] == [50, 50, 0]
    assert store.rounds[3][0] - store.rounds[1][0] < 0.5  # back to back, not a poll (1 s) apart
