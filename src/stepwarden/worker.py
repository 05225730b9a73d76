"""A worker process: any mix of the three roles over one store, stopped gracefully (DEP4).

Identity is per incarnation (DESIGN principle 4): ``NAME:PID:RANDOM``, so a restarted process
never inherits the claims or lease of its predecessor.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from . import tracing
from .agent import Agent, AgentRole, AgentSettings
from .alerts import ALERT_LEASE, AlertDispatcher, AlertSettings
from .clock import STOPPED, Outage, Stopped, sleep_or_wake, unless_stopped
from .errors import InputError, StoreError, StoreMisconfigured, StoreUnreachable
from .fleet import FleetCheck
from .leader import LeaseKeeper, LeaseSettings
from .logs import log_raised
from .policies import check_count, check_seconds, show
from .scheduler import SchedulerRole, SchedulerSettings
from .stop_writes import StopWrites
from .store import ApplyResult, SQLiteStore, Store, SweepResult, open_store
from .store.agents import hand_back_dispatched
from .store.base import WORK_CHANNELS, redact_url
from .supervisor import LEASE, Supervisor, SupervisorSettings
from .workflow import check_ident

# How long a stopping worker's transactions wait for a lock (SQLite's write lock held elsewhere).
STOP_LOCK_WAIT = 2.0
# Attempts handed back per transaction by a stopping worker (see Worker._hand_back): bounded, so
# a scheduler leaving a large backlog of queued requests never writes it in one huge transaction.
HAND_BACK_BATCH = 500
# Seconds between a starting worker's tries to record its workflows while the store fails.
REGISTER_RETRY_MIN = 0.5
REGISTER_RETRY_MAX = 10.0
# A store that still cannot be opened is warned about again after this long, then as often: a
# mistyped host or port waits for ever (as a database not up yet must), and the one warning at
# the start had scrolled away.
OPEN_STILL_FAILING_EVERY = 300.0
# A first try to open the store that has not returned after this long (wall clock: the driver's
# own wait) is warned about while it goes on.
OPEN_SLOW_AFTER = 2.0

if TYPE_CHECKING:
    from .app import App
    from .metrics import WorkerMetrics

log = logging.getLogger("stepwarden.worker")
ROLES = ("scheduler", "agent", "supervisor")
T = TypeVar("T")


def make_identity(name: str | None = None) -> str:
    base = name or socket.gethostname().split(".")[0] or "worker"
    base = "".join(c if c.isalnum() or c in "_-" else "-" for c in base)[:64] or "worker"
    return f"{base}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker process runs, and how.

    ``roles`` and ``agents`` are sequences of names (``("scheduler", "agent")``); a name given
    twice counts once. Plain text is refused, even one name: ``roles="scheduler"`` was read as
    the roles 's', 'c', 'h', ...; the comma-separated form belongs to the command line, which
    splits ``--roles``/``--agents`` with :func:`parse_list` before it makes these settings.
    ``concurrency`` is None or an int from 1 to 10000; ``name`` a worker name (see
    :func:`make_identity`); ``heartbeat`` a finite number of seconds more than 0 and at most half
    the supervisor's ``dead_after``; ``scheduler``, ``agent``, ``supervisor``, ``lease`` and
    ``alerts`` are the settings classes of those parts. Anything else raises
    :class:`~stepwarden.errors.InputError` naming the field.
    """

    roles: tuple[str, ...] = ROLES
    agents: tuple[str, ...] | None = None
    concurrency: int | None = None
    name: str | None = None
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    supervisor: SupervisorSettings = field(default_factory=SupervisorSettings)
    lease: LeaseSettings = field(default_factory=LeaseSettings)
    alerts: AlertSettings = field(default_factory=AlertSettings)
    heartbeat: float = 1.0

    def __post_init__(self) -> None:
        # A name given twice (``--roles scheduler,scheduler``) means it once; heartbeats, logs and
        # the dashboard then show each role and agent once.
        object.__setattr__(self, "roles", _names("roles", self.roles, "role"))
        if self.agents is not None:
            object.__setattr__(self, "agents", _names("agents", self.agents, "agent"))
        bad = [r for r in self.roles if r not in ROLES]
        if bad or not self.roles:
            shown = ", ".join(repr(r)[:40] for r in bad) or "(none)"
            raise InputError(f"unknown role(s) {shown}: choose from {', '.join(ROLES)}")
        if self.agents is not None and not self.agents:
            raise InputError("--agents names no agent: give a comma-separated list, or leave it out for all")
        if self.agents is not None and "agent" not in self.roles:
            # Ignored, it said the worker would run agents it did not (found by review).
            raise InputError(
                f"--agents {','.join(self.agents)} needs the agent role: add agent to --roles"
                f" ({','.join(self.roles)}), or leave --agents out"
            )
        if self.concurrency is not None:
            count = check_count("WorkerSettings.concurrency", self.concurrency, high=10_000)
            object.__setattr__(self, "concurrency", count)
        if self.name is not None:
            check_ident("worker name", self.name)
        for part, kind in _PARTS.items():
            value = getattr(self, part)
            if not isinstance(value, kind):
                raise InputError(f"WorkerSettings.{part} must be {kind.__name__}, not {show(value)}")
        check_seconds("WorkerSettings.heartbeat", self.heartbeat, above=True)
        if not 2 * self.heartbeat <= self.supervisor.dead_after:
            raise InputError(
                "WorkerSettings.heartbeat must be at most half the supervisor's dead_after"
                f" ({show(self.supervisor.dead_after)} s), not {show(self.heartbeat)}"
            )


# The settings of a worker's parts, by field: each must be its class (a dict of its fields was
# taken, and failed later with an AttributeError).
_PARTS: dict[str, type] = {
    "scheduler": SchedulerSettings,
    "agent": AgentSettings,
    "supervisor": SupervisorSettings,
    "lease": LeaseSettings,
    "alerts": AlertSettings,
}


def _names(field: str, value: object, kind: str) -> tuple[str, ...]:
    """``roles`` or ``agents`` as a tuple of names, each once, in the order given. Text is refused,
    not split into letters; so is what is not a collection of text (a number, None, bytes)."""
    if isinstance(value, str):
        split = parse_list(value)
        how = f": write {show(split)}, as --{field} reads it (worker.parse_list)" if split else ""
        raise InputError(
            f"WorkerSettings.{field} must be a sequence of {kind} names, not the text {show(value)}{how}"
        )
    names = tuple(value) if isinstance(value, Iterable) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise InputError(
            f"WorkerSettings.{field} must be a sequence of {kind} names (text), not {show(value)}"
        )
    return tuple(dict.fromkeys(names))


class Worker:
    """Runs the chosen roles of ``app`` until ``stop`` is set.

    ``db`` is a store URL to run on instead of the app's own store (``stepwarden --db``): ``run``
    opens it and points the app at it. Without it, the worker runs on ``app.store``.
    """

    def __init__(self, app: App, settings: WorkerSettings | None = None, *, db: str | None = None) -> None:
        self.app = app
        self.settings = s = settings or WorkerSettings()
        self.identity = make_identity(s.name)
        self.db = db
        # What set ``stop``, when whoever set it says so (the command line: the signal's name), for
        # the line that says the worker stopped before it could start.
        self.stopped_by: str | None = None
        # Task spans for the replies a round applies: made by run(), on the store it runs on. Not
        # here: ``app.store`` would open the app's store, not the one ``db`` names (creating
        # stepwarden.db in the working folder), before the command line has refused or accepted
        # the command, and on the event loop, where a stop signal cannot end a wait for its lock.
        self._spans: tracing.Tracer | tracing.NoTracer = tracing.NoTracer()
        app.check_operations()  # every definition made by now, whatever their order
        self.agents = self._agents()
        self.wake = asyncio.Event()
        self.scheduler: SchedulerRole | None = None
        self.agent_role: AgentRole | None = None
        self.metrics: WorkerMetrics | None = None  # set by `worker --metrics-port`
        self.supervisor: Supervisor | None = None
        self.keeper: LeaseKeeper | None = None
        self.alert_dispatcher: AlertDispatcher | None = None
        self.alert_keeper: LeaseKeeper | None = None
        # How long each write of the stop waits: the full bound, or a brief try once the store was
        # found not answering (by the heartbeat, the agent loop, a lease renewal or an earlier
        # stop write).
        self.stop_writes = StopWrites()

    def _agents(self) -> dict[str, Agent]:
        s = self.settings
        if "agent" not in s.roles:
            return {}
        names = s.agents if s.agents is not None else tuple(self.app.agents)
        unknown = [n for n in names if n not in self.app.agents]
        if unknown:
            raise InputError(
                f"unknown agent(s) {', '.join(unknown)}; "
                f"the app defines: {', '.join(self.app.agents) or 'none'}"
            )
        out = {}
        for n in names:
            a = self.app.agents[n]
            if s.concurrency is not None:
                a = replace(a, concurrency=s.concurrency)  # every other field as the app defined it
            out[n] = a
        return out

    async def run(self, stop: asyncio.Event) -> bool:
        """Open the store, record the app's workflows, then run the roles until ``stop`` is set and
        stop them gracefully (DEP4). Whether it started: False if ``stop`` came while it opened
        (and migrated) the store or recorded its workflows. Either can wait long for the store
        (another process's lock, a server that does not answer yet, another session's
        migration), and neither is waited out once ``stop`` is set: ``run`` then returns at once,
        having taken no work and left nothing half-done (each is one transaction, committed
        whole or not at all). An opening still in progress is left to its daemon thread; a
        process that stops there may exit without waiting for it. An error opening the store
        (a bad URL, a missing folder) is raised."""
        s = self.settings
        app = self.app
        clock = app.clock
        store = await self._open(stop)
        if store is None:
            self._not_started("opening the store")
            return False
        self._spans = tracing.tracer(self.identity, store)
        if not await self._register_workflows(store, stop):
            self._not_started("recording its workflows in the store")
            return False
        try:
            await self._beat()
        except Exception as e:
            _refuse_what_no_wait_heals(e)
            log.warning("worker: could not %s: %r", "record its heartbeat", e)
        log.info(
            "worker %s starting: roles=%s agents=%s store=%s",
            self.identity,
            ",".join(s.roles),
            ",".join(self.agents) or "-",
            redact_url(store.url),
        )
        jobs: list[asyncio.Task[None]] = []
        m = self.metrics
        if "scheduler" in s.roles:
            self.scheduler = SchedulerRole(
                store,
                self.identity,
                clock=clock,
                settings=s.scheduler,
                wake=self.wake,
                on_applied=self._applied,
            )
            jobs.append(asyncio.create_task(self.scheduler.run(stop), name="scheduler"))
        if self.agents:
            agent_settings = replace(s.agent, apply_replies="scheduler" in s.roles)
            self.agent_role = AgentRole(
                store,
                self.agents,
                self.identity,
                clock=clock,
                settings=agent_settings,
                on_reply=self.wake.set,
                on_applied=m.applied if m else None,
                on_attempt=m.attempt_finished if m else None,
                stop_writes=self.stop_writes,
            )
            jobs.append(asyncio.create_task(self.agent_role.run(stop), name="agent"))
            if self.scheduler is not None:
                self.scheduler.local = self.agent_role  # rounds hand requests to our own agents
        if "supervisor" in s.roles:
            self.supervisor = Supervisor(
                store, self.identity, clock=clock, settings=s.supervisor, on_sweep=self._swept
            )
            self.keeper = LeaseKeeper(
                store,
                LEASE,
                self.identity,
                self.supervisor.lead,
                settings=replace(s.lease, take_from_dead=s.supervisor.dead_after),
                clock=clock,
                on_change=m.lease_changed if m else None,
                stop_writes=self.stop_writes,
            )
            jobs.append(asyncio.create_task(self.keeper.run(stop), name="supervisor"))
        if app.alert_sinks and s.alerts.enabled:
            # One process at a time delivers alerts, among those whose app configures sinks (OPS4).
            self.alert_dispatcher = AlertDispatcher(
                store, app.alert_sinks, self.identity, clock=clock, settings=s.alerts
            )
            await _safe(self.alert_dispatcher.register(), "register as an alert dispatcher")
            self.alert_keeper = LeaseKeeper(
                store,
                ALERT_LEASE,
                self.identity,
                self.alert_dispatcher.lead,
                settings=s.lease,
                clock=clock,
                stop_writes=self.stop_writes,
            )
            jobs.append(asyncio.create_task(self.alert_keeper.run(stop), name="alerts"))
        # The heartbeat outlives ``stop``: while the agents drain and release their attempts the
        # worker is alive, and must not look dead to the supervisor (see liveness).
        beats_stop = asyncio.Event()
        beats = asyncio.create_task(self._heartbeat(beats_stop), name="heartbeat")
        jobs.append(asyncio.create_task(store.listen(self._woken, stop, WORK_CHANNELS), name="listen"))
        jobs.append(asyncio.create_task(_bound_lock_waits(store, stop), name="stop-waits"))
        if isinstance(store, SQLiteStore):
            jobs.append(asyncio.create_task(_watch_store_file(store, stop, s.heartbeat), name="store-file"))
        # Its own task, not the heartbeat's: its reads wait on the roles' lane of the store, and
        # a beat held behind them made a busy worker look dead (found by review).
        jobs.append(
            asyncio.create_task(FleetCheck(store, self.app.clock, self.identity).run(stop), name="fleet")
        )
        try:
            done, _ = await asyncio.wait(jobs, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
            if failed:
                raise failed[0]  # type: ignore[misc]
        finally:
            stop.set()
            store.limit_lock_waits(STOP_LOCK_WAIT)
            # The agent role is the slowest to stop (its drain); the other roles end sooner.
            await asyncio.wait(jobs, timeout=s.agent.stop_within + 1)
            # Read every job's error: the first is raised, and the others (several roles meet the
            # same StoreMisconfigured) were logged at exit as "Task exception was never retrieved",
            # with a traceback each (found by CI).
            for t in jobs:
                if t.done() and not t.cancelled():
                    t.exception()
            # Each write bounded (StopWrites): a database that stopped answering must not hold
            # the process past its stop. What is not handed back is then taken by another
            # worker's agent, or rescued at complete-by; without the stop record, the worker is
            # taken for dead when its heartbeats stop.
            if self.scheduler is not None or self.supervisor is not None:
                await _safe(self.stop_writes.write(self._hand_back()), "hand back the attempts it dispatched")
            beats_stop.set()
            await asyncio.wait([beats], timeout=self.stop_writes.bound)
            stopped = store.worker_beat(self.identity, s.roles, list(self.agents), stopped=True)
            await _safe(self.stop_writes.write(stopped), "record its stop")
            if self.alert_dispatcher is not None:
                self.alert_dispatcher.close()
            if self.stop_writes.missed:
                # One line that says what the warnings above add up to, and what happens next.
                log.warning(
                    "worker %s stopped, the store not answering: %d of its stop writes were given up;"
                    " what it held is taken back as a dead worker's is (once its heartbeat is %gs old,"
                    " at its attempts' complete-by, at its leases' TTL)",
                    self.identity,
                    self.stop_writes.missed,
                    s.supervisor.dead_after,
                )
            else:
                log.info("worker %s stopped", self.identity)
        return True

    def _not_started(self, during: str) -> None:
        """The one line of a start cut short by ``stop``, whichever wait it cut: an operator who
        sent the signal learns the worker took no work, and where it was."""
        by = f" by {self.stopped_by}" if self.stopped_by else ""
        log.info(
            "worker %s stopped%s before it could start (while %s); it took no work", self.identity, by, during
        )

    async def _open(self, stop: asyncio.Event) -> Store | None:
        """The store, opened and migrated, or None if ``stop`` came first. Opening may wait long
        (for SQLite's write lock, up to the busy timeout, before the migration; for a PostgreSQL
        server that does not answer yet, or another session's migration), in the driver, where
        nothing can interrupt it: so it runs in a thread, the event loop free meanwhile (the
        signal handlers that set ``stop`` run on it), and is not waited for once ``stop`` is set.
        The store's own waits stay what they are for everyone else."""
        if stop.is_set():  # stopped before it began: nothing to open, nor to create
            return None
        delay, since = REGISTER_RETRY_MIN, self.app.clock.monotonic()
        failed = 0
        warn_again = since + OPEN_STILL_FAILING_EVERY
        while True:
            try:
                opened = await self._try_open(stop, first=failed == 0)
            except StoreUnreachable as e:
                # A server down or restarting, a file another process keeps locked: waited out
                # with back-off, as every role waits out a failing store (REL3). Exiting, the
                # worker of a fleet started before its database crash-looped under a service
                # manager that restarts it. A store that refuses (no such database, a schema
                # newer than this code, a bad URL) is still raised at once.
                failed += 1
                if failed == 1:
                    log.warning(
                        "worker %s: cannot open the store yet, trying again with back-off (up to"
                        " %gs), logged again when it opens: %s",
                        self.identity,
                        REGISTER_RETRY_MAX,
                        e,
                    )
                elif self.app.clock.monotonic() >= warn_again:
                    log.warning(
                        "worker %s: still cannot open the store after %.0fs (%d tries), trying"
                        " again every %gs: %s",
                        self.identity,
                        self.app.clock.monotonic() - since,
                        failed,
                        REGISTER_RETRY_MAX,
                        e,
                    )
                    warn_again = self.app.clock.monotonic() + OPEN_STILL_FAILING_EVERY
                else:
                    log.debug("worker %s: still cannot open the store: %s", self.identity, e)
                await sleep_or_wake(self.app.clock, delay, stop)
                delay = min(delay * 2, REGISTER_RETRY_MAX)
                if stop.is_set():
                    return None
                continue
            break
        if opened is STOPPED:
            return None
        if failed:
            log.info(
                "worker %s: the store answers, opened after %.1fs (%d failed tries)",
                self.identity,
                self.app.clock.monotonic() - since,
                failed,
            )
        log.info("worker %s on %s", self.identity, redact_url(opened.url))
        return opened

    async def _try_open(self, stop: asyncio.Event, *, first: bool) -> Store | Stopped:
        """One try to open the store (:data:`STOPPED` if ``stop`` came first). A ``first`` try
        still waiting after :data:`OPEN_SLOW_AFTER` is warned about: it waits in the driver
        (SQLite's busy timeout, 30 s; a server's connect timeout, 10 s) before it fails, and
        the worker, silent until then, looked hung (found by review)."""
        opening = asyncio.ensure_future(
            unless_stopped(_in_daemon_thread(self._open_store, "stepwarden-open"), stop)
        )
        try:
            if first:
                await asyncio.wait({opening}, timeout=OPEN_SLOW_AFTER)
                if not opening.done():
                    sqlite = (self.db or self.app.url).startswith("sqlite:")
                    log.warning(
                        "worker %s: the store has not answered for %gs (%s); still waiting",
                        self.identity,
                        OPEN_SLOW_AFTER,
                        "another process holds the SQLite file's lock"
                        if sqlite
                        else "the server does not answer yet",
                    )
            return await opening
        except BaseException:
            # Cancelled itself (``run`` under a caller's timeout): the try is abandoned with it,
            # not left to fail later as a task nobody awaits.
            if not opening.done():
                opening.cancel()
            raise

    def _open_store(self) -> Store:
        """In the opening thread: ``db``'s store, which the app then uses, or the app's own."""
        if self.db is None:
            return self.app.store
        store = open_store(self.db, clock=self.app.clock)
        self.app.use_store(store)
        return store

    async def _register_workflows(self, store: Store, stop: asyncio.Event) -> bool:
        """Record the app's workflows (``submit`` without ``--app`` checks against them): the
        worker's first transaction. A store that is down or locked just then (a server
        restarting, another process's long write) is waited out with back-off on the app's
        Clock, as every role waits out a failing store later (REL3), instead of ending the
        process, which a service manager that restarts it would turn into a crash loop. False if
        ``stop`` came first, while a try waits for the store too: that try is not waited for
        (its lock wait is bounded to ``STOP_LOCK_WAIT``, and it commits whole or not at all), so
        a worker stopped while starting stops at once."""
        delay = REGISTER_RETRY_MIN
        while not stop.is_set():
            recording = store.register_workflows(list(self.app.workflows.values()), self.identity)
            try:
                done = await unless_stopped(recording, stop)
            except Exception as e:
                _refuse_what_no_wait_heals(e)
                log.warning(
                    "worker %s: cannot record its workflows in the store yet, trying again in %gs: %s",
                    self.identity,
                    delay,
                    e,
                )
                await sleep_or_wake(self.app.clock, delay, stop)
                delay = min(delay * 2, REGISTER_RETRY_MAX)
                continue
            if done is STOPPED:
                store.limit_lock_waits(STOP_LOCK_WAIT)  # the try left waiting in its thread
                return False
            return not stop.is_set()
        return False

    def hurry(self) -> None:
        """A second stop signal: skip what is left of the agents' grace period. The calls still
        running are cancelled and their attempts handed back at once (not counted as failures),
        as at the end of the grace period; the rest of the stop is as usual, bounded: the last
        replies applied, the dispatched attempts handed back, the leases resigned, the stop
        recorded. Says so in one log line; a third signal changes nothing more."""
        role = self.agent_role
        if role is None:
            log.warning("worker %s: stop signal again: it runs no calls to cancel; stopping", self.identity)
        elif role.hurry():
            log.warning(
                "worker %s: stop signal again: skipping the rest of the grace period, cancelling %d running"
                " call(s) now and handing their attempts back",
                self.identity,
                len(role.tasks),
            )

    async def _hand_back(self) -> None:
        """Hand back, uncounted, the attempts this worker dispatched that no agent has taken: once
        every role has stopped, so nothing dispatches after it (DEP4).

        Its roles still dispatch while they stop: the agents' last replies are applied (their
        results must be durable) and start the next steps, a scheduler round or a supervisor
        sweep in flight commits. Its own agents take nothing by then, so with no other live
        instance of the agent such a request would wait, its task and step locked by this gone
        identity, until its complete-by, and then count as a failed attempt. Handed back, the
        task is claimable at once by the next scheduler (see ``store.agents.hand_back_dispatched``).
        Repeated until a transaction finds nothing: applying the releases can apply replies
        waiting in the table, which dispatch again."""
        store = self.app.store
        why = f"dispatched by worker {self.identity}, which stopped before an agent took it"
        handed = 0
        while True:
            done = await store.transact(hand_back_dispatched, self.identity, why, HAND_BACK_BATCH, store.rng)
            handed += done.handed
            if done.applied is not None:
                log_raised(log, done.applied.alerts)
                self._applied(done.applied)
            if not done.found:
                break
        if handed:
            log.info("worker %s: handed back %d attempt(s) no agent had taken", self.identity, handed)

    def _applied(self, result: ApplyResult) -> None:
        """Replies applied outside the agent role (a scheduler round, the hand-back on the way
        out): the task spans they end and the metrics they count."""
        self._spans.applied(result)
        if self.metrics is not None:
            self.metrics.applied(result)

    def _swept(self, result: SweepResult, seconds: float) -> None:
        """A sweep of this process's supervisor: the task spans of the tasks it ended (an attempt
        past complete-by that used up its retries; they had none, found by review) and its metrics."""
        self._spans.applied(result)
        if self.metrics is not None:
            self.metrics.swept(result, seconds)

    def _woken(self, channel: str) -> None:
        """A database notification: new work may be waiting, so poll now instead of at the next tick."""
        if channel in ("stepwarden_tasks", "stepwarden_replies"):
            self.wake.set()
        if channel == "stepwarden_requests" and self.agent_role is not None:
            self.agent_role.wake.set()

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        # An outage is logged twice, as the roles' loops log it, not once a beat (a line a
        # second through a pooler that answers at once).
        every = self.settings.heartbeat
        outage = Outage(log, f"worker {self.identity}: heartbeat", self.app.clock, every=every)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=every)
            except TimeoutError:
                try:
                    await self._beat()
                except StoreMisconfigured:
                    return  # each role's next round meets it too, and ends the worker with it
                except Exception as e:
                    outage.failed(e)
                    self.stop_writes.failed()
                else:
                    outage.answered()
                    self.stop_writes.answered()

    async def _beat(self) -> None:
        breakers: dict[str, str] = (
            {n: b.state for n, b in self.agent_role.breakers.items()} if self.agent_role else {}
        )
        role = self.agent_role
        await self.app.store.worker_beat(
            self.identity,
            self.settings.roles,
            list(self.agents),
            breakers=breakers,
            load=role.load() if role is not None else None,  # agent instances (AGT6)
        )
        if role is not None:
            role.health.flush_successes()


def _in_daemon_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """``fn()`` in a daemon thread of its own, as a future of the running loop: cancelling the
    future abandons the call to its thread. Not ``asyncio.to_thread``: ``asyncio.run`` waits for
    the default executor's threads when it ends, so a call abandoned at a stop (a wait for a lock,
    for a server) would still hold the process; a daemon thread does not."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():  # else abandoned: the caller stopped waiting
            outcome()

    def call() -> None:
        outcome: Callable[[], None]
        try:
            outcome = functools.partial(future.set_result, fn())
        except BaseException as e:  # raised again where the future is awaited, as it came
            outcome = functools.partial(future.set_exception, e)
        with contextlib.suppress(RuntimeError):  # the loop has closed: no one is waiting
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=call, name=name, daemon=True).start()
    return future


async def _bound_lock_waits(store: Store, stop: asyncio.Event) -> None:
    """Once stopping, nothing waits long for a lock, the waits in progress included: a store that
    another process keeps locked must not hold the roles (each transaction a busy_timeout) and so
    the worker past its stop. What it then cannot write (released attempts, the stop record) is
    the supervisor's to rescue, as for a worker that died."""
    await stop.wait()
    store.limit_lock_waits(STOP_LOCK_WAIT)


async def _watch_store_file(store: SQLiteStore, stop: asyncio.Event, every: float) -> None:
    """Stop the worker (a :class:`StoreError`, exit 1 from the command line) once its SQLite file
    is deleted or replaced: its connections stay on the file it opened, and it went on working
    there, silently, where no other process looks. Started again, it opens the file now at the
    path; a service manager that restarts it does that."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every)
        why = store.replaced()
        if why is not None and not stop.is_set():
            raise StoreError(
                f"{why}: this worker's connections are on the file it opened, and it stops. The -wal"
                " and -shm files at the path belong to that file: stop every process that uses the"
                " store (applications too) before starting any again, or the file now at the path"
                " may be damaged"
            )


def _refuse_what_no_wait_heals(e: BaseException) -> None:
    """Raise a store no wait heals (:class:`StoreMisconfigured`: a database role that may not
    write, a pooler the URL does not name, an SQLite file opened read-only): the worker exits 1
    with its line. Waited out as an outage, a worker without the grants warned every 10 s for
    ever and never did any work (found by review)."""
    if isinstance(e, StoreMisconfigured):
        raise e


async def _safe(coro: object, what: str) -> bool:
    """Whether ``coro`` went through; a failure is logged (``what`` it could not do), not raised."""
    try:
        await coro  # type: ignore[misc]
    except Exception as e:
        log.warning("worker: could not %s: %r", what, e)
        return False
    return True


def parse_list(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    return tuple(x.strip() for x in text.split(",") if x.strip())


__all__: Sequence[str] = ["ROLES", "Worker", "WorkerSettings", "make_identity", "parse_list"]
