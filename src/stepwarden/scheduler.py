"""The scheduler role: apply agents' replies and claim work, each batch in one transaction.

A scheduler holds nothing in memory between transactions: claiming a task and dispatching its
next step commit together, and so do accepting a reply, completing its step and dispatching the
one after. A scheduler killed at any instant therefore leaves either the old state or the new,
and the supervisor's complete-by sweep covers the rest (SCH6).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from .clock import SYSTEM_CLOCK, Clock, Outage, sleep_or_wake
from .logs import log_raised
from .policies import check_count, check_seconds
from .store import ApplyResult, RequestMsg, Store
from .store.core import Want


class LocalAgents(Protocol):
    """This worker's own agents, when it runs them: a round may hand them requests directly."""

    def reserve(self) -> Mapping[str, Want]:
        """Slots to fill, per agent (how many, for which operations), held until :meth:`accept`
        (so no other pull takes them too)."""
        ...

    async def workflows_of(self, msgs: list[RequestMsg]) -> Mapping[int, str]:
        """Each task's workflow, for the attempts' trace spans (empty when none are recorded)."""
        ...

    def accept(
        self,
        msgs: list[RequestMsg],
        reserved: Mapping[str, Want],
        failed: bool = False,
        workflows: Mapping[int, str] | None = None,
    ) -> None:
        """Run ``msgs`` (taken in the round's transaction) and give back the unused reservations.
        ``failed``: the transaction raised, and may have taken requests all the same."""
        ...


log = logging.getLogger("stepwarden.scheduler")


@dataclass(frozen=True)
class SchedulerSettings:
    """How the scheduler role paces its rounds.

    ``batch`` (replies applied, and tasks claimed, per transaction) is an int from 1 to 2**31-1;
    ``poll_interval`` and ``idle_poll_max`` are finite numbers of seconds more than 0, ``gather``
    from 0, each at most 10**9 (about 31 years, :data:`~stepwarden.policies.MAX_SECONDS`).
    Anything else (a bool, text, nan) raises :class:`~stepwarden.errors.InputError` naming the field.
    """

    batch: int = 50
    poll_interval: float = 0.02
    idle_poll_max: float = 0.25
    # After a round that found work, wait this long before the next, so that what arrives
    # meanwhile is claimed in one transaction instead of one round each (a batching window, like
    # a producer's linger). Under a steady stream of submissions on 2 cores, 5 ms took W1 from
    # ~1,100 to ~1,300 tasks/s on PostgreSQL (less CPU per task: rounds of more tasks) and +2 to
    # +13 % on SQLite (fewer turns of the write lock); 10 ms gave ~5 % more. It costs at most that
    # much pickup latency to work arriving while the scheduler is busy; an idle scheduler still
    # starts at once when woken. 0: rounds back to back.
    gather: float = 0.005

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch", check_count("SchedulerSettings.batch", self.batch))
        for name in ("poll_interval", "idle_poll_max"):
            check_seconds(f"SchedulerSettings.{name}", getattr(self, name), above=True)
        check_seconds("SchedulerSettings.gather", self.gather)


class SchedulerRole:
    def __init__(
        self,
        store: Store,
        me: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        settings: SchedulerSettings | None = None,
        wake: asyncio.Event | None = None,
        on_dispatch: Callable[[], None] | None = None,
        on_applied: Callable[[ApplyResult], None] | None = None,
        local: LocalAgents | None = None,
    ) -> None:
        self.store = store
        self.me = me
        self.clock = clock
        self.settings = settings or SchedulerSettings()
        self.wake = wake or asyncio.Event()
        self.on_dispatch = on_dispatch or (lambda: None)
        self.on_applied = on_applied or (lambda r: None)
        self.local = local
        self.claimed = 0
        self.accepted = 0
        self.stale = 0

    async def tick(self) -> int:
        """One round: apply replies, then claim and dispatch. Returns how much work it did."""
        if self.local is None:
            applied, claimed = await self.store.schedule(self.me, self.settings.batch)
        else:
            reserved = self.local.reserve()
            taken: list[RequestMsg] = []
            done = False
            workflows: Mapping[int, str] = {}
            try:
                applied, claimed, taken = await self.store.schedule_and_take(
                    self.me, self.settings.batch, reserved
                )
                done = True
                workflows = await self.local.workflows_of(taken)
            finally:
                self.local.accept(taken, reserved, failed=not done, workflows=workflows)
        if applied.accepted or applied.stale:
            self.accepted += applied.accepted
            self.stale += applied.stale
            log_raised(log, applied.alerts)
            self.on_applied(applied)
            self.on_dispatch()
        if claimed:
            self.claimed += claimed
            self.on_dispatch()
        return applied.accepted + applied.stale + claimed

    async def run(self, stop: asyncio.Event) -> None:
        idle = self.settings.poll_interval
        outage = Outage(log, f"scheduler {self.me}", self.clock)
        while not stop.is_set():
            try:
                did = await self.tick()
            except Exception as e:  # database trouble: back off and carry on (REL3)
                # A hint (a local submission, a reply committed) cuts the wait short: the store
                # answered someone.
                await sleep_or_wake(self.clock, outage.failed(e), stop, self.wake)
                self.wake.clear()
                continue
            outage.answered()
            if did:
                idle = self.settings.poll_interval
                if self.settings.gather > 0:
                    # Real time whatever the role's clock: a pause for batching, which no
                    # deadline depends on (a fake clock in tests would hold it until advanced).
                    await asyncio.sleep(self.settings.gather)
                continue
            await sleep_or_wake(self.clock, idle, stop, self.wake)
            self.wake.clear()
            idle = min(self.settings.idle_poll_max, idle * 2)
