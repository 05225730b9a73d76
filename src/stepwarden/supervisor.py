"""The supervisor role: rescue attempts whose complete-by passed (SUP1-SUP6), only while leader.

It knows nothing of the business (SUP4): each expired attempt is counted as a failure and the
step's own policy decides between retrying after a back-off, escalating to an operator, or
compensating the task. Every sweep is fenced by the lease term and bounded in size (SUP6).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from . import durations, liveness
from .clock import SYSTEM_CLOCK, Clock
from .leader import Leadership
from .logs import log_raised
from .policies import check_count, check_number, check_seconds
from .store import Store, SweepResult, transitions
from .store.base import Row

# The least time between two warnings about one reply-queue consumer's unread, pruned messages.
UNREAD_WARN_EVERY = 3600.0

log = logging.getLogger("stepwarden.supervisor")
LEASE = "supervisor"


# Seconds the store must have answered this supervisor, at the least, before it presumes a worker
# dead by the age of its heartbeat (never by a vanished process, which is exact). In an outage no
# worker can beat; once the server is back, a live one beats again within its heartbeat and its
# pool's next try to reconnect (at most about 4 s apart, store.postgres.RECONNECT_TIMEOUT), so a
# supervisor that judged at once (its first sweep of a term won as the store came back, or the
# first that went through) took every live worker for dead and had its steps run twice.
HEARTBEATS_SETTLE = 5.0

# The longest retention: 36500 days (100 years), as ``stepwarden worker --retention DAYS`` takes.
# Above MAX_SECONDS, which bounds waits and times ahead: a retention only looks back (now - it).
MAX_RETENTION = 36500 * 86400.0


@dataclass(frozen=True)
class SupervisorSettings:
    """How the supervisor leader sweeps and prunes.

    ``batch``, ``prune_batch`` and ``prune_rounds`` are ints from 1 to 2**31-1. ``interval`` and
    ``dead_after`` are finite numbers of seconds more than 0, ``prune_every`` from 0 (0: at every
    sweep), each at most 10**9 (about 31 years, :data:`~stepwarden.policies.MAX_SECONDS`);
    ``retention`` is None (keep everything) or more than 0 and at most :data:`MAX_RETENTION`
    (36500 days). ``dead_after`` must also be at least twice the worker's heartbeat, which
    :class:`~stepwarden.worker.WorkerSettings` checks (with the 1 s heartbeat of ``stepwarden
    worker``, the 2 s minimum of its ``--dead-after``). Anything else (a bool, text, nan) raises
    :class:`~stepwarden.errors.InputError` naming the field.
    """

    interval: float = 1.0
    batch: int = 200
    # A worker silent for this long (no heartbeat) is presumed dead: its in-flight steps are
    # rescued and its leases taken over without waiting for complete-by or TTL (see liveness).
    dead_after: float = 3.0
    # Finished tasks (processed, compensated, cancelled; not error) older than this are deleted
    # with all their rows, by the leader, every ``prune_every`` s, in transactions of
    # ``prune_batch`` tasks, at most ``prune_rounds`` of them at a time. None keeps everything.
    retention: float | None = 7 * 86400.0
    prune_every: float = 10.0
    prune_batch: int = 500
    prune_rounds: int = 10

    def __post_init__(self) -> None:
        for name in ("batch", "prune_batch", "prune_rounds"):
            object.__setattr__(self, name, check_count(f"SupervisorSettings.{name}", getattr(self, name)))
        for name in ("interval", "dead_after"):
            check_seconds(f"SupervisorSettings.{name}", getattr(self, name), above=True)
        check_seconds("SupervisorSettings.prune_every", self.prune_every, hint=" (0: at every sweep)")
        if self.retention is not None:
            check_number(
                "SupervisorSettings.retention",
                self.retention,
                above=True,
                high=MAX_RETENTION,
                unit=" of seconds",
                hint=" (36500 days; None keeps every finished task)",
            )


class Supervisor:
    def __init__(
        self,
        store: Store,
        me: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        settings: SupervisorSettings | None = None,
        on_sweep: Callable[[SweepResult, float], None] | None = None,
    ) -> None:
        self.store = store
        self.me = me
        self.clock = clock
        self.settings = settings or SupervisorSettings()
        self.on_sweep = on_sweep or (lambda r, seconds: None)
        self.rescued = 0
        self.pruned = 0
        self._next_prune = 0.0
        # Per (queue, consumer): messages pruned unread since its last warning, and when that was.
        self._unread: dict[tuple[str, str], tuple[int, int, float | None]] = {}
        # Since when (monotonic) the store has answered this supervisor without a break; None:
        # not since its last failure or the start of its term (see HEARTBEATS_SETTLE). A sweep
        # called outside lead() (a test, a tool) judges heartbeats at once, as before.
        self._answering_since: float | None = -float("inf")
        self._beats = liveness.HeartbeatWatch()  # of the workers holding attempts

    async def sweep(self, term: int, leadership: Leadership | None = None) -> SweepResult:
        """Sweep until fewer than a batch of expired attempts remain; each batch one transaction.

        Each committed batch is progress for the lease (``leadership``): a backlog of thousands
        of expired steps took longer than ``stall_after`` to sweep, and the leader gave up its
        lease in the middle of it. What committed batches did is counted and logged even when a
        later batch fails (the store went away mid-sweep)."""
        total = SweepResult()
        try:
            await self._rescue_orphans(term, total, leadership)
            while True:
                r = await self.store.sweep_expired(self.me, LEASE, term, self.settings.batch)
                total.add(r)
                if leadership is not None:
                    leadership.progress()
                if not self._more(r):
                    break
        finally:
            self.rescued += total.rescued
            log_raised(log, total.alerts)
            if total.rescued:
                log.info(
                    "supervisor %s (term %d) rescued %d expired attempt(s)", self.me, term, total.rescued
                )
        return total

    async def _rescue_orphans(self, term: int, total: SweepResult, leadership: Leadership | None) -> None:
        """Rescue the steps of workers presumed dead, before their complete-by passes; by the age
        of a heartbeat only once the store has answered long enough for a live worker to have
        beaten again (:data:`HEARTBEATS_SETTLE`)."""
        asked = self.clock.monotonic()
        found = await self.store.transact(transitions.owners_in_flight)
        answered = self.clock.monotonic()
        # A read that took long may have waited out an outage that ended just now, every
        # heartbeat as old as that wait and a beat more: as far as heartbeats go, it is one. A
        # live worker looks dead after an outage longer than dead_after less its heartbeat (at
        # most half of dead_after), so a wait of half of it is taken for one; a read slowed by
        # load alone seldom takes that long (it is read-only: on SQLite it waits for no writer).
        if self._answering_since is None or answered - asked > self.settings.dead_after / 2:
            self._answering_since = answered
        settled = answered - self._answering_since >= max(self.settings.dead_after, HEARTBEATS_SETTLE)
        owners = [r for r in found if r["id"] != self.me]
        self._beats.saw(owners, answered)
        if not owners:
            return
        now = float(owners[0]["now"])
        for verdict in liveness.presumed_dead(owners, now, self.settings.dead_after):
            if verdict.silent_for is not None and not settled:
                log.debug("supervisor %s: not judging %s yet (%s)", self.me, verdict.worker, verdict.reason)
                continue
            doubt = self._beats.doubt(verdict, answered, self.settings.dead_after)
            if doubt is not None:
                log.debug("supervisor %s: not judging %s yet (%s)", self.me, verdict.worker, doubt)
                continue
            while True:
                r = await self.store.transact(
                    transitions.rescue_orphans,
                    self.me,
                    LEASE,
                    term,
                    verdict.worker,
                    verdict.reason,
                    self.settings.batch,
                    self.store.rng,
                    verdict.silent_for,
                )
                total.add(r)
                if leadership is not None:
                    leadership.progress()
                if r.rescued:
                    log.warning(
                        "supervisor %s: rescued %d step(s) of worker %s, presumed dead (%s)",
                        self.me,
                        r.rescued,
                        verdict.worker,
                        verdict.reason,
                    )
                if not self._more(r):
                    break

    def _more(self, r: SweepResult) -> bool:
        """Whether another batch may find more: this one read a full batch (on PostgreSQL some may
        have been skipped, their task or request held by another transaction, so counting the
        rescued ones ended a sweep with a backlog left behind a single held row) and rescued at
        least one. The skipped rows are read again by the next batch, so one that read nothing
        but them ends the sweep rather than reading them over and over: they wait for the next
        sweep, an interval later."""
        return r.examined >= self.settings.batch and r.rescued > 0

    async def prune(self, term: int, leadership: Leadership | None = None) -> int:
        """Delete finished tasks past their retention, a bounded number of batches per call; once
        they are done, the records that outlive tasks (``prune_records``) the same way."""
        s = self.settings
        if s.retention is None:
            return 0
        total = 0
        rounds = 0
        unread: list[Row] = []
        while rounds < s.prune_rounds:
            rounds += 1
            done: list[Row] = []  # this transaction's (a try run again sets it again)
            n = await self.store.transact(
                transitions.prune, self.me, LEASE, term, s.retention, s.prune_batch, done
            )
            unread += done
            total += n
            if leadership is not None:
                leadership.progress()
            # Until a round finds nothing to delete: a short round is not the end of the backlog
            # when the prune left a task another transaction holds (transitions.prune).
            if n == 0:
                break
        if total:
            log.info("supervisor %s (term %d) pruned %d finished task(s)", self.me, term, total)
        self._warn_unread(unread, s.retention)
        self.pruned += total
        if rounds < s.prune_rounds:  # the task backlog is done: this call has rounds to spare
            await self._prune_records(term, s.retention, s.prune_rounds - rounds, leadership)
        return total

    def _warn_unread(self, unread: list[Row], retention: float) -> None:
        """A warning per named consumer that lost messages to the prune: documented (a consumer
        that lags by more than the retention misses them), but its owner should hear of it. At
        most once per :data:`UNREAD_WARN_EVERY` per consumer, with the count since the last one:
        an abandoned consumer (nothing removes its cursor) was warned about at every prune."""
        now = self.clock.monotonic()
        for r in unread:
            key = (str(r["queue"]), str(r["consumer"]))
            n, _, said = self._unread.get(key, (0, 0, None))
            self._unread[key] = (n + int(r["n"]), int(r["position"]), said)
        for (queue, consumer), (n, position, said) in sorted(self._unread.items()):
            if n == 0 or (said is not None and now - said < UNREAD_WARN_EVERY):
                continue
            log.warning(
                "supervisor %s pruned %d message(s) of reply queue %r that consumer %r had not read"
                " (it acknowledged up to position %d): their tasks finished more than the retention"
                " (%s) ago; read the queue more often, or raise the retention",
                self.me,
                n,
                queue,
                consumer,
                position,
                durations.short(retention),
            )
            self._unread[(queue, consumer)] = (0, position, now)

    async def _prune_records(
        self, term: int, retention: float, rounds: int, leadership: Leadership | None
    ) -> None:
        batch = self.settings.prune_batch
        totals: dict[str, int] = {}
        prune = transitions.prune_records
        for _ in range(rounds):
            done = await self.store.transact(prune, self.me, LEASE, term, retention, batch)
            for name, n in done.items():
                totals[name] = totals.get(name, 0) + n
            if leadership is not None:
                leadership.progress()
            if all(n < batch for n in done.values()):
                break
        if any(totals.values()):
            log.info(
                "supervisor %s (term %d) pruned old records: %s",
                self.me,
                term,
                ", ".join(f"{n} {name.replace('_', ' ')}" for name, n in totals.items() if n),
            )

    async def lead(self, leadership: Leadership) -> None:
        """The leader's loop: one sweep per interval, reporting progress so a stall gives up the lease.

        Progress is reported by work done: each committed batch, and a round that ended without
        an error. The wait after a sweep that failed (this process's pool cannot reach the store,
        while its lease connection can) counts towards ``stall_after`` (``sleep(failed=True)``):
        a leader that rescued nothing kept its lease for ever, since every wait marked progress
        (LEAD6)."""
        self._answering_since = None  # a term may begin as the store comes back from an outage
        while True:
            failed = False
            try:
                started = self.clock.monotonic()
                r = await self.sweep(leadership.term, leadership)
                self.on_sweep(r, self.clock.monotonic() - started)
                if self.clock.monotonic() >= self._next_prune:
                    self._next_prune = self.clock.monotonic() + self.settings.prune_every
                    await self.prune(leadership.term, leadership)
            except Exception as e:
                from .errors import LostOwnership

                if isinstance(e, LostOwnership):
                    log.warning("supervisor %s: %s", self.me, e)
                    return
                log.warning("supervisor %s: sweep failed: %r", self.me, e)
                failed = True
                self._answering_since = None
            else:
                leadership.progress()
            # After a round that worked, not a stall: an interval at or above the lease's
            # stall_after gave the lease up after every sweep (LEAD6 judges the sweeps, not the
            # wait between them). After one that failed, part of the stall.
            await leadership.sleep(self.settings.interval, failed=failed)
