"""One worker's side of agent health: its mirror of the shared breakers, and its own health.

The truth is in the store (``store/agents.py``, where the rules are explained): one circuit breaker
per agent shared by every instance, and one health row per agent instance. This module keeps what
an instance needs between two transactions -- the breaker states it last read, whether it holds a
half-open trial, whether it is itself unhealthy and when to probe -- and turns the store's answers
(seconds on the database clock) into moments on the local monotonic clock.

Why not a breaker library: pybreaker, aiobreaker, circuitbreaker and purgatory keep the state in the
process (or in Redis); here it must live in the one thing the instances share, the store, and
change by conditional statements so that exactly one instance opens it and raises the alert, and
exactly one runs the half-open trial. That is a few SQL statements, not a library's job.

Successes are the common case, so they are written lazily: at once only when they change something
(the instance or the breaker has failures counted, a trial, a probe), otherwise at most once per
``success_every`` seconds in the background, so that ``last_success_at`` stays fresh enough for the
others to tell "the service is up, only I fail" from "the service is down".

A half-open trial's verdict is the one report that must not be lost: the store's breaker waits
for it (state ``half_open``, ``trial_by`` this instance) and no instance pulls the agent's
requests until ``trial_ttl`` (60 s) passes. So a trial verdict (the call answered, it failed, or
the trial is given back unrun) is kept until the store has recorded it, and written again with
back-off until the store answers, or the worker stops (see :meth:`AgentHealth._repay`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .clock import Clock
from .policies import BreakerState
from .store import RequestMsg, Store
from .store import agents as sa

if TYPE_CHECKING:
    from .agent import Agent, AgentSettings

log = logging.getLogger("stepwarden.agent")

# How often a trial verdict the store did not record is written again: after REPAY_FIRST seconds,
# doubling up to REPAY_MAX. The store's outage is short or long; a write every few seconds
# costs nothing, and the breaker closes within REPAY_MAX of the store's return, well within the
# trial_ttl the others would otherwise wait.
REPAY_FIRST = 0.25
REPAY_MAX = 4.0


async def guard(work: Awaitable[None], agent: str) -> None:
    """Await ``work``, a piece of health bookkeeping: its failure is logged, not raised (the
    store's troubles are handled where it is written, see :meth:`AgentHealth._send`)."""
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.warning("agent %s: health bookkeeping failed: %r", agent, e)


@dataclass
class BreakerMirror:
    """This instance's copy of one agent's shared breaker, as last read from the store."""

    state: BreakerState = "closed"
    failures: int = 0  # consecutive failures counted by the store, across instances
    retry_at: float = 0.0  # local monotonic moment when a trial may be claimed
    trial: bool = False  # this instance holds the half-open trial
    opened_by: str | None = None
    local_failures: int = 0  # failures this instance could not report (store unreachable)

    def rejecting(self) -> bool:
        """Calls fail fast: the breaker is open or half-open. Also on the instance that holds the
        trial: the trial is ONE call, its request's first try, which does not ask (see
        ``agent_attempt.py``). The other attempts running here, in their retry loop, must not
        reach the service while it runs: their calls would be counted as no trial, and the
        service, maybe still down, would get a burst instead of one call."""
        return self.state != "closed"

    def update(self, view: sa.BreakerView | None, now: float) -> None:
        if view is None:
            return
        self.state = view.state if view.state in ("closed", "open", "half_open") else "open"  # type: ignore[assignment]
        self.failures = view.failures
        self.retry_at = now + view.retry_in if view.retry_in is not None else 0.0
        self.opened_by = view.opened_by
        self.local_failures = 0


@dataclass(frozen=True)
class TrialVerdict:
    """What this instance's half-open trial said, kept until the store has recorded it: the call
    answered (``ok``), it failed (``failed``), or the trial is given back without a call
    (``unrun``). ``why``: the call's error, or why the trial is given back; ``at``: the local
    monotonic moment it was decided (a late write tells the store how long ago the call ended)."""

    outcome: Literal["ok", "failed", "unrun"]
    why: str | None
    at: float


@dataclass
class InstanceHealth:
    """This instance's own health for one agent."""

    healthy: bool = True
    probe_at: float = 0.0  # local monotonic moment an unhealthy instance probes again
    probing: bool = False  # a probe request is running
    failures: int = 0  # consecutive failed calls of this instance
    unsent: int = 0  # successes not yet written to the store
    last_ok: float | None = None  # monotonic moment of the latest success
    written_at: float = float("-inf")  # monotonic moment successes were last written
    writing: bool = False


class AgentHealth:
    """The shared breakers and this instance's health, for the agents one worker runs."""

    def __init__(
        self, store: Store, me: str, agents: Mapping[str, Agent], clock: Clock, settings: AgentSettings
    ) -> None:
        self.store = store
        self.me = me
        self.agents = agents
        self.clock = clock
        self.settings = settings
        self.rules = sa.HealthRules(
            unhealthy_after=settings.unhealthy_after,
            probe_after=0.0,  # per agent: its breaker cool-off (see _rules)
            stale_after=settings.instance_stale,
            trial_ttl=settings.trial_ttl,
        )
        # The operations this worker has for each agent, as the JSON array the store's takes
        # filter by (``sa.Want.ops``): the set of agents and operations is fixed by now.
        self.ops = {n: sa.ops_json(a.operations) for n, a in agents.items()}
        self.breakers = {n: BreakerMirror() for n in agents}
        self.instances = {n: InstanceHealth() for n in agents}
        self.registered = False
        self._background: set[asyncio.Task[None]] = set()
        # Each agent's latest report in flight: the next one waits for it, so that the store
        # counts one agent's calls in the order they ended (a success written after a later
        # failure would reset the breaker's count of failures in a row).
        self._reports: dict[str, asyncio.Task[None]] = {}
        # Agents whose trial a failed pull may have won in the store (its commit unconfirmed),
        # until return_unknown_trials() gives such trials back.
        self.trials_unknown: set[str] = set()
        # Each agent's trial verdict that the store has not recorded yet (its write in flight, or
        # failed); while there is one, this instance claims no new trial of the agent: the store
        # tells trials apart only by their holder, so a late verdict would be taken for the new
        # trial's. At most one per agent: the map is bounded by the agents this worker runs.
        self.verdicts: dict[str, TrialVerdict] = {}
        # Agents whose verdict's write failed, and the task writing it again (_repay).
        self.owed: set[str] = set()
        self._repaying: dict[str, asyncio.Task[None]] = {}
        # The task renewing the claim on each trial this instance runs (_hold_trial).
        self._holding: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        # Outcomes not recorded since the last one that was: said once per outage, not once per
        # call that ended in it (seven lines in a review's 18 s full disk, one per call).
        self._unrecorded = 0
        # Whether the last pull asked the store: one that found no slot free did not, and its
        # "success" says nothing of the store (it ended an outage in the log, and its back-off).
        self.asked = False

    def _rules(self, agent: str) -> sa.HealthRules:
        cool = self.agents[agent].breaker_cool_off
        return sa.HealthRules(
            self.rules.unhealthy_after, cool, self.rules.stale_after, max(cool, self.settings.trial_ttl)
        )

    async def register(self, capacity: Mapping[str, int]) -> None:
        specs = [
            sa.InstanceSpec(n, capacity.get(n, a.concurrency), a.breaker_threshold, a.breaker_cool_off)
            for n, a in self.agents.items()
        ]
        await self.store.transact(sa.register, self.me, specs)
        self.registered = True

    def flush_successes(self) -> None:
        """At each heartbeat (which records capacity and load, ``Store.worker_beat``): write the
        successes held back since the last one."""
        for name, inst in self.instances.items():
            if inst.unsent and not inst.writing:
                self._write_later(name)

    async def stop(self) -> None:
        """Record this instance's stop. A trial verdict still owed is written once more (the
        store may be back), then given up: the trial opens to others after ``trial_ttl``."""
        self._stopping = True
        for t in [*self._repaying.values(), *self._holding.values()]:
            t.cancel()
        if self._background:
            await asyncio.wait(set(self._background), timeout=2)
        if self._repaying:
            await asyncio.wait(set(self._repaying.values()))  # cancelled: each ends at once
        for name in sorted(self.owed):
            try:
                await self._write_owed(name)
            except Exception as e:
                log.warning(
                    "agent %s: could not record the breaker trial's verdict on stopping (it opens "
                    "to other instances after trial_ttl): %r",
                    name,
                    e,
                )
        if self.trials_unknown:  # a stopping worker sweeps no more: give such trials back now
            try:
                await self.return_unknown_trials()
            except Exception as e:  # they open to others after trial_ttl, as before
                log.warning("could not give back breaker trials on stopping: %r", e)
        await self.store.transact(sa.stop, self.me)

    # -- pulling ------------------------------------------------------------------------------------
    async def pull(
        self, rooms: Mapping[str, int], with_workflows: bool = False
    ) -> tuple[list[RequestMsg], set[str], set[str], dict[int, str]]:
        """Claim up to ``rooms[agent]`` requests for each agent this instance may serve now.

        An unhealthy instance takes nothing for the agent, except one probe request once its
        cool-off is over; an open breaker lets through only the trial, claimed in the store by one
        instance. Returns the requests, the agents whose trial we hold, those being probed, and
        (``with_workflows``, for tracing) the workflow of each request's task. :attr:`asked`
        says whether it asked the store at all (with no slot free, it does not)."""
        self.asked = False
        now = self.clock.monotonic()
        wants: dict[str, sa.Want] = {}
        probes: set[str] = set()
        for name, room in rooms.items():
            inst, b = self.instances[name], self.breakers[name]
            if room <= 0 or b.trial:
                continue
            if b.local_failures >= self.agents[name].breaker_threshold and now < b.retry_at:
                continue  # the store was unreachable when we failed: hold back locally
            # Not while a verdict of ours is unrecorded: the store would take it for the new trial's.
            trial = b.state != "closed" and now >= b.retry_at and name not in self.verdicts
            if not inst.healthy:
                if inst.probing or now < inst.probe_at:
                    continue
                probes.add(name)
                # While the breaker is open a probe can only be its trial, which the store gives
                # an unhealthy instance only when no live healthy one could run it: otherwise,
                # with the healthy instances gone, no instance would ever try the service again.
                # Asked whatever the mirror says (an instance that pulls nothing for a while has
                # not read the breaker since): the store knows whether the cool-off is over.
                may = name not in self.verdicts
                # The trial is a healthy instance's to run; left untaken for one probe interval
                # (the cool-off), it is this one's.
                unclaimed = self._rules(name).probe_after
                wants[name] = sa.Want(
                    1, ops=self.ops[name], may_trial=may, trial_if_alone=True, trial_unclaimed=unclaimed
                )
                continue
            wants[name] = sa.Want(room, ops=self.ops[name], may_trial=trial)
        if not wants:
            return [], set(), set(), {}
        self.asked = True
        try:
            got = await self.store.transact(sa.pull, self.me, wants, self.rules, with_workflows)
        except Exception:
            self.trials_unknown |= {name for name, w in wants.items() if w.may_trial}
            raise
        now = self.clock.monotonic()
        for name, b in self.breakers.items():
            b.update(got.breakers.get(name), now)
        # A trial won now is the store's only trial for the agent (a claim needs retry_at passed,
        # so it replaced any earlier one): known here, never given back as unknown, even while
        # its report is in flight (report_soon clears `trial` before the report commits).
        self.trials_unknown -= got.trials
        for name in got.trials:
            self.breakers[name].trial = True
            self._hold_trial(name)
            log.info("agent %s: breaker cool-off over, this instance runs the trial call", name)
        taken = {m.agent for m in got.requests}
        for name in probes & taken:
            self.instances[name].probing = True
            log.info("agent %s: probing this unhealthy instance with one request", name)
        return got.requests, got.trials, probes & taken, got.workflows

    async def return_unknown_trials(self) -> None:
        """After a pull whose commit was not confirmed, and once the requests it may have taken
        are handed back: give back any trial it won, unrun (see ``store.agents.return_trials``).
        A trial this instance knows it holds (a later pull's, running) is left alone."""
        agents = sorted(
            n for n in self.trials_unknown if not self.breakers[n].trial and n not in self.verdicts
        )
        if agents:
            why = "won by a pull whose commit was not confirmed; its request was handed back unrun"
            returned = await self.store.transact(sa.return_trials, self.me, agents, why)
            for name in returned:
                log.warning("agent %s: gave back a breaker trial %s", name, why)
        self.trials_unknown.clear()

    # -- calls ---------------------------------------------------------------------------------------
    def may_call(self, agent: str) -> str | None:
        """None if a call may go to the service now, else why not (the try fails fast). Asked
        before every try but the trial's first (see :meth:`BreakerMirror.rejecting`)."""
        b = self.breakers[agent]
        if b.rejecting():
            return f"circuit breaker for {agent!r} is {b.state.replace('_', '-')}"
        return None

    def healthy(self, agent: str) -> bool:
        return self.instances[agent].healthy

    async def ended(self, agent: str, ok: bool, error: str | None = None, trial: bool = False) -> None:
        """One call to the service ended: ``ok`` if it answered (a permanent error is an answer)."""
        inst = self.instances[agent]
        if ok and not trial and not self._changes(agent):
            self._held_back(agent)
        elif ok:
            inst.last_ok = self.clock.monotonic()
            inst.unsent += 1
            inst.failures = 0
            await self._send(agent, True, None, trial)
        else:
            inst.failures += 1
            await self._send(agent, False, error, trial)

    def _changes(self, agent: str) -> bool:
        """Whether a success of ``agent`` changes anything the store knows: the instance is
        unhealthy, or failures are counted (its own, the breaker's, or those it could not report)."""
        inst, b = self.instances[agent], self.breakers[agent]
        return not inst.healthy or bool(inst.failures or b.failures or b.local_failures)

    def _held_back(self, agent: str) -> None:
        """A success that changes nothing: counted, and written with the next ones, in the
        background, at most every ``success_every``."""
        inst = self.instances[agent]
        now = self.clock.monotonic()
        inst.last_ok = now
        inst.unsent += 1
        if now - inst.written_at >= self.settings.success_every and not inst.writing:
            self._write_later(agent)

    def report_soon(
        self, agent: str, ok: bool, error: str | None = None, trial: bool = False
    ) -> asyncio.Task[None] | None:
        """:meth:`ended`, off the path of the reply, which must not wait for the store to count
        the call (a slow report, up to ``report_timeout``, made an answer given in time arrive
        after complete-by). A plain success that changes nothing in the store (the common case:
        no trial, a healthy instance, no failures counted, no earlier report of the agent still
        in flight) is counted here and now, and None returned. Otherwise the report runs in a
        task, after the agent's reports still in flight, and the task is returned: the caller
        waits for it where the verdict matters (before the next try: may it call, is this
        instance still healthy?). A trial is marked reported at once, so that the end of its
        request adds no second verdict (see :meth:`release_trial`)."""
        before = self._reports.get(agent)
        if before is not None and before.done():
            del self._reports[agent]
            before = None
        if ok and not trial and before is None and not self._changes(agent):
            self._held_back(agent)
            return None
        if trial:
            self.breakers[agent].trial = False
            self._decided(agent, "ok" if ok else "failed", error)

        async def report() -> None:
            if before is not None:  # bounded: a stuck one holds up none for long
                await asyncio.wait({before}, timeout=self.settings.report_timeout)
            await guard(self.ended(agent, ok, error, trial), agent)

        t = self._spawn(report(), f"health-report-{agent}")
        self._reports[agent] = t
        return t

    async def give_back_trial(self, agent: str, why: str) -> None:
        """The trial request ended without calling the service (its operation is not in this
        worker, or its call never started before complete-by): the trial says nothing about the
        service, so it is given back unrun, open to any instance at once, not counted failed. A
        give-back the store did not record is owed, as a verdict is (see :meth:`_owe`)."""
        b = self.breakers[agent]
        if not b.trial:
            return
        b.trial = False
        self._decided(agent, "unrun", why)
        try:
            await self._write_owed(agent)
        except Exception as e:
            self._owe(agent, e)

    async def release_trial(self, agent: str, why: str) -> None:
        """The trial request ended without a call's verdict (complete-by passed): count it failed."""
        if self.breakers[agent].trial:
            await self._send(agent, False, why, True)

    def _hold_trial(self, agent: str) -> None:
        """Keep the claim on a trial this instance runs for as long as its request runs.

        The claim lasts ``trial_ttl``, so that the trial of an instance that died opens to
        others. Claimed once, a call slower than that (complete-by may be days) lost it while
        still running: another instance took a second trial and called the service too, and
        the first call's success then closed nothing (its verdict is about a trial no longer
        current), so a slow service that answers every trial never got its breaker closed. The
        claim is renewed every third of ``trial_ttl`` until the request ends (``trial`` cleared);
        an instance that dies, stalls or loses the store stops renewing, and the trial opens to
        others as before. Each trial won gets a task of its own: one left from an earlier trial
        (asleep, or with a renewal in flight that may find the earlier trial decided) is
        cancelled, so that it cannot end without renewing the new one."""
        earlier = self._holding.get(agent)
        if earlier is not None:
            earlier.cancel()
        self._holding[agent] = asyncio.create_task(self._renew_trial(agent), name=f"health-hold-{agent}")

    async def _renew_trial(self, agent: str) -> None:
        # The claim's own lifetime (``pull`` claims with ``self.rules``), not _rules(agent)'s,
        # which is at least the cool-off: with a cool-off over three times trial_ttl the claim
        # lapsed before the first renewal, and with a shorter one each renewal stretched it.
        b, ttl = self.breakers[agent], self.rules.trial_ttl
        while True:
            await self.clock.sleep(ttl / 3)
            if not b.trial or self._stopping:
                return
            try:
                held = await asyncio.wait_for(
                    self.store.transact(sa.renew_trial, self.me, agent, ttl), self.settings.report_timeout
                )
            except Exception as e:  # the next renewal may go through; past trial_ttl others may try
                log.warning("agent %s: could not renew the claim on the breaker trial it runs: %r", agent, e)
                continue
            if not held:
                log.warning(
                    "agent %s: the breaker trial this instance runs is no longer its own (its claim "
                    "lapsed): its verdict will not change the breaker",
                    agent,
                )
                return

    def probe_done(self, agent: str) -> None:
        inst = self.instances[agent]
        inst.probing = False
        if not inst.healthy and inst.probe_at <= self.clock.monotonic():
            inst.probe_at = self.clock.monotonic() + self.agents[agent].breaker_cool_off

    def _write_later(self, agent: str) -> None:
        self.instances[agent].writing = True
        self._spawn(self._write(agent), f"health-{agent}")

    async def _write(self, agent: str) -> None:
        """Write the successes held back (``writing`` is set while it runs)."""
        try:
            await self._send(agent, True, None, False)
        finally:
            self.instances[agent].writing = False

    def _spawn(self, work: Coroutine[None, None, None], name: str) -> asyncio.Task[None]:
        """Run ``work`` in the background; :meth:`stop` waits for what is still running."""
        t = asyncio.create_task(work, name=name)
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    async def _send(self, agent: str, ok: bool, error: str | None, trial: bool) -> None:
        b, a = self.breakers[agent], self.agents[agent]
        now = self.clock.monotonic()
        if trial:
            b.trial = False  # reported now, whatever the answer
            if agent not in self.verdicts:  # release_trial's (report_soon's is kept from the call's end)
                self._decided(agent, "ok" if ok else "failed", error)
        try:
            verdict = await self._record(agent, ok, error, trial, 0.0)
        except Exception as e:  # the store is unreachable: decide locally until it answers again
            if trial:
                self._owe(agent, e)
            else:
                self._unrecorded += 1
                if self._unrecorded == 1:
                    log.warning(
                        "agent %s: could not record a call's outcome: %r (its breaker decides locally;"
                        " said again once an outcome is recorded)",
                        agent,
                        e,
                    )
            if not ok:
                b.local_failures += 1
                if b.local_failures >= a.breaker_threshold:
                    b.retry_at = now + a.breaker_cool_off
            return
        if self._unrecorded:
            log.info("agent %s: outcomes recorded again (%d were not)", agent, self._unrecorded)
            self._unrecorded = 0
        if trial:
            self._recorded(agent)
        self._apply(agent, verdict, error)

    async def _record(self, agent: str, ok: bool, error: str | None, trial: bool, ago: float) -> sa.Verdict:
        """Write one call's outcome (a success with those held back); the store's verdict.
        ``ago``: seconds since a failed call ended (a success's is known here)."""
        inst, a = self.instances[agent], self.agents[agent]
        now = self.clock.monotonic()
        n = inst.unsent if ok else 0
        if ok:
            ago = max(0.0, now - inst.last_ok) if inst.last_ok is not None else 0.0
        r = sa.Report(agent, ok, error, trial, ago, n)
        verdict = await asyncio.wait_for(
            self.store.transact(
                sa.report, self.me, r, a.breaker_threshold, a.breaker_cool_off, self._rules(agent)
            ),
            self.settings.report_timeout,
        )
        if ok:
            inst.unsent -= n
            inst.written_at = now
        return verdict

    def _apply(self, agent: str, verdict: sa.Verdict, error: str | None) -> None:
        """Take the store's verdict on a reported call into the mirror and this instance's health."""
        inst, b, a = self.instances[agent], self.breakers[agent], self.agents[agent]
        now = self.clock.monotonic()
        b.update(verdict.breaker, now)
        if verdict.opened:
            log.warning("agent %s: circuit breaker opened for every instance (%s)", agent, error)
        if verdict.closed:
            log.info("agent %s: trial call succeeded, circuit breaker closed for every instance", agent)
        was = inst.healthy
        inst.healthy = verdict.healthy
        if not verdict.healthy:
            inst.probe_at = now + (verdict.probe_in if verdict.probe_in is not None else a.breaker_cool_off)
            if was:
                log.warning(
                    "agent %s: this instance's calls fail while others succeed: unhealthy, "
                    "not pulling its requests for %gs (%s)",
                    agent,
                    a.breaker_cool_off,
                    error,
                )
        elif not was and error is not None:
            log.info(
                "agent %s: no live instance succeeds where this one fails any more: healthy again,"
                " its failures count toward the breaker (%s)",
                agent,
                error,
            )
        elif not was:
            log.info("agent %s: probe succeeded, this instance is healthy again", agent)

    # -- trial verdicts the store must record ------------------------------------------------------
    def _decided(self, agent: str, outcome: Literal["ok", "failed", "unrun"], why: str | None) -> None:
        """The trial held here has its verdict: kept until the store records it."""
        self.verdicts[agent] = TrialVerdict(outcome, why, self.clock.monotonic())

    def _recorded(self, agent: str) -> None:
        self.verdicts.pop(agent, None)
        self.owed.discard(agent)

    def _owe(self, agent: str, e: BaseException) -> None:
        """The write of a trial's verdict failed (or its answer was lost): left alone, the store
        would keep the breaker half-open with this instance's trial, and no instance would call
        the service for ``trial_ttl``, however well it answers. Written again, until the store
        answers, by :meth:`_repay`; logged once for the whole outage, not per write."""
        v = self.verdicts.get(agent)
        if v is None or agent in self.owed:
            return
        self.owed.add(agent)
        if self._stopping:  # stop makes one last write of what is owed, if it has not passed that yet
            log.warning(
                "agent %s: could not record the breaker trial's verdict (%s) while stopping: %r; "
                "the trial opens to other instances after trial_ttl",
                agent,
                v.outcome,
                e,
            )
            return
        log.warning(
            "agent %s: could not record the breaker trial's verdict (%s): %r; writing it again "
            "until the store answers",
            agent,
            v.outcome,
            e,
        )
        self._repaying[agent] = asyncio.create_task(self._repay(agent), name=f"health-trial-{agent}")

    async def _repay(self, agent: str) -> None:
        """Write the owed verdict again, REPAY_FIRST seconds after the failed write, then twice
        as long after each failure, up to REPAY_MAX, on the agent's clock; until the store
        records it, or :meth:`stop` cancels this. Harmless however late: each of its statements
        changes the breaker only while it is half-open with this instance's trial (the trial
        this verdict is about: no other is claimed here meanwhile, see :meth:`pull`), so once
        ``trial_ttl`` has let another instance take the trial, or that trial reopened or closed
        the breaker, a late verdict counts for this instance's health and changes nothing else."""
        delay, writes = REPAY_FIRST, 1
        try:
            while agent in self.owed:
                await self.clock.sleep(delay)
                writes += 1
                outcome = self.verdicts[agent].outcome
                try:
                    await self._write_owed(agent)
                except Exception as e:
                    log.debug("agent %s: the breaker trial's verdict is still not recorded: %r", agent, e)
                    delay = min(2 * delay, REPAY_MAX)
                    continue
                log.info(
                    "agent %s: the store answers again: the breaker trial's verdict (%s) is recorded "
                    "(write %d)",
                    agent,
                    outcome,
                    writes,
                )
        finally:
            self._repaying.pop(agent, None)

    async def _write_owed(self, agent: str) -> None:
        """Write the agent's unrecorded trial verdict; raises if the store did not record it."""
        v = self.verdicts[agent]
        b, now = self.breakers[agent], self.clock.monotonic()
        if v.outcome == "unrun":
            why = v.why or "its request ended without calling the service"
            returned = await asyncio.wait_for(
                self.store.transact(sa.return_trials, self.me, [agent], why), self.settings.report_timeout
            )
            self._recorded(agent)
            if returned:
                b.retry_at = self.clock.monotonic()  # as in the store: this instance's next pull may try
                log.info("agent %s: gave back the breaker trial unrun: %s", agent, why)
            return
        ok = v.outcome == "ok"
        verdict = await self._record(agent, ok, v.why, True, 0.0 if ok else max(0.0, now - v.at))
        self._recorded(agent)
        self._apply(agent, verdict, v.why)
        if ok and not verdict.closed:
            log.info(
                "agent %s: the trial call's success, recorded late, closed nothing: the breaker "
                "was no longer half-open with this instance's trial (closed already, or another "
                "instance took the trial after trial_ttl)",
                agent,
            )
