"""Time, injectable.

Two clocks, each for one job (DESIGN principle 3): ``wall()`` is what the store uses as "the
database's clock" on SQLite (on PostgreSQL the server's ``now()`` is used instead), and
``monotonic()`` measures local trust windows such as "how long may I believe I lead". Everything
in our code that reads time or sleeps goes through a :class:`Clock`, so tests of leases, deadlines
and back-off use :class:`FakeClock` and run in milliseconds.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable
from typing import Final, Protocol, TypeVar

T = TypeVar("T")


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


class Stopped(enum.Enum):
    """The type of :data:`STOPPED`: an enum, so that ``is STOPPED`` narrows a result's type."""

    STOPPED = "stopped"


# What :func:`unless_stopped` returns when ``stop`` came first: not None, which the awaited call
# may well return itself (``Store.register_workflows`` does; ``acquire_lease`` when refused).
STOPPED: Final = Stopped.STOPPED


async def unless_stopped(aw: Awaitable[T], stop: asyncio.Event) -> T | Stopped:
    """``aw``'s result, or :data:`STOPPED` as soon as ``stop`` is set; ``aw`` is then cancelled.

    For a wait on the store that must not hold up a stop: a lock another process holds for up to
    the busy timeout, a server that does not answer, another session's migration. What runs in a
    thread (a transaction) is not stopped by the cancellation, only no longer waited for: bound
    it too (``Store.limit_lock_waits``) or leave it to its thread. A result that is ready when
    ``stop`` is set is returned, not dropped; an error of ``aw`` is raised."""
    job = asyncio.ensure_future(aw)
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({job, stopper}, return_when=asyncio.FIRST_COMPLETED)
        # Not ``job.cancelled()`` after cancelling it: a task is cancelled only once it has run
        # again, so its result would be asked for while it has none (InvalidStateError).
        return job.result() if job.done() else STOPPED
    finally:
        stopper.cancel()
        if not job.done():
            job.cancel()
