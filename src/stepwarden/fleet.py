"""A worker's look at its fleet: work that waits on a role no live worker runs.

The roles share nothing but the store, so a fleet started without a scheduler (every worker
``--roles agent``) or without a supervisor lets tasks wait for ever, and no process had anything
to say about it: each did its own part and found nothing wrong (found by review). Every worker
now looks, once a minute, and warns while the gap lasts. Any worker may see it, whatever its own
roles; the one that runs the missing role is the one that is not there.
"""

from __future__ import annotations

import logging

from .clock import Clock
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
    """Called at every heartbeat; reads the store at most every :data:`CHECK_EVERY`."""

    def __init__(self, store: Store, clock: Clock, me: str) -> None:
        self.store = store
        self.clock = clock
        self.me = me
        self._next = clock.monotonic() + CHECK_EVERY  # a fleet starting up is given its first minute
        self._warned: dict[str, float] = {}  # a missing role -> when it was last warned about

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
