"""Leader election on a fenced, expiring lease in the state store (LEAD1-LEAD7).

The lease is a row (name, holder, term, expires_at). Acquire and renew are single conditional
statements whose expiry is judged by the database clock (LEAD2). Locally the holder trusts its
lease only for ``ttl - margin`` seconds on its monotonic clock, counted from when the renewal was
*sent*, so a slow round trip or a paused process shortens trust rather than extending it. When a
renewal fails, the trust window runs out, or the leader's own work stops making progress, the work
is cancelled at once (LEAD3, LEAD6). Correctness never rests on this: every leader write is also
fenced by the term in SQL (LEAD4), so a paused ex-leader that wakes up changes nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from . import liveness
from .clock import STOPPED, SYSTEM_CLOCK, Clock, Outage, unless_stopped
from .errors import InputError
from .policies import check_seconds, show
from .stop_writes import StopWrites
from .store import Store

log = logging.getLogger("stepwarden.leader")
LOST = "renewal refused: the lease is lost"
MAX_FAILURE_PAUSE = 60.0  # seconds: the longest wait before campaigning again after failed work


@dataclass(frozen=True)
class LeaseSettings:
    """TTL is judged by the database; ``renew_every`` and ``retry_every`` are local pacing.

    Every duration is a finite number of seconds (not a bool or text) more than 0 and at most
    10**9 (about 31 years, :data:`~stepwarden.policies.MAX_SECONDS`), with ``margin`` below
    ``ttl`` and ``renew_every`` below ``ttl - margin`` (the holder renews while it still trusts
    its lease); ``take_from_dead`` is None or such a duration. Anything else raises
    :class:`~stepwarden.errors.InputError` naming the field.
    """

    ttl: float = 5.0
    renew_every: float = 1.0
    retry_every: float = 1.0
    margin: float = 1.0
    stall_after: float = 10.0
    # Seconds after which a holder presumed dead (see ``liveness``) may be replaced before its
    # lease expires; None (the default) always waits for expiry. Only for leases whose every
    # effect is a term-fenced store write (the supervisor's): an application's coroutine under
    # ``run_while_leader`` acts outside the store, so its lease must run out first (LEAD7).
    take_from_dead: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttl", "renew_every", "retry_every", "margin", "stall_after"):
            check_seconds(f"LeaseSettings.{name}", getattr(self, name), above=True)
        if self.take_from_dead is not None:
            check_seconds(
                "LeaseSettings.take_from_dead",
                self.take_from_dead,
                above=True,
                hint=" (or None, to wait for the lease to expire)",
            )
        if not self.margin < self.ttl:
            raise InputError(
                f"LeaseSettings.margin must be below ttl ({show(self.ttl)}), not {show(self.margin)}"
            )
        if not self.renew_every < self.ttl - self.margin:
            raise InputError(
                f"LeaseSettings.renew_every must be below ttl - margin ({show(self.ttl - self.margin)}),"
                f" not {show(self.renew_every)}"
            )


class Leadership:
    """What the leader's work sees: its term, and a way to say it is still making progress."""

    def __init__(
        self, name: str, holder: str, term: int, clock: Clock, *, trust: float | None = None
    ) -> None:
        self.name = name
        self.holder = holder
        self.term = term
        # Seconds a term is trusted after its acquire or renewal (ttl - margin): a fenced block's
        # session may not sit idle longer than this on PostgreSQL (see AppTransaction.fence).
        self.trust = trust
        self._clock = clock
        self.last_progress = clock.monotonic()
        # Local monotonic moment the term stops being trusted (None: not known, a Leadership made
        # by hand); the keeper moves it on each renewal and sets it to -inf when the term ends.
        self.trusted_until: float | None = None

    def trusted(self) -> bool:
        """Whether this process may still trust its term: its trust window (``ttl - margin`` from
        the last acquire or renewal it sent, on the local monotonic clock) has not run out and
        the keeper has not ended the term. Check it right before a side effect outside the
        database, which ``tx.fence`` cannot cover: a process paused past its window (GC,
        SIGSTOP) may run a slice of its work before the keeper cancels it, and this is False
        then. Not a lock (a pause may still fall between the check and the effect): pass
        ``term`` to whatever can check it where that matters."""
        return self.trusted_until is None or self._clock.monotonic() < self.trusted_until

    def trust_left(self) -> float | None:
        """Seconds left of the term's trust window (negative once it ran out); None when the
        keeper did not say (a Leadership made by hand)."""
        return None if self.trusted_until is None else self.trusted_until - self._clock.monotonic()

    def progress(self) -> None:
        self.last_progress = self._clock.monotonic()

    async def sleep(self, seconds: float, *, failed: bool = False) -> None:
        """Wait ``seconds`` between rounds without the wait counting as a stall (LEAD6): a loop
        that waits between its rounds is idle, not stuck, whatever ``stall_after`` is. The stall
        clock starts again when the sleep ends (the lease is still renewed meanwhile, and the
        sleep is cancelled with the work if the lease is lost).

        ``failed=True``: the round before the wait failed (an error the loop caught and logged),
        so the wait is not idle and counts towards ``stall_after``: a leader whose every round
        fails (its pool cannot reach the store while its lease connection can) gives the lease up
        ``stall_after`` after its last progress, for a process that can do the work. Without it,
        the wait after each failed round marked progress, and such a leader kept its lease for
        ever. The supervisor and the alert dispatcher pass it after a round that raised; a loop
        that reports nothing either way keeps the plain, idle wait."""
        seconds = max(0.0, float(seconds))
        if failed:
            await self._clock.sleep(seconds)
            return
        self.last_progress = max(self.last_progress, self._clock.monotonic() + seconds)
        try:
            await self._clock.sleep(seconds)
        finally:
            self.progress()


Work = Callable[[Leadership], Coroutine[Any, Any, None]]


class LeaseKeeper:
    """Runs ``work`` only while holding lease ``name``; see the module docstring."""

    def __init__(
        self,
        store: Store,
        name: str,
        holder: str,
        work: Work,
        *,
        settings: LeaseSettings | None = None,
        clock: Clock = SYSTEM_CLOCK,
        on_change: Callable[[str, int], None] | None = None,
        stop_writes: StopWrites | None = None,
    ) -> None:
        self.store = store
        self.name = name
        self.holder = holder
        self.work = work
        self.settings = settings or LeaseSettings()
        self.clock = clock
        self.on_change = on_change or (lambda what, term: None)
        # The worker's verdict on the store, which a failed renewal informs: a resignation while
        # stopping is then a brief try (the lease expires at its TTL if it is not written).
        self.stop_writes = stop_writes or StopWrites()
        self.term: int | None = None
        self.terms_held = 0
        self.failures = 0  # the work raised this many terms in a row: campaign again more slowly
        # A work that ignored its cancellation is left running; until it ends this process does
        # not campaign again, so that two runs of it never overlap here.
        self._stubborn: asyncio.Task[None] | None = None
        # The holder's heartbeat as this campaigner has read it, round after round: a step of the
        # database's clock must not make a live holder look dead (liveness.WATCH_SHARE).
        self._holder_beat = liveness.HeartbeatWatch()

    @property
    def is_leader(self) -> bool:
        return self.term is not None

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign, lead, lose, campaign again, until ``stop`` is set; resign on the way out (LEAD5)."""
        s = self.settings
        # The store down: one warning when the campaign's tries begin to fail and one line when
        # one goes through, as the roles' loops log an outage, not two warnings a retry period.
        outage = Outage(log, f"lease {self.name}: campaign", self.clock, every=s.retry_every)
        while not stop.is_set():
            if self._stubborn is not None and not self._stubborn.done():
                await self._wait(s.retry_every, stop=stop)
                continue
            failed = False
            try:
                sent = self.clock.monotonic()
                # Raced with ``stop``: an acquire stuck on a dead connection must not hold up a
                # shutdown (see _campaign).
                got = await self._campaign(self.store.acquire_lease(self.name, self.holder, s.ttl), stop)
            except Exception as e:  # the store is down: keep campaigning, never crash (REL3)
                outage.failed(e)
                failed, got = True, None
            if got is None and s.take_from_dead is not None and not stop.is_set():
                try:
                    sent = self.clock.monotonic()
                    got = await self._campaign(self._take_from_dead(s.take_from_dead), stop)
                except Exception as e:
                    if not failed:  # one failure per round, as one answer per round
                        outage.failed(e)
                    failed = True
            if not failed or got is not None:
                # Only a round whose every try went through, or that won the lease (a takeover
                # after a failed acquire: the store writes again): a store that reads but cannot
                # write (a full disk, a read-only standby) failed the acquire and answered the
                # takeover's read, and the outage was logged as ended and begun again each round.
                outage.answered()
            if got is None:
                await self._wait(s.retry_every, stop=stop)
                continue
            await self._lead(got[0], sent, stop)
            # Having just given the lease up (a stall, a lost renewal), let a healthier peer win it;
            # after work that keeps raising, wait longer each time (its errors are logged).
            await self._wait(self._pause(), stop=stop)

    async def _campaign(
        self, grant: Coroutine[Any, Any, tuple[int, float] | None], stop: asyncio.Event
    ) -> tuple[int, float] | None:
        """The lease, if ``grant`` (an acquire, a takeover) gets it before ``stop`` is set.

        Stopped while it waits (for a lock, a slow server), the grant is not abandoned: its
        transaction goes on in the store's thread and may still commit, and a lease granted
        then and never resigned held off every other keeper until its TTL (10 s measured, where
        a resignation lets one in within ``retry_every``). So it is waited for a little longer,
        a brief stop write's bound (1 s: a lock released, a slow commit, answer within it; a
        connection gone dark would hold the stop for nothing), and a lease it got is resigned
        at once. Past that, the grant is left to run out by its TTL."""
        job = asyncio.ensure_future(grant)
        try:
            got = await unless_stopped(asyncio.shield(job), stop)
        except BaseException:  # its error (raised here, retrieved), or the keeper cancelled
            job.cancel()
            raise
        if got is not STOPPED:
            return got
        try:
            late = await asyncio.wait_for(asyncio.shield(job), self.stop_writes.brief)
        except BaseException as e:  # no answer within the bound, no lease, or the keeper cancelled
            job.cancel()
            if isinstance(e, asyncio.CancelledError):
                raise
            return None
        if late is not None:
            log.info("lease %s: term %d granted as the keeper stopped; resigning it", self.name, late[0])
            await self._resign(late[0], stop)
        return None

    def _pause(self) -> float:
        """Seconds before campaigning again: ``retry_every``, doubled for each term in a row whose
        work raised, up to :data:`MAX_FAILURE_PAUSE` (or ``retry_every``, if that is longer)."""
        retry = self.settings.retry_every
        if not self.failures:
            return retry
        return float(min(retry * 2 ** min(self.failures - 1, 30), max(retry, MAX_FAILURE_PAUSE)))

    async def _take_from_dead(self, dead_after: float) -> tuple[int, float] | None:
        """Take the lease now if its holder is presumed dead, instead of waiting out its TTL."""
        from .store import transitions

        row = await self.store.transact(transitions.lease_holder, self.name)
        read = self.clock.monotonic()
        if row is None or row["id"] == self.holder:
            return None
        self._holder_beat.saw([row], read)
        verdicts = liveness.presumed_dead([row], float(row["now"]), dead_after)
        if not verdicts:
            return None
        doubt = self._holder_beat.doubt(verdicts[0], read, dead_after)
        if doubt is not None:
            log.debug("lease %s: not taking it from %s yet (%s)", self.name, row["id"], doubt)
            return None
        got = await self.store.transact(
            transitions.take_lease,
            self.name,
            self.holder,
            row["id"],
            int(row["term"]),
            self.settings.ttl,
            verdicts[0].silent_for,
        )
        if got is not None:
            log.warning(
                "lease %s: took term %d from %s, presumed dead (%s)",
                self.name,
                got[0],
                row["id"],
                verdicts[0].reason,
            )
        return got

    async def _lead(self, term: int, sent: float, stop: asyncio.Event) -> None:
        s = self.settings
        trust_until = sent + s.ttl - s.margin
        if self.clock.monotonic() >= trust_until:
            # The acquire's answer came after the window in which it may be trusted (a slow
            # commit, a lock it waited on): the lease may have expired already. The work never
            # starts on such a term, not even for a first slice (LEAD2).
            log.warning(
                "lease %s: term %d was acquired %.1fs ago, past the trust window; not leading on it",
                self.name,
                term,
                self.clock.monotonic() - sent,
            )
            await self._resign(term, stop)
            return
        self.term = term
        self.terms_held += 1
        ctx = Leadership(self.name, self.holder, term, self.clock, trust=s.ttl - s.margin)
        ctx.trusted_until = trust_until
        log.info("lease %s: %s leads with term %d", self.name, self.holder, term)
        self.on_change("acquired", term)
        try:
            work = self._start_work(ctx)
        except Exception as e:
            # Work that cannot start (it raised as it was called, or returned no coroutine: a
            # plain function) gives the term up and resigns, instead of leaving the lease held
            # to its TTL; the error is the caller's to see.
            self.term = None
            log.info(
                "lease %s: %s stops leading term %d: its work could not start: %r",
                self.name,
                self.holder,
                term,
                e,
            )
            await self._resign(term, stop)
            self.on_change("lost", term)
            raise
        reason = "stopped"
        try:
            while not stop.is_set():
                now = self.clock.monotonic()
                # Renew every renew_every, or at once when less trust than that is left (an
                # acquire or renewal answered late): waiting to the window's end renewed nothing,
                # and the term was given up with the store answering at once.
                wake = now + s.renew_every if now + s.renew_every < trust_until else now
                await self._wait(wake - now, work=work, stop=stop)
                if work.done():
                    exc = None if work.cancelled() else work.exception()
                    reason = f"leader work raised {exc!r}" if exc else "leader work returned"
                    break
                if stop.is_set():
                    break
                now = self.clock.monotonic()
                if now >= trust_until:
                    reason = "trust window ran out before a renewal succeeded"
                    break
                if now - ctx.last_progress > s.stall_after:
                    reason = f"leader work made no progress for {now - ctx.last_progress:.1f}s"
                    break
                sent = now
                ok = await self._renew(term, trust_until - now, stop)
                if ok is None and stop.is_set():
                    break  # stopped while the renewal was in flight: the work ends now (DEP4)
                if ok is None:
                    # An error, not a refusal: the lease may well still be ours. The work stops
                    # (LEAD3) and the lease is resigned, so that once the store answers again a
                    # keeper (this one too) takes it within a retry period, not at its expiry.
                    reason = "renewal failed"
                    break
                if not ok:
                    reason = LOST  # the database refused: someone else holds it now
                    break
                trust_until = sent + s.ttl - s.margin
                ctx.trusted_until = trust_until
        finally:
            self.term = None  # not trusted from here on, whatever the work does next
            ctx.trusted_until = float("-inf")
            work.cancel()
            keeper_cancelled = False
            try:
                await self._wait(s.ttl, work=work)  # for the cancelled work to end
            except asyncio.CancelledError:  # the keeper itself is being cancelled: resign first
                keeper_cancelled = True
            self._ended(work, term, reason)
            if reason != LOST:
                await self._resign(term, stop)
            self.on_change("lost", term)
            if keeper_cancelled:
                raise asyncio.CancelledError

    def _start_work(self, ctx: Leadership) -> asyncio.Task[None]:
        started = self.work(ctx)
        if not inspect.isawaitable(started):
            raise InputError(
                f"lease {self.name}: the leader work must be an async function of the Leadership;"
                f" {show(self.work)} returned {show(started)}"
            )
        return asyncio.ensure_future(started)

    def _ended(self, work: asyncio.Task[None], term: int, reason: str) -> None:
        """Log how the term's work ended; count the terms in a row whose work raised."""
        log.info("lease %s: %s stops leading term %d: %s", self.name, self.holder, term, reason)
        if not work.done():
            self._stubborn = work
            work.add_done_callback(lambda t: t.cancelled() or t.exception())  # its end, retrieved
            log.error(
                "lease %s: the leader work of term %d has not ended %gs after it was cancelled (it"
                " swallows CancelledError?); it is left running, and this process campaigns again"
                " only once it ends",
                self.name,
                term,
                self.settings.ttl,
            )
            return
        exc = None if work.cancelled() else work.exception()
        if exc is None:
            self.failures = 0
            return
        self.failures += 1
        log.error(
            "lease %s: the leader work of term %d raised (%d term(s) in a row); campaigning again in %gs",
            self.name,
            term,
            self.failures,
            self._pause(),
            exc_info=exc,
        )

    async def _renew(self, term: int, budget: float, stop: asyncio.Event) -> bool | None:
        """Renew, giving up when the trust window ends (measured on our Clock, not the loop's)
        or ``stop`` is set: True renewed, False refused (the lease is someone else's), None failed
        (an error, no answer within the window, or a stop) with the lease perhaps still ours.
        A stop is not kept waiting for the renewal: a store that hung kept the leader's work
        running up to the end of its trust window after SIGTERM."""
        renewal = asyncio.create_task(self.store.renew_lease(self.name, self.holder, term, self.settings.ttl))
        timer = asyncio.create_task(self.clock.sleep(max(0.0, budget)))
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({renewal, timer, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            stopping.cancel()
        if not renewal.done() and stop.is_set():
            renewal.cancel()
            log.info("lease %s: stopping with a renewal in flight; it is abandoned", self.name)
            return None
        if not renewal.done():
            renewal.cancel()
            log.warning("lease %s: renewal still pending when the trust window ended", self.name)
            self.stop_writes.failed()
            return None
        try:
            renewed = bool(renewal.result())
        except Exception as e:
            log.warning("lease %s: renewal failed: %r", self.name, e)
            self.stop_writes.failed()
            return None
        self.stop_writes.answered()
        return renewed

    async def _resign(self, term: int, stop: asyncio.Event) -> None:
        """Resign, bounded. While running on, with the full bound: the resignation is what lets
        a keeper take the lease within a retry period rather than at its expiry, and a store that
        is merely slow (a renewal that ran late) still takes it. Once stopping, the bound is the
        worker's stop-write verdict (a brief try if the store was found not answering), so that a
        server that is down does not hold the stop for the full bound."""
        try:
            resign = self.store.resign_lease(self.name, self.holder, term)
            if stop.is_set():
                await self.stop_writes.write(resign)
            else:
                await asyncio.wait_for(resign, self.stop_writes.full)
        except Exception as e:
            log.warning("lease %s: resign failed (it will expire): %r", self.name, e)

    async def _wait(
        self, seconds: float, *, work: asyncio.Task[None] | None = None, stop: asyncio.Event | None = None
    ) -> None:
        """Wait ``seconds`` on our Clock, or less: until ``work`` ends or ``stop`` is set."""
        sleeper = asyncio.create_task(self.clock.sleep(max(0.0, seconds)))
        stopper = None if stop is None else asyncio.create_task(stop.wait())
        try:
            await asyncio.wait(
                {sleeper, *(t for t in (work, stopper) if t is not None)}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            sleeper.cancel()
            if stopper is not None:
                stopper.cancel()


def check_leader_arguments(
    name: object, holder: object, work: object, stop: object, settings: object
) -> None:
    """:class:`InputError` for a bad argument of :func:`run_while_leader`, before anything is
    opened or written (``App.run_while_leader`` checks them before it opens its store)."""
    from .workflow import check_key, check_name

    check_name("lease name", name)
    check_key("lease holder", holder)
    if not callable(work):
        raise InputError(f"work must be an async function of the Leadership, not {show(work)}")
    if not isinstance(stop, asyncio.Event):
        raise InputError(f"stop must be an asyncio.Event, not {show(stop)}")
    if settings is not None and not isinstance(settings, LeaseSettings):
        raise InputError(f"settings must be LeaseSettings or None, not {show(settings)}")


async def run_while_leader(
    store: Store,
    name: str,
    holder: str,
    work: Work,
    stop: asyncio.Event,
    *,
    settings: LeaseSettings | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> None:
    """Run ``work`` whenever this process holds lease ``name``, cancelled the moment it may not (LEAD7).

    A bad argument raises :class:`InputError` before campaigning, writing nothing (a work that
    returns no awaitable, which only calling it tells, is refused when its first term starts:
    the term is given up and the lease resigned)."""
    if not isinstance(store, Store):
        raise InputError(f"store must be a stepwarden Store (App.store), not {show(store)}")
    check_leader_arguments(name, holder, work, stop, settings)
    await LeaseKeeper(store, name, holder, work, settings=settings, clock=clock).run(stop)
