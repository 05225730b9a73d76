"""A role's idle wait (``sleep_or_wake``): it ends at its time on the clock, or earlier when any
of its events is set, and leaves nothing running behind it."""

from __future__ import annotations

import asyncio

from stepwarden.clock import FakeClock, sleep_or_wake


def pending_others() -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


def test_the_wait_ends_when_the_clock_passes_its_time_and_not_before() -> None:
    async def body() -> None:
        clock = FakeClock()
        wake = asyncio.Event()
        waiting = asyncio.create_task(sleep_or_wake(clock, 2.0, wake))
        await asyncio.sleep(0.01)
        clock.advance(1.9)
        await asyncio.sleep(0.01)
        assert not waiting.done()
        clock.advance(0.2)
        await asyncio.wait_for(waiting, 5)
        await asyncio.sleep(0)  # the cancelled waiters finish their cancellation
        assert pending_others() == set()

    asyncio.run(body())


def test_any_event_set_ends_the_wait_early_without_the_clock_moving() -> None:
    async def body() -> None:
        clock = FakeClock()
        wake, stop = asyncio.Event(), asyncio.Event()
        waiting = asyncio.create_task(sleep_or_wake(clock, 3600.0, wake, stop))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        stop.set()
        await asyncio.wait_for(waiting, 5)
        await asyncio.sleep(0)
        assert pending_others() == set()
        assert clock.monotonic() == FakeClock().monotonic()

    asyncio.run(body())


def test_an_event_already_set_returns_at_once() -> None:
    async def body() -> None:
        wake = asyncio.Event()
        wake.set()
        await asyncio.wait_for(sleep_or_wake(FakeClock(), 3600.0, wake), 5)

    asyncio.run(body())
