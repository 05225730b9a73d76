"""The agent role: runs the operations of the agents a worker serves (defined in ``agent_definition.py``).

An agent instance pulls request messages only up to its capacity (AGT6), runs each operation under
the attempt's complete-by (AGT2, AGT4), retries transient failures inside the attempt with
back-off and jitter, and replies once. At complete-by it cancels the work and sends nothing: the
supervisor, not the agent, decides what happens next. A reply the store fails to take is tried
again while the store is down, but only until its complete-by, and a stop hands back only the
attempts still in time. A plain (non-async) function cannot be interrupted; it keeps running in
its thread, and its late result is discarded unsent. How one attempt runs (async or plain, its
tries, the rules at complete-by) is in ``agent_attempt.py``.

Kept apart from the definitions an application writes, which need none of this machinery. How long
each of its stop writes may wait is the worker's ``StopWrites`` (``stop_writes.py``), which a
test may replace with shorter bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

from . import tracing
from .agent_attempt import Attempts, AttemptState, Outcome
from .agent_definition import Agent
from .agent_health import AgentHealth, guard
from .agent_settings import CANCELLED_WAIT, MIN_TRY_LEFT, REPLIES_WAIT, AgentSettings
from .clock import SYSTEM_CLOCK, Clock, Outage, sleep_or_wake
from .errors import StoreError
from .logs import log_raised
from .policies import Backoff
from .stop_writes import StopWrites
from .store import ApplyResult, RequestMsg, Store
from .store.agents import Want, task_workflows
from .tracing import AttemptSpan, NoAttempt

# The logger the agent role always had (agent_health.py logs under it too): log configurations and
# tests select the role's records by this name.
log = logging.getLogger("stepwarden.agent")

# The sweep for lost takes waits this long for the transactions that hold reservations.
SWEEP_WAIT = 1.0
# An unanswered call's request is remembered this long past its complete-by: the agent's own
# deadline (monotonic) and the store's clock may disagree by a little.
UNANSWERED_MARGIN = 5.0
UNANSWERED_KEPT = 1024  # past this many, the expired ones are forgotten at once
# A reply whose transaction fails for want of the store (a lost connection, a server restarting)
# is tried again, SEND_BACKOFF apart, until its request's complete-by and never after (AGT4): it is
# the result of a call that ran, and giving it up early makes the attempt wait out its complete-by
# and count as failed. Capped at 1 s, so that a store back from an outage gets the replies within
# about a second. A batch the store refuses for what it holds (text it cannot keep) does not heal
# by waiting: it is split (see _send_tries) and what is still refused is given up after SEND_TRIES
# such refusals.
SEND_BACKOFF = Backoff(initial=0.1, multiplier=2.0, maximum=1.0, jitter=0.2)
SEND_TRIES = 5
# A request's end waits for its call's health reports (see AgentRole.execute) as long as a
# report's own write may take (report_timeout), and this much more for the bookkeeping around
# it. A report held up behind an earlier stuck one can take longer: it is not waited for to the
# end, and finishes in the background (AgentHealth.stop waits for it).
REPORT_WAIT_SLACK = 1.0

ReplyItem = tuple[int, str, Any, str | None]  # (request id, outcome, result, error) of a reply
Outgoing = tuple[ReplyItem, float]  # a reply, and its request's complete-by (local monotonic)


def _store_down(e: BaseException) -> bool:
    """Whether a reply transaction failed for want of the store (a lost connection, a server or
    a file it cannot reach, a lock it cannot get: the drivers' OperationalError or
    InterfaceError, an OSError, a StoreError), along its ``raise ... from`` causes, rather than
    for what the batch held: splitting the batch would then only fail the same way, in more
    transactions. Not along ``__context__``: a refusal met on the retry a store makes after a
    lost connection (inside its ``except``) is still a refusal."""
    current: BaseException | None = e
    for _ in range(5):
        if current is None:
            break
        if isinstance(current, OSError | StoreError) or any(
            c.__name__ in ("OperationalError", "InterfaceError") for c in type(current).__mro__
        ):
            return True
        current = current.__cause__
    return False


def _ids(items: list[Outgoing]) -> str:
    """The request ids of ``items``, for a log line."""
    return ", ".join(str(item[0]) for item, _ in items)


class Reservation(dict[str, Want]):
    """Slots per agent handed out by :meth:`AgentRole.reserve` (each a :class:`Want`: how many,
    and for which operations), with the local monotonic moment they were (``at``): just before
    the transaction that fills them is sent, so that the calls it starts count their deadlines
    from then (see :meth:`AgentRole.pull`)."""

    def __init__(self, at: float) -> None:
        super().__init__()
        self.at = at


class AgentRole:
    """Pulls requests for some agents up to capacity and runs them; one per worker process."""

    def __init__(
        self,
        store: Store,
        agents: dict[str, Agent],
        me: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        settings: AgentSettings | None = None,
        wake: asyncio.Event | None = None,
        on_reply: Callable[[], None] | None = None,
        on_applied: Callable[[ApplyResult], None] | None = None,
        on_attempt: Callable[[str, str, float], None] | None = None,
        threads: int | None = None,
        stop_writes: StopWrites | None = None,
    ) -> None:
        self.store = store
        # Shared with the worker: the stop's writes wait briefly once the store was found down.
        self.stop_writes = stop_writes or StopWrites()
        self.agents = agents
        self.me = me
        self.clock = clock
        self.settings = settings or AgentSettings()
        self.wake = wake or asyncio.Event()
        self.on_reply = on_reply or (lambda: None)
        self.on_applied = on_applied or (lambda r: None)
        self.on_attempt = on_attempt or (lambda agent, outcome, seconds: None)
        self.inflight: dict[str, int] = dict.fromkeys(agents, 0)
        # The requests counted in `inflight`: a slot is held until its reply commits (AGT6), and
        # given back by whichever comes first, that commit or the end of the call's task.
        self._held: dict[int, str] = {}
        # The breakers are shared through the store; this is the instance's mirror of them, and
        # its own health (AGT3, AGT6; see agent_health.py).
        self.health = AgentHealth(store, me, agents, clock, self.settings)
        self.breakers = self.health.breakers
        self.tracer = tracing.tracer(me, store)  # spans per attempt when the `otel` extra is installed
        # Plain calls run in a pool per agent, ``threads`` (default: the agent's concurrency)
        # threads each; a thread still busy after complete-by keeps its slot counted.
        self.attempts = Attempts(
            me,
            agents,
            self.health,
            clock,
            self.settings,
            threads=threads,
            busy=self._busy,
            free=self._free,
            full=lambda name: self.inflight[name] >= self.agents[name].concurrency,
        )
        self.tasks: dict[asyncio.Task[None], RequestMsg] = {}
        # The complete-by of each request whose call's task runs (local monotonic): a stop hands
        # back only the attempts still in time (past it the agent sends nothing, AGT4).
        self._deadlines: dict[int, float] = {}
        self.completed = 0
        self.batches = 0  # reply transactions committed: completed / batches is replies per batch
        self._notes: set[asyncio.Task[None]] = set()
        self._outbox: list[tuple[ReplyItem, float, asyncio.Future[None]]] = []  # with complete-by
        self._sender: asyncio.Task[None] | None = None
        # Set by a stop (drain): the sender tries no reply after this moment (local monotonic),
        # whatever time its request has left; the stop waits that long for it and no longer.
        self._send_by: float | None = None
        # How long the last reply transaction that went through took: what a try needs once the
        # store answers again (see _send_tries).
        self._send_took = MIN_TRY_LEFT
        self.rng = random.Random()  # the jitter of the reply sender's back-off
        self._replied: set[int] = set()  # request ids whose reply is queued or sent
        # Request ids whose reply committed while their call's task still runs (waiting for its
        # health report): a stop that cancels that wait has nothing to hand back for them.
        self._settled: set[int] = set()
        # Calls started since the last reply batch was taken and not yet answered (nor ended):
        # what the next batch lingers for. Calls that were running when a batch was taken are
        # not waited for again, so a slow call delays at most one batch, not every batch.
        self._young: set[int] = set()
        self._no_young = asyncio.Event()  # set when the last of them answers, or the agent stops
        self._stopping = False  # set by drain(): reply batches take no more requests
        self._drained = False  # drain() has stopped waiting: nothing may start any more
        self._hurried = asyncio.Event()  # hurry(): what is left of the grace period is skipped
        # Reservations handed out and not yet settled by accept(): a transaction in flight may
        # still bring requests for them, which drain() waits for.
        self._reserving = 0
        self._no_reservations = asyncio.Event()
        self._no_reservations.set()
        # A transaction that takes requests for this instance failed, and may have committed
        # anyway (a connection lost in the round trip that carries COMMIT): the requests it took
        # are this instance's in the store, and nothing here runs them. Set by accept() and
        # pull(); run() then hands such requests back (see _release_unknown_takes).
        self._takes_unknown = False
        self._sweeping = False  # set while run() looks for them: reserve() hands out nothing
        # Requests whose call ended here without a committed reply (silent at complete-by, reply
        # never sent, cancelled), until just past their complete-by: they ran, so the sweep must
        # not release them as never started; they are the supervisor's, and count as failed.
        self._unanswered: dict[int, float] = {}

    async def run(self, stop: asyncio.Event) -> None:
        idle = self.settings.poll_interval
        outage = Outage(log, f"agent {self.me}", self.clock)
        try:
            await self._register()
            while not stop.is_set():
                swept: Exception | None = None
                if self._takes_unknown:
                    try:
                        await self._release_unknown_takes()
                    except Exception as e:  # the flag stays: tried again next round
                        swept = e
                try:
                    got = await self.pull()
                except Exception as e:  # database trouble: back off, keep going (REL3)
                    self.stop_writes.failed()
                    # The sweep failed with it, most likely: one outage, logged once (Outage). A
                    # hint (a call's end, a freed slot) cuts the wait short.
                    await sleep_or_wake(self.clock, outage.failed(e), stop, self.wake)
                    self.wake.clear()
                    continue
                if self.health.asked:
                    outage.answered()
                    self.stop_writes.answered()
                    if swept is not None:  # the store answers the pull: this is no outage
                        log.warning("agent %s: could not look for lost takes: %r", self.me, swept)
                elif swept is not None:
                    # A pull with no slot free asks the store nothing: the sweep was the round's
                    # one question, and it failed. (Taken as an answer, such a pull ended an
                    # outage in the log, twice in one 90 s outage, and reset its back-off.)
                    self.stop_writes.failed()
                    await sleep_or_wake(self.clock, outage.failed(swept), stop, self.wake)
                    self.wake.clear()
                    continue
                if got:
                    idle = self.settings.poll_interval
                    continue
                await sleep_or_wake(self.clock, idle, stop, self.wake)
                self.wake.clear()
                idle = min(self.settings.idle_poll_max, idle * 2)
        finally:
            await self.drain()
            try:
                await self.stop_writes.write(self.health.stop())
            except Exception as e:
                log.warning("agent %s: could not record the instances' stop: %r", self.me, e)

    async def _register(self) -> None:
        try:
            await self.health.register({n: a.concurrency for n, a in self.agents.items()})
        except Exception as e:  # retried at the next pull
            log.warning("agent %s: could not register its agent instances: %r", self.me, e)

    def load(self) -> dict[str, tuple[int, int]]:
        """``{agent: (capacity, in flight)}``, for the heartbeat."""
        return {n: (a.concurrency, self.inflight[n]) for n, a in self.agents.items()}

    async def pull(self) -> int:
        """Take requests up to capacity, for the agents whose shared breaker is closed (or whose
        trial this instance won) and for which this instance is healthy (AGT6)."""
        if not self.health.registered:
            await self.health.register({n: a.concurrency for n, a in self.agents.items()})
        if not self.attempts.store_id:  # before any call: its requests carry it (global keys, traces)
            self.attempts.store_id = await self.store.identity()
        rooms = {n: a.concurrency - self.inflight[n] for n, a in self.agents.items()}
        # The deadline of each call counts from here, before the transaction is sent, as a lease's
        # trust does (LEAD2): the time the database says is left was measured later than this, so
        # a slow round trip shortens the call's time rather than carrying it past complete-by.
        # A wait before the transaction began (SQLite's write lock, a pooled connection) is
        # added back to that time by the store (RequestMsg.remaining): it is not the call's.
        sent = self.clock.monotonic()
        try:
            msgs, trials, probes, workflows = await self.health.pull(rooms, self.tracer.wants_workflows)
        except Exception:
            self._takes_unknown = True
            raise
        for msg in msgs:
            self._start(msg, sent, msg.agent in trials, msg.agent in probes, workflows.get(msg.task_id))
        return len(msgs)

    def _start(
        self,
        msg: RequestMsg,
        sent: float,
        trial: bool = False,
        probe: bool = False,
        workflow: str | None = None,
    ) -> None:
        agent = self.agents[msg.agent]
        self.inflight[agent.name] += 1
        self._held[msg.id] = agent.name
        span = self.tracer.attempt(msg, workflow)
        deadline = sent + msg.remaining
        self._deadlines[msg.id] = deadline
        t = asyncio.create_task(
            self.execute(agent, msg, trial, probe, span, deadline), name=f"request-{msg.id}"
        )
        self._young.add(msg.id)
        self.tasks[t] = msg
        t.add_done_callback(lambda done: self.tasks.pop(done, None))

    # -- requests handed over in this worker's own transactions (see scheduler.LocalAgents) -------
    def _busy(self, agent: str) -> None:
        """A plain call abandoned at complete-by still runs in its thread: its slot stays counted."""
        self.inflight[agent] += 1

    def _free(self, agent: str) -> None:
        self.inflight[agent] -= 1
        self.wake.set()  # a slot is free: pull now, not at the next idle poll

    def reserve(self, freeing: Mapping[str, int] | None = None) -> Reservation:
        """Free slots per agent that a transaction of this worker may fill directly, with the
        operations it has (it takes no request for another one, as a pull does not): only agents
        whose shared breaker is closed and for which this instance is healthy (anything else goes
        through :meth:`pull`, which knows about trials and probes). ``freeing``: slots that the
        same transaction's replies give back. Held (counted in flight) until :meth:`accept`."""
        out = Reservation(self.clock.monotonic())  # before the transaction that fills them is sent
        if not self.health.registered or self._stopping or self._sweeping:
            return out
        for name, a in self.agents.items():
            b = self.breakers[name]
            if b.state != "closed" or b.trial or not self.health.healthy(name):
                continue
            room = a.concurrency - self.inflight[name] + (freeing or {}).get(name, 0)
            if room > 0:
                out[name] = Want(room, ops=self.health.ops[name])
                self.inflight[name] += room
        if out:
            self._reserving += 1
            self._no_reservations.clear()
        return out

    async def workflows_of(self, msgs: list[RequestMsg]) -> dict[int, str]:
        """The workflow of each task of ``msgs``, for their attempts' trace spans, when spans are
        recorded (else nothing, and no read). A pull reads them in its own transaction; requests
        a scheduler round or a reply batch took for this worker's slots come from a take that
        reads no task, and their spans lacked ``stepwarden.workflow`` (in the default worker,
        nearly all of them). One read after that transaction, only while tracing."""
        if not msgs or not self.tracer.wants_workflows:
            return {}
        try:
            return await self.store.transact(task_workflows, sorted({m.task_id for m in msgs}))
        except Exception as e:  # the spans go without it: the attempts are what matters
            log.debug("agent %s: could not read the workflows of its attempts' tasks: %r", self.me, e)
            return {}

    def accept(
        self,
        msgs: list[RequestMsg],
        reserved: Mapping[str, Want],
        failed: bool = False,
        workflows: Mapping[int, str] | None = None,
    ) -> None:
        """Start ``msgs`` and give back the reservation. ``failed``: the transaction raised, so
        whether it took requests for this reservation is unknown (see ``_takes_unknown``).
        ``workflows``: each task's workflow, for the spans (:meth:`workflows_of`)."""
        for name, want in reserved.items():
            self.inflight[name] -= want.room
        if failed and reserved:
            self._takes_unknown = True
        if reserved:
            self._reserving -= 1
            if self._reserving == 0:
                self._no_reservations.set()
        if self._drained and msgs:
            # A transaction that outlived the whole grace period: the pool is gone, the process is
            # leaving. The requests stay taken by a stopped worker, which the supervisor rescues.
            log.warning(
                "agent %s: %d request(s) taken after the stop, not started: %s",
                self.me,
                len(msgs),
                ", ".join(str(m.id) for m in msgs),
            )
            return
        sent = reserved.at if isinstance(reserved, Reservation) else self.clock.monotonic()
        for msg in msgs:
            self._start(msg, sent, workflow=(workflows or {}).get(msg.task_id))

    async def execute(
        self,
        agent: Agent,
        msg: RequestMsg,
        trial: bool,
        probe: bool,
        span: AttemptSpan | NoAttempt,
        deadline: float,
    ) -> None:
        """Run one request's attempt and send its reply. ``deadline``: the local monotonic moment
        of its complete-by."""
        state = AttemptState()
        try:
            with span:
                await self._execute(agent, msg, trial, span, deadline, state)
        finally:
            try:
                await self._end(agent, msg, trial, probe, state)
            finally:
                self._settled.discard(msg.id)
                self._deadlines.pop(msg.id, None)

    async def _end(
        self, agent: Agent, msg: RequestMsg, trial: bool, probe: bool, state: AttemptState
    ) -> None:
        """What a request's end does, whatever ended it: its slot given back, its health reports
        waited for, a trial's verdict given."""
        self._answered(msg.id)
        if msg.id in self._held:  # a committed reply would have given its slot back already
            self._remember_unanswered(msg)
        self._release(msg.id)
        self.wake.set()
        task = asyncio.current_task()
        pending = [r for r in state.reports if not r.done()]
        if pending and not (task is not None and task.cancelling()):
            # The reply did not wait for the call's health report; the request's end does, so
            # that the breaker and this instance's health are known when it is over.
            await asyncio.wait(pending, timeout=self.settings.report_timeout + REPORT_WAIT_SLACK)
        if probe:
            self.health.probe_done(agent.name)
        if trial and state.called:  # a trial that ended without a verdict counts as failed
            why = "the trial call gave no answer"
            await guard(self.health.release_trial(agent.name, why), agent.name)
        elif trial:  # it never reached the service: it says nothing about it
            why = "its request ended without calling the service"
            await guard(self.health.give_back_trial(agent.name, why), agent.name)

    def _release(self, request_id: int) -> None:
        name = self._held.pop(request_id, None)
        if name is not None:
            self.inflight[name] -= 1

    async def _execute(
        self,
        agent: Agent,
        msg: RequestMsg,
        trial: bool,
        span: AttemptSpan | NoAttempt,
        deadline: float,
        state: AttemptState,
    ) -> None:
        try:
            started = self.clock.monotonic()
            outcome: Outcome | None = await self.attempts.run(agent, msg, deadline, trial, span, state)
            if outcome is not None and self.clock.monotonic() >= deadline:
                # One guard for every reply (ok, error, retry, released): past complete-by the
                # agent sends nothing (AGT4); the attempt is the supervisor's.
                log.info("request %s: answered %r after complete-by: not sent", msg.id, outcome[0])
                outcome = None
            span.finish(outcome[0] if outcome else "silent", outcome[2] if outcome else None)
            self.on_attempt(agent.name, outcome[0] if outcome else "silent", self.clock.monotonic() - started)
            if outcome is None:
                log.info(
                    "request %s (%s/%s attempt %d) passed complete-by: cancelled, no reply",
                    msg.id,
                    msg.task_id,
                    msg.step_idx,
                    msg.attempt,
                )
                return
            await self._reply(msg, deadline, *outcome)
            self._replied.discard(msg.id)  # sent or given up; only a cancelled wait leaves it for drain()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let one request kill the role
            log.exception("request %s: unexpected failure: %r", msg.id, e)

    async def _reply(
        self, msg: RequestMsg, deadline: float, outcome: str, result: Any, error: str | None
    ) -> None:
        """Queue the reply and wait until it is committed, or given up (``deadline``: its
        complete-by, local monotonic, after which it is not sent). Replies that finish while a
        batch is being written go together in the next transaction (group commit: one fsync for
        many)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._replied.add(msg.id)
        self._outbox.append(((msg.id, outcome, result, error), deadline, fut))
        self._answered(msg.id)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_outbox(), name="agent-replies")
        await asyncio.shield(fut)

    def _answered(self, request_id: int) -> None:
        self._young.discard(request_id)
        if not self._young:
            self._no_young.set()

    async def _linger(self) -> None:
        """Wait, at most ``reply_linger``, until the calls started since the last batch have
        answered (see AgentSettings). One wake-up, when the last of them answers: not one per
        call, which would cost a task switch per reply on the hot path."""
        if not self._young or self._stopping or self.settings.reply_linger <= 0:
            return
        self._no_young.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.reply_linger):
                await self._no_young.wait()

    async def _send_outbox(self) -> None:
        while self._outbox:
            await self._linger()
            batch, self._outbox = self._outbox, []
            self._young.clear()  # still running now: not waited for by the next batch
            try:
                await self._send_tries([(item, deadline) for item, deadline, _ in batch])
            finally:  # sent or given up: the calls' tasks go on to their end
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_result(None)

    async def _send_tries(self, items: list[Outgoing]) -> None:
        """Send ``items``, trying again after a failure, each reply until its complete-by.

        Before every try the replies whose complete-by has passed are dropped (AGT4: the agent
        sends nothing then; the attempt is the supervisor's), and so is every reply once a stop's
        bound passes (``_send_by``); the others go on. A try after a failure needs as much time
        to spare as the failed try took (``MIN_TRY_LEFT`` at least), as a retry of the operation
        does: one started in the last instant would commit after complete-by; after a failure for
        want of the store, as much as the last try that went through took. In the common
        case, one try that commits, this costs a look at each reply's deadline and one clock
        read: no task, no round trip.

        A batch that failed is sent whole again (a lost connection, a store restarting: one more
        transaction, not one per reply), SEND_BACKOFF apart, for as long as the store is down.
        Failing again, and not for want of the store, it is split in halves, and a failing half
        again, so that a reply the database refuses on every try (text it cannot store, say)
        cannot take the others down with it: about log2(N) transactions to single it out among
        N, not N. What the store still refuses after SEND_TRIES refusals is given up."""
        left = items
        n = refused = 0
        spare = 0.0  # the time a try needs: after a failure, at least what that try took
        while left := self._in_time(left, spare):
            n += 1
            began = self.clock.monotonic()
            error = await self._send_batch(left, n)
            took = self.clock.monotonic() - began
            if error is None:
                self._send_took = max(MIN_TRY_LEFT, took)
                return
            # A try that failed for want of the store spent its time waiting for a connection (a
            # pool's 5 s), not sending: asked of the next try, that wait dropped replies with
            # seconds still left once the store was back, and their steps ran again (found by
            # review). The next try needs what a try took when the store answered.
            spare = max(MIN_TRY_LEFT, self._send_took if _store_down(error) else took)
            if not _store_down(error):
                refused += 1
                if refused >= SEND_TRIES:
                    log.error(
                        "agent %s: %d repl(ies) refused by the store %d times, given up (their attempts"
                        " expire): requests %s: %r",
                        self.me,
                        len(left),
                        refused,
                        _ids(left),
                        error,
                    )
                    return
                if n > 1 and len(left) > 1:
                    left = await self._split(left, n)
                    if not left:
                        return
            await self._pause(n, left)

    def _in_time(self, items: list[Outgoing], spare: float) -> list[Outgoing]:
        """The replies of ``items`` that may still be sent: more than ``spare`` seconds before
        their complete-by, and before a stop's bound. The others are given up, said in a log line."""
        now = self.clock.monotonic()
        if self._send_by is not None and now >= self._send_by:
            self._not_sent(items, "the agent stopped before the store took them")
            return []
        until = now + spare
        if all(deadline > until for _, deadline in items):
            return items
        self._not_sent([x for x in items if x[1] <= until], "complete-by passed before the store took them")
        return [x for x in items if x[1] > until]

    def _not_sent(self, items: list[Outgoing], why: str) -> None:
        log.warning(
            "agent %s: %d repl(ies) not sent: %s; their attempts expire: requests %s",
            self.me,
            len(items),
            why,
            _ids(items),
        )

    async def _pause(self, n: int, left: list[Outgoing]) -> None:
        """Wait before try ``n + 1``: SEND_BACKOFF, but not past the last complete-by of ``left``
        (or a stop's bound): there is nothing to wait for after it."""
        last = max(deadline for _, deadline in left)
        if self._send_by is not None:
            last = min(last, self._send_by)
        await self.clock.sleep(min(SEND_BACKOFF.delay(n, self.rng), last - self.clock.monotonic()))

    async def _split(self, items: list[Outgoing], n: int) -> list[Outgoing]:
        """Send ``items`` in halves (try ``n``), each failing half split again, down to single
        replies; returns those that failed. A half that fails for want of the store is kept
        whole, for the next try."""
        failed: list[Outgoing] = []
        half = len(items) // 2
        for part in (items[:half], items[half:]):
            error = await self._send_batch(part, n)
            if error is None:
                continue
            if len(part) > 1 and not _store_down(error):
                failed += await self._split(part, n)
            else:
                failed += part
        return failed

    async def _send_batch(self, items: list[Outgoing], n: int) -> Exception | None:
        """Send ``items`` in one transaction (try ``n``); the error if it failed."""
        replies = [item for item, _ in items]
        try:
            if self.settings.apply_replies:
                # One transaction records the replies, applies them (the next steps are
                # dispatched) and refills the slots they free: one commit per cycle.
                freeing: dict[str, int] = {}
                for request_id, *_ in replies:
                    name = self._held.get(request_id)  # slots given back already don't count
                    if name is not None:
                        freeing[name] = freeing.get(name, 0) + 1
                reserved = self.reserve(freeing)
                taken: list[RequestMsg] = []
                sent = False
                workflows: dict[int, str] = {}
                try:
                    applied, taken = await self.store.send_replies_and_take(self.me, replies, reserved)
                    sent = True
                    workflows = await self.workflows_of(taken)
                finally:
                    self.accept(taken, reserved, failed=not sent, workflows=workflows)
            else:
                applied = await self.store.send_replies(self.me, replies, apply=False)
        except Exception as e:
            # The first failure of a batch is worth a warning; the tries after it (an outage can
            # take many, up to the replies' complete-by) are said at the end, if given up.
            level = logging.WARNING if n == 1 else logging.DEBUG
            log.log(level, "%d repl(ies) failed to send (try %d): %r", len(replies), n, e)
            return e
        # Committed: these slots are free now, not once each call's task next runs. A refill
        # taken with them is already counted; the next batch's reservation must not count them
        # twice, or it would take nothing.
        for request_id, *_ in replies:
            self._release(request_id)
            self._settled.add(request_id)  # until its call's end (execute): nothing to hand back
        try:  # once: the batch is committed, whatever happens here
            self._committed(len(replies), applied)
        except Exception as e:
            log.exception("agent %s: after a reply batch committed: %r", self.me, e)
        return None

    def _committed(self, replies: int, applied: ApplyResult | None) -> None:
        self.completed += replies
        self.batches += 1
        if applied is None:
            self.on_reply()  # a scheduler has replies to apply
        else:  # applied, and the next steps dispatched and taken as far as we have room
            self._applied(applied)

    def _applied(self, applied: ApplyResult) -> None:
        """Replies this role applied itself: their alerts logged, metrics and task spans told."""
        log_raised(log, applied.alerts)
        self.on_applied(applied)
        self.tracer.applied(applied)

    async def _release_unknown_takes(self) -> None:
        """Hand back the requests this instance holds in the store but never started: taken by a
        transaction that failed after it may have committed. Left alone they would wait for
        their complete-by and then count as a failed attempt of a call that never ran; released,
        the scheduler dispatches a new attempt at once, with no failure counted, as for a
        graceful stop (DEP4). New reservations are held back first (``_sweeping``) and the
        ones out are waited for, so every request this instance took is then running (held),
        ran and ended unanswered (``_unanswered``: the supervisor's), or lost. An attempt past
        its complete-by is not touched either: that is the supervisor's to rescue."""
        self._sweeping = True
        try:
            try:
                await asyncio.wait_for(self._no_reservations.wait(), SWEEP_WAIT)
            except TimeoutError:
                return  # a transaction still out: next round
            # Read before the store is: a call whose reply commits meanwhile leaves _held after
            # that commit, so it is either in this copy or no longer taken in the store.
            self._forget_unanswered()
            known = set(self._held) | set(self._unanswered)
            ids = await self.store.requests_taken_by(self.me)
            lost = [i for i in ids if i not in known]
            if lost:
                await self._release_requests(
                    lost, "taken in a transaction whose commit was not confirmed; never started"
                )
                log.warning(
                    "agent %s: released %d request(s) taken by a transaction that failed after "
                    "committing: %s",
                    self.me,
                    len(lost),
                    ", ".join(map(str, lost)),
                )
                self.on_reply()  # a scheduler has replies to apply
            await self.health.return_unknown_trials()
            self._takes_unknown = False
        finally:
            self._sweeping = False

    def _remember_unanswered(self, msg: RequestMsg) -> None:
        """Counted from the call's end, not its start: off the path of calls that reply, and
        only longer than needed by the call's own duration."""
        self._unanswered[msg.id] = self.clock.monotonic() + msg.remaining + UNANSWERED_MARGIN
        if len(self._unanswered) > UNANSWERED_KEPT:
            self._forget_unanswered()

    def _forget_unanswered(self) -> None:
        now = self.clock.monotonic()
        self._unanswered = {i: t for i, t in self._unanswered.items() if t > now}

    async def _release_requests(self, ids: list[int], why: str, apply: bool = False) -> None:
        """Hand attempts back without counting a failure (a ``released`` reply, applied by a
        scheduler): one transaction for all of them. ``apply``: apply them in that transaction
        too (a stopping worker that also schedules: its own scheduler will not run again, and
        until applied the step stays ``running``, locked by a worker that is gone)."""
        replies = [(i, "released", None, why) for i in ids]
        applied = await self.store.send_replies(self.me, replies, apply=apply)
        if applied is not None:  # the table's waiting replies are applied with them
            self._applied(applied)

    def hurry(self) -> bool:
        """Skip what is left of the stop's grace period (a second stop signal): the calls still
        running are cancelled and their attempts handed back at once, uncounted, as when the
        grace period ends. Before the drain begins, it begins with none. False if it was hurried
        already (a third signal changes nothing more)."""
        if self._hurried.is_set():
            return False
        self._hurried.set()
        return True

    async def _within_grace(self, waits: set[asyncio.Task[Any]], end: float) -> None:
        """Wait until every one of ``waits`` is done, the loop's time reaches ``end``, or
        :meth:`hurry` is called, whichever comes first."""
        loop = asyncio.get_running_loop()
        hurried = asyncio.create_task(self._hurried.wait())
        try:
            while waits and not self._hurried.is_set() and (left := end - loop.time()) > 0:
                await asyncio.wait(waits | {hurried}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                waits = {w for w in waits if not w.done()}
        finally:
            hurried.cancel()

    async def drain(self) -> None:
        """Graceful stop: let in-flight requests finish within the grace period, cancel the rest."""
        self._stopping = True  # a reply batch still in flight takes nothing more
        self._no_young.set()  # nor waits for calls that may never answer
        loop = asyncio.get_running_loop()
        end = loop.time() + self.settings.shutdown_grace
        running: dict[asyncio.Task[None], RequestMsg] = {}
        pending: set[asyncio.Task[None]] = set()
        # A transaction already in flight (a reply batch, a scheduler round of this worker) may
        # still bring requests reserved before the stop: wait for it, and for the calls it starts.
        while (self.tasks or self._reserving > 0) and not pending:
            if self.tasks:
                running.update(self.tasks)
                await self._within_grace(set(self.tasks), end)
                pending = {t for t in running if not t.done()}
            else:
                reserved = asyncio.create_task(self._no_reservations.wait())
                await self._within_grace({reserved}, end)
                if not reserved.done():
                    reserved.cancel()
                    break
        # From here on nothing starts: a transaction still in flight leaves its requests taken,
        # for a rescue. Calls started during the last wait are cancelled with the rest.
        self._drained = True
        running.update(self.tasks)
        pending = {t for t in running if not t.done()}
        # Calls whose reply committed but whose end waits for a health report: cancelling that
        # wait leaves nothing to hand back (a release now would only be recorded stale).
        answered = {running[t].id for t in pending if running[t].id in self._settled}
        # Their complete-by, read before the cancellation ends their tasks (and forgets it).
        deadlines = {running[t].id: self._deadlines.get(running[t].id) for t in pending}
        if running:
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=CANCELLED_WAIT)
            # Hand the unfinished attempts back at once, without counting a failure, instead of
            # leaving them to expire at complete-by.
            if self._sender is not None:  # replies already made are sent, not released
                # The sender tries until then and no longer (each reply's complete-by may be far
                # off): what it has not sent by then is left to expire, as the stop cannot wait.
                self._send_by = self.clock.monotonic() + REPLIES_WAIT
                await asyncio.wait({self._sender}, timeout=REPLIES_WAIT)
            answered |= self._replied
            # Past its complete-by an attempt is the supervisor's, and the agent sends nothing
            # for it (AGT4), not even a release: a call that ended silent at complete-by and
            # still waited for its health report, or whose time ran out during the grace period.
            now = self.clock.monotonic()
            late = [i for i, d in deadlines.items() if i not in answered and d is not None and d <= now]
            if late:
                log.info("requests %s: past complete-by at the stop: not released (they expire)", late)
            unsent = [i for i in deadlines if i not in answered and i not in late]
            if unsent:
                try:  # bounded: a stop has a deadline
                    await self.stop_writes.write(
                        self._release_requests(
                            unsent, "agent stopped before the call finished", self.settings.apply_replies
                        )
                    )
                except Exception as e:
                    log.warning("requests %s: could not release them (they will expire): %r", unsent, e)
        self.attempts.shutdown()
