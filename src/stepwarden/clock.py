"""Time, injectable.

Two clocks, each for one job (DESIGN principle 3): ``wall()`` is what the store uses as "the
database's clock" on SQLite (on PostgreSQL the server's ``now()`` is used instead), and
``monotonic()`` measures local trust windows such as "how long may I believe I lead". Everything
in our code that reads time or sleeps goes through a :class:`Clock`, so tests of leases, deadlines
and back-off use :class:`FakeClock` and run in milliseconds.

The waits of the roles' loops live here too: ``sleep_or_wake`` (an idle poll cut short by a
hint), ``unless_stopped`` (a store call that must not hold up a stop) and :class:`Outage` (the
back-off, and the two log lines, of a loop while the store fails).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import Awaitable
from typing import Final, Protocol, TypeVar

from .errors import StoreMisconfigured
from .policies import Backoff

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


# How long a role's loop waits between rounds while the store fails (REL3): a quarter second (an
# idle poll), doubling to 5 s, each wait spread by +-20 % so that the workers one outage hit
# together do not all come back in the same instant (an agent role that kept polling at its idle
# rate tried 4 times a second through the whole outage).
STORE_RETRY: Final = Backoff(initial=0.25, multiplier=2.0, maximum=5.0, jitter=0.2)


class Outage:
    """What a loop that polls the store does while the store fails (REL3): wait longer after each
    failed round (``failed`` returns the wait, from ``backoff``), log the outage once when it
    begins (a warning with the error) and once when the store answers again (``answered``: an
    info line with how long it was down), not a line per round. A role that logged every failed
    round (two, with its sweep for lost takes) wrote 39 warnings in a 5 s outage.

    ``who`` names the loop in the log lines ("agent NAME", "scheduler NAME"); the time down is
    measured on ``clock``'s monotonic clock. ``every``: the loop keeps its own pace (a heartbeat,
    a lease's campaign) rather than back off, and the warning says so."""

    def __init__(
        self,
        log: logging.Logger,
        who: str,
        clock: Clock,
        backoff: Backoff = STORE_RETRY,
        rng: random.Random | None = None,
        every: float | None = None,
    ) -> None:
        self.log, self.who, self.clock, self.backoff = log, who, clock, backoff
        self.every = every
        self.rng = rng or random.Random()
        self.failures = 0  # failed rounds in a row; 0 while the store answers
        self.since = 0.0  # when the first of them failed (monotonic)

    def failed(self, error: BaseException) -> float:
        """A round failed with ``error``: the seconds to wait before the next one. A store that no
        wait heals (:class:`StoreMisconfigured`) is no outage: ``error`` is raised, and ends the
        loop that met it (a worker's role, so the worker, with one line)."""
        if isinstance(error, StoreMisconfigured):
            raise error
        self.failures += 1
        if self.failures == 1:
            self.since = self.clock.monotonic()
            pace = (
                f"every {self.every:g}s"
                if self.every is not None
                else f"with back-off (up to {self.backoff.maximum:g}s)"
            )
            self.log.warning(
                "%s: a round on the store failed; trying again %s, logged again when one goes through: %r",
                self.who,
                pace,
                error,
            )
        else:
            self.log.debug("%s: round %d on the store failed too: %r", self.who, self.failures, error)
        return self.backoff.delay(self.failures, self.rng)

    def answered(self) -> None:
        """A round went through: the outage, if there was one, is over and the waits start again
        from the shortest."""
        if self.failures:
            self.log.info(
                "%s: the store answers again, after %.1fs of failed rounds (%d of them)",
                self.who,
                self.clock.monotonic() - self.since,
                self.failures,
            )
            self.failures = 0
