"""A worker's look at its fleet: work that waits on a role no live worker runs.

The roles share nothing but the store, so a fleet started without a scheduler (every worker
``--roles agent``) or without a supervisor lets tasks wait for ever, and no process had anything
to say about it: each did its own part and found nothing wrong (found by review). Every worker
now looks, once a minute, and warns while the gap lasts. Any worker may see it, whatever its own
roles; the one that runs the missing role is the one that is not there.
"""

from __future__ import annotations

import asyncio
import logging

from .clock import Clock, sleep_or_wake
from .liveness import SILENT_AFTER
from .store import Store
from .store.supervision import fleet_gaps

log = logging.getLogger("stepwarden.worker")

# How often a worker looks, and how often it warns again while a gap lasts (its clock's seconds).
CHECK_EVERY = 60.0
WARN_AGAIN_EVERY = 600.0
# Work this late past when it could have begun counts as waiting on a missing role: a fleet that
# is merely restarting (a rolling deploy) fills the gap well within it.
LATE = 30.0

_SAID = {
    "scheduler": (
        "no live worker runs the scheduler role, and tasks ready for more than {late:g}s are not"
        " started: start a worker with the scheduler role (`stepwarden worker --roles"
        " scheduler,...`)"
    ),
    "supervisor": (
        "no live worker runs the supervisor role, and attempts more than {late:g}s past their"
        " complete-by are not rescued: start a worker with the supervisor role (`stepwarden"
        " worker --roles supervisor,...`)"
    ),
}


class FleetCheck:
    """Reads the store every :data:`CHECK_EVERY` (:meth:`run`), on the roles' lane of the store:
    never in the heartbeat's loop, which must not wait behind the roles' work."""

    def __init__(self, store: Store, clock: Clock, me: str) -> None:
        self.store = store
        self.clock = clock
        self.me = me
        self._next = clock.monotonic() + CHECK_EVERY  # a fleet starting up is given its first minute
        self._warned: dict[str, float] = {}  # a missing role -> when it was last warned about

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: a look every :data:`CHECK_EVERY` on the clock. A look that fails (the
        store down: the roles log that outage) is skipped, not raised."""
        while not stop.is_set():
            await sleep_or_wake(self.clock, max(0.0, self._next - self.clock.monotonic()), stop)
            if stop.is_set():
                return
            try:
                await self.maybe_check()
            except Exception as e:
                log.debug("worker %s: the fleet check failed: %r", self.me, e)
                self._next = self.clock.monotonic() + CHECK_EVERY

    async def maybe_check(self) -> None:
        now = self.clock.monotonic()
        if now < self._next:
            return
        self._next = now + CHECK_EVERY
        unclaimed, overdue = await self.store.transact(fleet_gaps, SILENT_AFTER, LATE)
        for role, missing in (("scheduler", unclaimed), ("supervisor", overdue)):
            if not missing:
                if self._warned.pop(role, None) is not None:
                    log.info("worker %s: no work waits on a missing %s any more", self.me, role)
                continue
            last = self._warned.get(role)
            if last is None or now - last >= WARN_AGAIN_EVERY:
                self._warned[role] = now
                log.warning("worker %s: %s", self.me, _SAID[role].format(late=LATE))
