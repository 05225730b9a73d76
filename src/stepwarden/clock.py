"""Time, injectable.

Two clocks, each for one job (DESIGN principle 3): ``wall()`` is what the store uses as "the
database's clock" on SQLite (on PostgreSQL the server's ``now()`` is used instead), and
``monotonic()`` measures local trust windows such as "how long may I believe I lead". Everything
in our code that reads time or sleeps goes through a :class:`Clock`, so tests of leases, deadlines
and back-off use :class:`FakeClock` and run in milliseconds.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def wall(self) -> float:
        """Seconds since the epoch; the store's notion of 'now' on SQLite."""
        ...

    def monotonic(self) -> float:
        """A local clock that never goes backwards; only differences mean anything."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clocks."""

    def wall(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that moves only when told to; ``sleep`` waits until ``advance`` passes its deadline."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._wall = start
        self._mono = 1000.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def wall(self) -> float:
        return self._wall

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        """Move both clocks forward and wake every sleeper whose time has come."""
        self._wall += seconds
        self._mono += seconds
        due = [(t, f) for t, f in self._sleepers if t <= self._mono]
        self._sleepers = [(t, f) for t, f in self._sleepers if t > self._mono]
        for _, fut in due:
            if not fut.done():
                fut.set_result(None)

    def set_wall(self, wall: float) -> None:
        """Jump the wall clock only (a clock step), leaving the monotonic clock alone."""
        self._wall = wall

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self._mono + seconds, fut))
        await fut


SYSTEM_CLOCK = SystemClock()


async def sleep_or_wake(clock: Clock, seconds: float, *events: asyncio.Event) -> None:
    """Sleep up to ``seconds`` on ``clock``, waking early when any event is set: a role's idle
    wait, cut short by a wake-up hint (NOTIFY, a local submission) or by stop."""
    waiters = [asyncio.create_task(e.wait()) for e in events]
    sleeper = asyncio.create_task(clock.sleep(seconds))
    try:
        await asyncio.wait({sleeper, *waiters}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (sleeper, *waiters):
            t.cancel()
