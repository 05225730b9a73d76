"""Shared fixtures for the unit tests: a fake clock, a fresh SQLite store on it, small workflows.

Time moves only through ``FakeClock.advance``; the store's SQL reads the same clock through
``sw_now()``, so deadlines and leases are tested without sleeping. Waiting for something that
happens on another thread or task uses ``wait_until`` / ``fake_time.settle``, never a fixed sleep.

Helpers are handed out as fixtures (not imported from this module): several test folders have a
``conftest.py``, and ``import conftest`` would be ambiguous.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwarden.clock import FakeClock
from stepwarden.store import SQLiteStore, Store, open_store


class TrackedStore(SQLiteStore):
    """The SQLite store, counting the transactions still running on its thread.

    Fake-time tests of async roles must know when the event loop has nothing left to do but wait
    for the clock; :meth:`FakeTime.settle` yields until no transaction is in flight.
    """

    inflight = 0

    async def transact(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.inflight += 1
        try:
            return await super().transact(fn, *args, **kwargs)
        finally:
            self.inflight -= 1


class FakeTime:
    """Drives a :class:`FakeClock` from async tests: advance in small steps, let the loop settle."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.stores: list[TrackedStore] = []

    async def settle(self, quiet_rounds: int = 30, timeout: float = 5.0) -> None:
        """Yield until no store call has been in flight for ``quiet_rounds`` loop iterations."""
        end = time.monotonic() + timeout
        quiet = 0
        while quiet < quiet_rounds:
            await asyncio.sleep(0)
            if any(s.inflight for s in self.stores):
                quiet = 0
                if time.monotonic() > end:
                    raise AssertionError("a store transaction never finished")
            else:
                quiet += 1

    async def run_for(self, seconds: float, step: float = 0.125) -> None:
        """Advance fake time by ``seconds`` in ``step``s (powers of two keep the sums exact)."""
        n = round(seconds / step)
        assert abs(n * step - seconds) < 1e-9, "seconds must be a multiple of step"
        await self.settle()
        for _ in range(n):
            self.clock.advance(step)
            await self.settle()


def wait_until(pred: Callable[[], bool], timeout: float = 2.0, interval: float = 0.005) -> None:
    """Poll ``pred`` in real time until it holds; fail if it does not within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "stepwarden.db"


@pytest.fixture
def marks_store(tmp_path: Path) -> Iterator[SQLiteStore]:
    """A SQLite store on the wall clock (busy timeout 5 s) with a table ``marks (v TEXT)`` for
    the tests of its transactions and locks to write to."""
    s = SQLiteStore(str(tmp_path / "sw.db"), busy_timeout=5)
    s.transact_sync(lambda tx: tx.sql("CREATE TABLE marks (v TEXT)"))
    yield s
    s.close()


@pytest.fixture
def store(db_path: Path, clock: FakeClock) -> Iterator[Store]:
    """A fresh, migrated SQLite store whose database clock is ``clock``."""
    s = open_store(f"sqlite:///{db_path}", clock=clock)
    assert isinstance(s, SQLiteStore)
    yield s
    s.close()


@pytest.fixture
def rt_store(tmp_path: Path) -> Iterator[Store]:
    """A store on the real clock, for the agent's tests: its deadlines, in-attempt back-off and
    reply linger are real time (``asyncio.timeout``), which a fake clock does not move."""
    s = open_store(f"sqlite:///{tmp_path / 'agent.db'}")
    yield s
    s.close()


@pytest.fixture
def fake_time(clock: FakeClock) -> FakeTime:
    return FakeTime(clock)


@pytest.fixture
def tracked_store(db_path: Path, clock: FakeClock, fake_time: FakeTime) -> Iterator[TrackedStore]:
    """Like ``store``, and known to ``fake_time`` so that ``settle`` waits for its transactions."""
    s = TrackedStore(str(db_path), clock=clock)
    fake_time.stores.append(s)
    yield s
    s.close()


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., None]:
    return wait_until
