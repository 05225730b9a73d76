"""One attempt of one request: its tries, each call of the operation under the attempt's
deadline, and the reply it ends with -- or silence, at complete-by (AGT2, AGT4, AGT5, AGT7).

Kept apart from the agent role (``agent_role.py``), which pulls requests, holds their slots and
sends the replies: what happens inside one call has rules enough of its own.

- **Async or plain** (AGT7). A coroutine function, or an object whose ``__call__`` is one, runs
  on the event loop under ``asyncio.timeout``. Anything else runs in a thread of the agent's own
  pool; if what it returns is awaitable (a plain decorator around an ``async def``), that is
  awaited on the loop under the same deadline, not stored as the text of a coroutine object.
- **Complete-by** (AGT4). Past the deadline nothing is sent: not a value an async operation
  returned after swallowing its cancellation, not the error it raised instead. A plain function
  cannot be interrupted; its thread runs on, and its slot stays counted until the thread is free
  (the agent pulls nothing into a thread it cannot have). A plain call still waiting for a thread
  at the deadline is dropped unstarted, and the thread checks the deadline again before it starts
  the operation: a call that never started is no failure of the service.
- **Per-agent threads.** Each agent has a pool of its own, as many threads as its concurrency:
  a hung service holds only its own agent's threads, so it can neither starve another agent's
  calls nor make them hang to complete-by and open that agent's breaker. A shared pool would need
  a per-agent cap to do the same, and would buy nothing: idle threads cost nothing until used.
- **Failures** (AGT5). Anything the operation raises, ``BaseException`` included (a
  ``SystemExit``, its own ``CancelledError``: they would otherwise end the worker or the request
  without a word), is judged by the agent's ``classify``; a classify that raises or answers
  anything but "transient"/"permanent" makes the failure permanent, naming the bad answer. Only
  a stop of the role's own (a cancel of the call's task) passes through. ``KeyboardInterrupt``
  is the operation's too, also on the main thread: a real Ctrl-C reaches a worker as a signal
  its loop handles (the command line's handler, ``asyncio.run``'s), not as an exception raised
  inside a call, and one an async operation raised itself ended the worker, then every worker
  that ran the step after it (found by review).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import random
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from .agent_definition import Agent, Handler, Request
from .agent_health import AgentHealth
from .agent_settings import MIN_TRY_LEFT, AgentSettings
from .classify import PERMANENT, error_text, judge, shown
from .clock import Clock
from .daemon_pool import DaemonPool
from .errors import InputError, Permanent, Transient
from .store import RequestMsg
from .tracing import AttemptSpan, NoAttempt
from .workflow import encode_result, storable_text

Outcome = tuple[str, Any, str | None]  # (outcome, result, error) of a reply


class Expired(Exception):
    """The attempt's deadline came before the call answered. ``started``: the operation ran (a
    plain call dropped from its pool's queue, or turned back by its thread, did not)."""

    def __init__(self, started: bool) -> None:
        super().__init__("complete-by passed")
        self.started = started


class Failed(Exception):
    """The operation raised ``error``: any exception but a stop of the role's own. Its repr is
    read safely (``shown``): one that raises would otherwise escape as a failure of the agent's,
    and the attempt would end with no reply."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(shown(error))
        self.error = error


class _NotStarted(Exception):
    """Raised in a pool thread that found the call's deadline passed (or the call abandoned)."""


class _Start:
    """Whether a plain call's thread began the operation, settled once under a lock: either the
    thread starts it first, or the role abandons it first (at complete-by, or on a stop)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = False
        self.abandoned = False

    def begin(self) -> bool:
        with self.lock:
            self.started = not self.abandoned
            return self.started

    def abandon(self) -> bool:
        """Returns whether the operation had started."""
        with self.lock:
            self.abandoned = True
            return self.started


@dataclass
class AttemptState:
    """What the role needs from an attempt besides its reply: the health reports it made (the
    request's task waits for them after the reply is queued) and whether it called the service
    at all (a trial that did not is given back unrun, not counted failed)."""

    reports: list[asyncio.Task[None]] = field(default_factory=list)
    called: bool = False

    def reported(self, report: asyncio.Task[None] | None) -> asyncio.Task[None] | None:
        """Keep ``report`` (a health report's task, None if it needed none: see
        :meth:`AgentHealth.report_soon`) for the request's end to wait for; returns it."""
        if report is not None:
            self.reports.append(report)
        return report


def is_async(handler: Callable[..., Any]) -> bool:
    """A coroutine function (``functools.partial`` of one included), or an object whose class
    defines ``async def __call__``: run on the loop. Decided by looking, not by calling; a plain
    wrapper around an ``async def`` is caught at run time instead (see :meth:`Attempts.call`)."""
    call = getattr(type(handler), "__call__", None)  # noqa: B004 - the class's method, not callable()
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)


class Attempts:
    """Runs attempts for the agents of one role: their thread pools and the rules above.

    ``busy(agent)`` / ``free(agent)``: a plain call abandoned at complete-by (or on a stop) keeps
    its thread; the role counts it in flight from ``busy`` until ``free`` (called on the loop).
    ``full(agent)``: every slot of the agent is taken (see :meth:`run`, on an open breaker)."""

    def __init__(
        self,
        me: str,
        agents: Mapping[str, Agent],
        health: AgentHealth,
        clock: Clock,
        settings: AgentSettings,
        *,
        threads: int | None = None,
        busy: Callable[[str], None],
        free: Callable[[str], None],
        full: Callable[[str], bool] = lambda agent: False,
    ) -> None:
        self.me = me
        self.health = health
        self.clock = clock
        self.store_id = ""  # the store's identity, set by the role before its first pull
        self.settings = settings
        self.busy, self.free, self.full = busy, free, full
        self.rng = random.Random()
        # Whether each operation runs on the loop, decided once (the operations are fixed by now).
        self.on_loop = {
            name: {op: is_async(h) for op, h in a.operations.items()} for name, a in agents.items()
        }
        # One pool per agent, as many threads as its slots (``threads`` overrides, for tests);
        # daemon threads, which a call that never returns does not keep from the process's exit.
        self.pools = {
            name: DaemonPool(threads or a.concurrency, f"stepwarden-agent-{name}")
            for name, a in agents.items()
        }

    def shutdown(self) -> None:
        """Drop the calls still queued; threads still running are left to finish (unawaited)."""
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    async def run(
        self,
        agent: Agent,
        msg: RequestMsg,
        deadline: float,
        trial: bool,
        span: AttemptSpan | NoAttempt,
        state: AttemptState,
    ) -> Outcome | None:
        """The reply to send, or None to stay silent (complete-by passed, or came too close)."""
        handler = agent.operations.get(msg.operation)
        if handler is None:
            # A worker of an older or newer version (a rolling deploy): the operation exists,
            # elsewhere. Handed back uncounted, not failed: nothing was called, and nothing is
            # said about the service (no health report; a trial is given back unrun).
            return (
                "released",
                None,
                f"agent {agent.name!r} has no operation {msg.operation!r} in worker {self.me}",
            )
        req = Request(
            task_id=msg.task_id,
            step=msg.idempotency_key.split(":", 1)[1],
            attempt=msg.attempt,
            kind=msg.kind,
            idempotency_key=msg.idempotency_key,
            input=msg.payload.get("input"),
            results=msg.payload.get("results") or {},
            undo=msg.payload.get("undo"),
            complete_by=msg.complete_by,
            deadline=deadline,
            store_id=self.store_id,
        )
        tries, backoff = msg.policy.tries, msg.policy.in_attempt
        health, name = self.health, agent.name
        last = "no attempt made"
        need = MIN_TRY_LEFT  # the time a try needs: at least the previous try's
        for n in range(1, tries + 1):
            if deadline - self.clock.monotonic() < need:
                if n == 1:
                    return None  # taken with almost nothing left: nothing to try (see MIN_TRY_LEFT)
                break
            first_of_trial = trial and n == 1
            held = None if first_of_trial else health.may_call(name)
            if held is not None and self._blocks_trial(name):
                # Every slot is held: the instance pulls nothing, so it could never take the
                # half-open trial, and attempts like this one, each try refused, kept the
                # breaker open until they ran out of tries or time (19 s of a 1 s cool-off).
                # This one ends now, as a retry, and gives its slot to the trial.
                last = held if n == 1 else f"{held} (the last call: {last})"
                break
            if held is not None:
                # The try fails fast (AGT3); the attempt goes on with its tries, and calls again
                # once the breaker closes (a slot is free for the trial).
                last = held
            else:
                began = self.clock.monotonic()
                start = _Start()
                try:
                    result = await self.call(
                        name, handler, req, deadline, self.on_loop[name][msg.operation], start
                    )
                except asyncio.CancelledError:
                    # A stop: a call that began may have reached the service (a plain one runs on
                    # in its thread). A trial's is then its call, counted failed, not given back
                    # unrun: given back, another instance would try the service at once, beside it.
                    state.called = state.called or start.started
                    raise
                except Expired as e:
                    if not e.started:
                        return None
                    # At complete-by the call is cancelled and nothing is sent (AGT4); it is a
                    # failed call for the breaker and this instance's health (AGT3): uncounted, a
                    # service that hangs would never trip the breaker, and every request would
                    # hold its slot for the whole budget.
                    state.called = True
                    last = "no answer by complete-by (cancelled)"
                    span.try_failed(n, last)
                    state.reported(health.report_soon(name, False, last, first_of_trial))
                    return None
                except Failed as f:
                    state.called = True
                    took = self.clock.monotonic() - began  # the call's, not its report's
                    kind, trouble = judge(agent.classify, f.error)
                    if kind == PERMANENT:
                        # the service answered: it is up
                        state.reported(health.report_soon(name, True, None, first_of_trial))
                        return "error", None, describe(f.error, trouble)
                    last = describe(f.error)
                    span.try_failed(n, last)
                    report = state.reported(health.report_soon(name, False, last, first_of_trial))
                    # Its verdict decides what comes next (may the next try call? is this
                    # instance still healthy?): waited for, but never past complete-by.
                    if not await self._settled(report, deadline):
                        return None
                    if not health.healthy(name):
                        # Others succeed where this instance fails: hand the attempt back,
                        # uncounted, so that a healthy instance runs it now (AGT6).
                        return "released", None, f"instance {self.me} unhealthy for {name!r}: {last}"
                    need = max(MIN_TRY_LEFT, took)
                else:
                    state.called = True
                    state.reported(health.report_soon(name, True, None, first_of_trial))
                    try:  # encoded once, here: a result the store cannot keep is this step's error
                        return "ok", encode_result(result, self.settings.max_result_bytes), None
                    except InputError as e:
                        return "error", None, f"the operation's result cannot be stored: {e}"
            delay = backoff.delay(n, self.rng)
            if n == tries or self.clock.monotonic() + delay + need > deadline:
                break  # no time for another try that could answer: say so now
            held = health.may_call(name)
            if held is not None and self._blocks_trial(name):  # as above, before sleeping for nothing
                last = f"{held} (the last call: {last})"
                break
            await self.clock.sleep(delay)
        # Transient failures used up this attempt's tries (or its time): say so before
        # complete-by, so the step is retried now rather than after its deadline (past it, the
        # role sends nothing: see AgentRole._execute).
        return "retry", None, f"transient: {last}"

    def _blocks_trial(self, agent: str) -> bool:
        """Whether an attempt that waits out the open breaker keeps the trial from being taken:
        every slot of the agent is taken, and none of them runs this instance's trial (if one
        does, ending the attempt frees nothing the trial needs, and would cost its step a failure)."""
        return self.full(agent) and not self.health.breakers[agent].trial

    async def _settled(self, report: asyncio.Task[None] | None, deadline: float) -> bool:
        """Wait for ``report`` (None: settled already) until ``deadline``; False if the deadline
        came first."""
        left = deadline - self.clock.monotonic()
        if report is not None and left > 0 and not report.done():
            await asyncio.wait({report}, timeout=left)
        return (report is None or report.done()) and self.clock.monotonic() < deadline

    async def call(
        self,
        agent: str,
        handler: Handler,
        req: Request,
        deadline: float,
        on_loop: bool,
        start: _Start | None = None,
    ) -> Any:
        """The operation's result; :class:`Expired` at the deadline, :class:`Failed` with what
        it raised, or the role's own cancellation. ``on_loop``: ``is_async(handler)``.
        ``start`` says, afterwards, whether the operation began (however the call ended)."""
        start = start or _Start()
        if on_loop:
            return await self._on_loop(_awaited(handler, req), deadline, start)
        loop = asyncio.get_running_loop()
        # In the caller's context, so the attempt's span (and other context) is current in the thread.
        ctx = contextvars.copy_context()
        job = self.pools[agent].submit(self._in_thread, handler, req, deadline, ctx, start)
        waiting = asyncio.wrap_future(job, loop=loop)
        try:
            done, _ = await asyncio.wait({waiting}, timeout=max(0.0, deadline - self.clock.monotonic()))
        except asyncio.CancelledError:  # the role stops: the thread, if it started, runs on
            self._abandon(agent, job, start, loop)
            raise
        if not done:
            raise Expired(self._abandon(agent, job, start, loop))
        try:
            result = waiting.result()
        except _NotStarted:
            raise Expired(False) from None
        except BaseException as e:  # SystemExit in a thread included: the operation's failure
            raise Failed(e) from None
        if inspect.isawaitable(result):
            # A plain callable that returned a coroutine (a plain decorator around an async def):
            # the operation has not run yet; it runs here, under the same deadline (AGT7).
            return await self._on_loop(result, deadline, start)
        return result

    def _in_thread(
        self, handler: Handler, req: Request, deadline: float, ctx: contextvars.Context, start: _Start
    ) -> Any:
        """In a pool thread: start the operation only before its deadline and if not abandoned."""
        if self.clock.monotonic() >= deadline or not start.begin():
            raise _NotStarted
        return ctx.run(handler, req)

    def _abandon(self, agent: str, job: Future[Any], start: _Start, loop: asyncio.AbstractEventLoop) -> bool:
        """Give up waiting for a plain call: dropped if no thread took it yet, else its thread
        stays counted busy until it is free. Returns whether the operation started."""
        started = start.abandon()
        if job.cancel() or job.done():
            self._discard(job)
            return started
        self.busy(agent)

        def ended(_: Future[Any]) -> None:
            self._discard(job)
            self.free(agent)

        def from_thread(f: Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the worker is leaving
                loop.call_soon_threadsafe(ended, f)

        job.add_done_callback(from_thread)
        return started

    @staticmethod
    def _discard(job: Future[Any]) -> None:
        """A late result is dropped unsent; a coroutine in it is closed, never to run."""
        if job.done() and not job.cancelled() and job.exception() is None:
            result = job.result()
            if inspect.iscoroutine(result):
                result.close()

    async def _on_loop(self, work: Awaitable[Any], deadline: float, start: _Start) -> Any:
        """Run an awaitable operation on the loop until ``deadline`` (see the module docstring).
        With no time left it is not started: a coroutine is closed, never to run."""
        task = asyncio.current_task()
        left = deadline - self.clock.monotonic()
        if left <= 0:
            if inspect.iscoroutine(work):
                work.close()
            raise Expired(False)
        start.started = True
        timeout = asyncio.timeout(left)
        try:
            async with timeout:
                result = await work
        except BaseException as e:
            if task is not None and task.cancelling():
                # A stop (drain) cancelled the call: the role's, whatever the operation made of it.
                if isinstance(e, asyncio.CancelledError):
                    raise
                raise asyncio.CancelledError from e
            if timeout.expired():
                # Complete-by, whatever the operation did with its cancellation (a Permanent
                # raised in its handler of CancelledError, say): nothing is sent (AGT4).
                raise Expired(True) from None
            raise Failed(e) from None
        if timeout.expired():
            raise Expired(True)  # it swallowed the cancellation of complete-by and returned
        if task is not None and task.cancelling():
            # A stop cancelled the call and the operation swallowed it: still a stop, rather than
            # a reply after drain released the attempt.
            raise asyncio.CancelledError
        return result


async def _awaited(handler: Handler, req: Request) -> Any:
    """An async operation's call as one coroutine: the handler is called only once it is awaited,
    so that what the call itself raises is the operation's failure, as what it awaits is."""
    return await handler(req)


def describe(e: BaseException, trouble: str | None = None) -> str:
    """An operation's failure as error text the store keeps (see ``storable_text``), at most
    1000 characters; ``trouble``: what went wrong in judging it (a bad classify). Never raises:
    an exception whose ``__str__`` fails is described by its type and a note saying so
    (``error_text``), so that its attempt still replies at once."""
    text = storable_text(error_text(e) or type(e).__name__)
    out = text if isinstance(e, Permanent | Transient) else f"{type(e).__name__}: {text}"
    if trouble is not None:
        out = f"{storable_text(trouble)} (judging {out})"
    return out[:1000]
