"""How long each of a stopping worker's writes may wait for the store (DEP4, REL3).

A graceful stop writes a few records: the agents' release of the attempts they did not finish,
the agent instances' stop, the resignation of the leases it holds, the hand-back of attempts
dispatched but not taken, the worker's stop record (and, between the last two, it waits for a
heartbeat in flight). Each is bounded by ``STOP_WRITE_WAIT``, so that a store which stopped
answering cannot hold the process. But the bounds ran one after another: an idle worker whose
PostgreSQL server was down took 33.5 s from SIGTERM to exit (measured), more than the 30 s that
Kubernetes gives a pod by default.

Whether the store answers is one fact shared by all of those writes. Once a write has failed (or
the agent loop's last round, the last heartbeat, or a lease renewal), each later write gets a
brief try, ``STOP_WRITE_BRIEF``, instead of the full wait. A brief try is still ample for a store
that has come back, where a transaction takes milliseconds; and one write that goes through gives
the next one the full wait again. What a stop cannot write is what a worker that died leaves
behind, and is handled the same way: the supervisor takes the work back when the worker's
heartbeats stop or its attempts pass complete-by.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from .agent_settings import STOP_WRITE_WAIT

__all__ = ["STOP_WRITE_BRIEF", "StopWrites"]

# A stop write's wait once the store has been found not answering: long enough for a store that
# is back (a pooled connection opened, a transaction committed), short enough that the stop's
# four or five writes to a store that is still down add up to seconds, not half a minute.
STOP_WRITE_BRIEF = 1.0

T = TypeVar("T")


class StopWrites:
    """One verdict on the store for a worker's stop writes: answering (each gets the full wait) or
    not (each gets a brief try). Those who see the store fail or answer outside the stop (the
    heartbeat, the agent loop, the lease renewals) report it with :meth:`failed` and
    :meth:`answered`."""

    def __init__(self, full: float = STOP_WRITE_WAIT, brief: float = STOP_WRITE_BRIEF) -> None:
        self.full = full
        self.brief = brief
        self.answering = True
        self.missed = 0  # writes given up (failed or timed out): the worker's last line counts them

    def answered(self) -> None:
        self.answering = True

    def failed(self) -> None:
        self.answering = False

    @property
    def bound(self) -> float:
        """How long the next write may wait for the store."""
        return self.full if self.answering else self.brief

    async def write(self, aw: Awaitable[T]) -> T:
        """``aw`` within :attr:`bound`, noting whether the store answered. Raises what ``aw``
        raised, or TimeoutError at the bound: the caller says what was not written."""
        try:
            out = await asyncio.wait_for(aw, self.bound)
        except Exception:
            self.answering = False
            self.missed += 1
            raise
        self.answering = True
        return out
