"""Operator alerts (OPS4): durable records, acknowledgement, and pluggable sinks.

Transitions write an alert row (``task_error``, ``compensation_failed``, ``step_escalated``) in
the same transaction as the failure it reports. Delivering it to people is a separate, durable
outbox: a background loop reads the alerts each sink has not received yet and sends them; what
became of each (alert, sink) pair is a row in ``alert_deliveries`` (attempts, next retry,
delivered, gave up). A failed send is retried with back-off; it never blocks the roles, which run
on their own tasks and never wait for a sink.

Only one process delivers at a time: the loop runs under the ``alerts`` lease, among the workers
whose application configures sinks (a worker started without ``--app`` has none, so it does not
campaign). Delivery is at least once: a leader that dies between sending and recording lets its
successor send again, so receivers should deduplicate by alert id (webhooks carry it as the
``Idempotency-Key`` header).

Every record the leader writes (delivered, failed or given up, expired) is fenced by its term
(LEAD4, :class:`Fence`): a paused ex-leader that wakes up after a successor took the lease changes
nothing (its write raises :class:`~stepwarden.errors.LostOwnership` and its leader work ends), so
it cannot give up, on the record, an alert the new leader would otherwise still deliver.

Sinks: :class:`LogSink`, :class:`WebhookSink` (``httpx``) and :class:`CallableSink` (any function,
plain or async), configured with :meth:`stepwarden.App.alert_sink`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import random
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .clock import SYSTEM_CLOCK, Clock
from .daemon_pool import DaemonPool
from .errors import InputError, LostOwnership, NotFound
from .leader import Leadership
from .policies import Backoff, check_count, check_seconds, show
from .store import Store
from .store.base import Row, Tx
from .store.supervision import leader_fence
from .store.transitions import event
from .store.views import iso, show_alert
from .workflow import check_key, check_name

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("stepwarden.alerts")
# The threads of plain-callable sinks, by name: a stopping worker does not wait for them.
SINK_THREAD_PREFIX = "stepwarden-alert-sink"

#: The lease under which one process delivers alerts to the sinks.
ALERT_LEASE = "alerts"
DEFAULT_BACKOFF = Backoff(initial=1.0, multiplier=2.0, maximum=300.0, jitter=0.2)


@dataclass(frozen=True)
class Alert:
    """An operator alert, as the sinks receive it. Times are seconds since the epoch."""

    id: int
    kind: str
    task_id: int | None
    step: str | None
    message: str
    created_at: float
    acked_at: float | None = None
    acked_by: str | None = None

    @classmethod
    def from_row(cls, row: Row) -> Alert:
        return cls(
            id=int(row["id"]),
            kind=str(row["kind"]),
            task_id=None if row["task_id"] is None else int(row["task_id"]),
            step=row["step"],
            message=str(row["message"]),
            created_at=float(row["created_at"]),
            acked_at=None if row["acked_at"] is None else float(row["acked_at"]),
            acked_by=row["acked_by"],
        )

    def to_dict(self) -> dict[str, Any]:
        """The alert in a log record and a sink's payload (ISO 8601 UTC times): ``alerts --json``
        adds what became of it at each sink (``deliveries``)."""
        return {
            "id": self.id,
            "kind": self.kind,
            "task_id": self.task_id,
            "step": self.step,
            "message": self.message,
            "created_at": iso(self.created_at),
            "acked_at": iso(self.acked_at),
            "acked_by": self.acked_by,
        }


# -- sinks ------------------------------------------------------------------------------------------


class AlertSink(Protocol):
    """Where alerts go. ``send`` raises to say the delivery failed (it is then retried after
    ``backoff.delay(attempt)``, at most ``max_attempts`` times if that is set); it is given
    ``timeout`` seconds. ``name`` identifies the sink in the store: keep it stable across restarts."""

    name: str
    timeout: float
    backoff: Backoff
    max_attempts: int | None

    async def send(self, alert: Alert) -> None: ...


_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]+")


def _sink_name(name: str) -> str:
    return _UNSAFE.sub("-", name).strip("-")[:128] or "sink"


class _Sink:
    """What every sink here checks when it is made: ``name`` 1-128 letters, digits, ``_ . : -``;
    ``timeout`` a finite number of seconds more than 0 and at most 10**9 (about 31 years,
    :data:`~stepwarden.policies.MAX_SECONDS`); ``backoff`` a :class:`Backoff` or None (the
    default); ``max_attempts`` None (for ever) or an int from 1 to 2**31-1. Anything else (a
    bool, text, nan, 1.5 attempts) raises :class:`~stepwarden.errors.InputError` naming the sink
    and the setting: before, "5" failed every delivery with a TypeError, and nan or inf never
    timed out."""

    def __init__(self, name: str, timeout: float, backoff: Backoff | None, max_attempts: int | None) -> None:
        check_name("alert sink name", name)
        what = f"alert sink {name!r}:"
        seconds = check_seconds(f"{what} timeout", timeout, above=True)
        if backoff is not None and not isinstance(backoff, Backoff):
            raise InputError(f"{what} backoff must be a stepwarden Backoff or None, not {show(backoff)}")
        if max_attempts is not None:
            max_attempts = check_count(f"{what} max_attempts", max_attempts, unit=" (or None)")
        self.name = name
        self.timeout = seconds
        self.backoff = backoff or DEFAULT_BACKOFF
        self.max_attempts = max_attempts

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class LogSink(_Sink):
    """Alerts as log records of the logger ``stepwarden.alerts`` (level WARNING by default), the
    alert itself in the record's ``alert`` attribute for structured handlers."""

    def __init__(
        self,
        name: str = "log",
        *,
        logger: logging.Logger | None = None,
        level: int = logging.WARNING,
    ) -> None:
        super().__init__(name, 5.0, None, None)
        if logger is not None and not isinstance(logger, logging.Logger | logging.LoggerAdapter):
            raise InputError(
                f"alert sink {name!r}: logger must be a logging.Logger or None, not {show(logger)}"
            )
        if isinstance(level, bool) or not isinstance(level, int):
            raise InputError(
                f"alert sink {name!r}: level must be a logging level (an int), not {show(level)}"
            )
        self.logger = logger or log
        self.level = level

    async def send(self, alert: Alert) -> None:
        self.logger.log(
            self.level,
            "ALERT %s #%d task=%s step=%s: %s",
            alert.kind,
            alert.id,
            alert.task_id,
            alert.step,
            alert.message,
            extra={"alert": alert.to_dict()},
        )


class WebhookSink(_Sink):
    """POST each alert as JSON (:meth:`Alert.to_dict`) to ``url``; any answer other than 2xx, a
    timeout or a connection error counts as a failure and is retried with back-off. The request
    carries ``Idempotency-Key: stepwarden-alert-ID`` so the receiver can drop a repeat."""

    def __init__(
        self,
        url: str,
        *,
        name: str = "webhook",
        headers: dict[str, str] | None = None,
        timeout: float = 5.0,
        backoff: Backoff | None = None,
        max_attempts: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InputError(f"a webhook URL must be text starting with http:// or https://, not {show(url)}")
        super().__init__(name, timeout, backoff, max_attempts)
        if headers is not None and (
            not isinstance(headers, Mapping)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items())
        ):
            raise InputError(
                f"alert sink {name!r}: headers must be a dict of text to text or None, not {show(headers)}"
            )
        self.url = url
        self.headers = dict(headers or {})
        self.transport = transport

    async def send(self, alert: Alert) -> None:
        import httpx  # here, not at import time: the CLI starts faster without it

        headers = {"Idempotency-Key": f"stepwarden-alert-{alert.id}", **self.headers}
        async with httpx.AsyncClient(timeout=self.timeout, transport=self.transport) as client:
            r = await client.post(self.url, json=alert.to_dict(), headers=headers)
        if not 200 <= r.status_code < 300:
            raise RuntimeError(f"webhook answered HTTP {r.status_code}")


class CallableSink(_Sink):
    """Call ``fn(alert)``: an async function is awaited, a plain one runs in a thread (it cannot be
    interrupted at its timeout: it runs on, and the delivery counts as failed). Raising means
    failed."""

    def __init__(
        self,
        fn: Callable[[Alert], Any],
        *,
        name: str | None = None,
        timeout: float = 5.0,
        backoff: Backoff | None = None,
        max_attempts: int | None = None,
    ) -> None:
        if not callable(fn):
            raise InputError(
                f"CallableSink fn must be a function of the alert (plain or async), not {show(fn)}"
            )
        default = f"callable:{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
        super().__init__(name or _sink_name(default), timeout, backoff, max_attempts)
        self.fn = fn
        self._pool: DaemonPool | None = None

    def _threads(self) -> DaemonPool:
        # Daemon threads, as the agents' (daemon_pool.py): a sink stuck for good does not hold
        # an application's exit.
        if self._pool is None:
            self._pool = DaemonPool(2, SINK_THREAD_PREFIX)
        return self._pool

    def close(self) -> None:
        """Let the sink's idle threads end (a stuck one runs on; the worker exits despite it)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def send(self, alert: Alert) -> None:
        if inspect.iscoroutinefunction(self.fn):
            await self.fn(alert)
            return
        # Not asyncio.to_thread: asyncio.run waits for the default executor without a timeout, so a
        # callable stuck against a dead host would keep a stopping worker alive. These threads are
        # named, and the worker command exits despite them (cli._exit_despite_stuck_threads).
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(self._threads(), contextvars.copy_context().run, self.fn, alert)
        if inspect.isawaitable(out):
            await out


class _OwnSink(_Sink):
    """An application's own object with ``name`` and ``send(alert)``: what it leaves out (``timeout``,
    ``backoff``, ``max_attempts``) takes the defaults of the sinks here, and its name is checked
    like theirs. Without this, delivery read ``sink.timeout`` from it and every round failed."""

    def __init__(self, inner: Any) -> None:
        timeout = getattr(inner, "timeout", 5.0)
        max_attempts = getattr(inner, "max_attempts", None)
        backoff = getattr(inner, "backoff", None)
        if not isinstance(timeout, int | float) or isinstance(timeout, bool):
            raise InputError(f"alert sink {inner!r}: timeout must be a number of seconds")
        if max_attempts is not None and (not isinstance(max_attempts, int) or isinstance(max_attempts, bool)):
            raise InputError(f"alert sink {inner!r}: max_attempts must be an integer or None")
        if backoff is not None and not isinstance(backoff, Backoff):
            raise InputError(f"alert sink {inner!r}: backoff must be a stepwarden Backoff or None")
        name = inner.name
        if not isinstance(name, str):
            raise InputError(f"alert sink {inner!r}: name must be a string")
        super().__init__(name, timeout, backoff, max_attempts)  # checked there: finite, > 0
        self.inner = inner

    async def send(self, alert: Alert) -> None:
        out = self.inner.send(alert)
        if inspect.isawaitable(out):
            await out

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()

    def __repr__(self) -> str:
        return repr(self.inner)


def as_sink(sink: AlertSink | Callable[[Alert], Any], name: str | None = None) -> AlertSink:
    if isinstance(sink, _Sink) or (hasattr(sink, "send") and hasattr(sink, "name")):
        if name is not None:
            raise InputError("name= is for a plain callable; give the sink its name when you make it")
        return sink if isinstance(sink, _Sink) else _OwnSink(sink)
    if callable(sink):
        return CallableSink(sink, name=name)
    raise InputError(f"an alert sink must be a sink or a callable, not {type(sink).__name__}")


# -- transactions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fence:
    """The lease term a leader's delivery records are conditioned on (LEAD4): ``holder`` still holds
    lease ``lease`` with ``term``, unexpired on the database clock. The dispatcher makes it from the
    :class:`~stepwarden.leader.Leadership` its lease keeper gives it (:meth:`of`)."""

    lease: str
    holder: str
    term: int

    @classmethod
    def of(cls, lead: Leadership) -> Fence:
        return cls(lead.name, lead.holder, lead.term)

    def check(self, tx: Tx) -> None:
        """Raise :class:`~stepwarden.errors.LostOwnership` unless the term is still held, before
        the transaction writes anything: the supervisor's own fence (``supervision.leader_fence``).
        Its lock waits (``alert_hold``, ``alerts_expired``: only on the supervisor's prune, which
        itself never waits) are cut at 1 s on PostgreSQL, as the supervisor's are: the share lock
        on the lease holds up this dispatcher's own renewal meanwhile."""
        leader_fence(tx, self.holder, self.lease, self.term)


def _fence(tx: Tx, fence: Fence | None) -> None:
    if fence is not None:
        fence.check(tx)


def ack_alert(tx: Tx, alert_id: int, by: str) -> tuple[dict[str, Any], bool]:
    """Acknowledge an alert; returns its view and whether this call acknowledged it (an alert
    acknowledged before keeps its first acknowledgement). An ``alert_id`` that is no positive
    64-bit int (``2**70``, ``0``, ``True``, ``"1"``) is an InputError, as on the command line."""
    from .policies import check_id

    check_key("acknowledged-by name", by)
    alert_id = check_id("alert id", alert_id)
    row = tx.one("alert_get", id=alert_id)
    if row is None:
        raise NotFound(f"no alert {alert_id}")
    changed = row["acked_at"] is None and tx.run("alert_ack", id=alert_id, by=by) > 0
    if changed:
        event(tx, "alert_acked", row["task_id"], by, alert=alert_id, kind=row["kind"])
    view = show_alert(tx, alert_id)  # the shape ``alerts --json`` prints, its deliveries with it
    assert view is not None
    return view, changed


def register_sinks(tx: Tx, names: Sequence[str]) -> None:
    # Not fenced: every worker with sinks registers them when it starts, before it campaigns (it is
    # configuration, not leader work), and a repeat inserts nothing (ON CONFLICT DO NOTHING).
    for name in names:
        tx.run("alert_sink_register", name=name)


def due(
    tx: Tx, names: Sequence[str], limit: int, max_age: float, fence: Fence | None = None
) -> dict[str, list[tuple[Alert, int]]]:
    """The alerts due to each sink. Only a read, but fenced too: a deposed leader learns it at the
    start of its next round, before it sends anything more."""
    _fence(tx, fence)
    return {
        name: [
            (Alert.from_row(r), int(r["attempts"]))
            for r in tx.all("alerts_due", sink=name, limit=limit, max_age=max_age)
        ]
        for name in names
    }


def expire(
    tx: Tx, names: Sequence[str], limit: int, max_age: float, me: str, fence: Fence | None = None
) -> dict[str, list[int]]:
    """Record the give-up of up to ``limit`` alerts per sink that it never delivered and no longer
    tries (older than ``max_age``); returns their ids by sink. Before, they were only left out of
    the next rounds: ``alerts`` showed a retry time long past, as if one were still coming. With
    ``fence``, a lease term no longer held raises LostOwnership and nothing is written."""
    _fence(tx, fence)
    why = f"not delivered within max_age ({max_age:g} s): no longer tried"
    out: dict[str, list[int]] = {}
    for name in names:
        ids = [int(r["id"]) for r in tx.all("alerts_expired", sink=name, max_age=max_age, limit=limit)]
        for alert_id in ids:  # each held against the prune by the read (see alert_hold)
            tx.run("alert_expired", sink=name, alert_id=alert_id, error=why, me=me)
        if ids:
            out[name] = ids
    return out


def record_delivered(tx: Tx, sink: str, alert_id: int, me: str, fence: Fence | None = None) -> None:
    # Fenced first (LEAD4): a deposed leader's record raises LostOwnership and writes nothing.
    _fence(tx, fence)
    # The alert may have been pruned while it was being sent (a retention shorter than max_age):
    # a delivery row must not outlive its alert, and nothing would ever prune it.
    if tx.one("alert_hold", alert_id=alert_id) is not None:
        tx.run("alert_delivered", sink=sink, alert_id=alert_id, me=me)


def record_failed(
    tx: Tx,
    sink: str,
    alert_id: int,
    delay: float,
    give_up: bool,
    error: str,
    me: str,
    fence: Fence | None = None,
) -> None:
    # Fenced as record_delivered: above all, a deposed leader must not record a give-up, after
    # which no leader would ever send the alert to this sink again.
    _fence(tx, fence)
    if tx.one("alert_hold", alert_id=alert_id) is None:
        return  # pruned while it was being sent, as in record_delivered
    tx.run(
        "alert_failed",
        sink=sink,
        alert_id=alert_id,
        delay=float(delay),
        give_up=bool(give_up),
        error=error[:2000],
        me=me,
    )


# -- the delivery loop ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlertSettings:
    """``interval``: how often the leader looks for alerts to deliver; ``batch``: at most this many
    per sink per round; ``max_age``: alerts older than this (seconds) are no longer sent.

    ``enabled`` is True or False; ``interval`` and ``max_age`` are finite numbers of seconds more
    than 0 and at most 10**9 (about 31 years, :data:`~stepwarden.policies.MAX_SECONDS`);
    ``batch`` is an int from 1 to 2**31-1. Anything else raises
    :class:`~stepwarden.errors.InputError` naming the field."""

    enabled: bool = True
    interval: float = 1.0
    batch: int = 20
    max_age: float = 86400.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise InputError(f"AlertSettings.enabled must be True or False, not {show(self.enabled)}")
        for name in ("interval", "max_age"):
            check_seconds(f"AlertSettings.{name}", getattr(self, name), above=True)
        object.__setattr__(self, "batch", check_count("AlertSettings.batch", self.batch))


class AlertDispatcher:
    """Delivers undelivered alerts to every sink; run it as lease work (``lead``) so that one
    process at a time does it. Sinks are served concurrently, each one's alerts in order.

    Given the lease's :class:`~stepwarden.leader.Leadership` (``lead`` always is; ``tick`` and
    ``deliver`` when passed one), every record is fenced by its term (:class:`Fence`): once the
    lease is someone else's, a write raises LostOwnership and ``lead`` ends. Without one (rounds
    driven by hand), the records are not fenced."""

    def __init__(
        self,
        store: Store,
        sinks: Sequence[AlertSink],
        me: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        settings: AlertSettings | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.sinks = list(sinks)
        self.me = me
        self.clock = clock
        self.settings = settings or AlertSettings()
        self.rng = rng or random.Random()
        self.delivered = 0
        self.failed = 0
        self.expired = 0
        self._next_expiry = 0.0  # monotonic: when the next round also records expired alerts

    def close(self) -> None:
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if callable(close):
                close()

    async def register(self) -> None:
        """Record the sinks in the store: each receives the alerts raised from its first registration on."""
        await self.store.transact(register_sinks, [s.name for s in self.sinks])

    async def lead(self, leadership: Leadership) -> None:
        await self.register()
        while True:
            failed = False
            try:
                await self.tick(leadership)
            except LostOwnership as e:
                # Deposed (paused past the lease, say): the record was refused and nothing written.
                # Stop, as the supervisor does; the lease keeper campaigns again in its own time.
                log.warning("alert delivery stops, nothing more recorded by %s: %s", self.me, e)
                return
            except Exception as e:  # the store is down: try again next round (REL3)
                log.warning("alert delivery round failed: %r", e)
                failed = True
            else:
                leadership.progress()
            # After a failed round (the store's pool unreachable, say) the wait counts towards
            # stall_after: a dispatcher that could deliver nothing kept its lease for ever (LEAD6).
            # After one that worked, idle or not, it does not, however long.
            await leadership.sleep(self.settings.interval, failed=failed)

    async def tick(self, leadership: Leadership | None = None) -> int:
        """One round: send what is due to every sink; returns how many deliveries succeeded."""
        s = self.settings
        fence = None if leadership is None else Fence.of(leadership)
        if self.clock.monotonic() >= self._next_expiry:
            await self._expire(fence)
        todo = await self.store.transact(due, [k.name for k in self.sinks], s.batch, s.max_age, fence)
        jobs = [self._drain(k, todo[k.name], leadership) for k in self.sinks if todo.get(k.name)]
        # Every sink's round ends before this one does: with a plain gather, one sink's store
        # error ended the round while the others' loops ran on untracked, sending again what the
        # next round read as still due, even after the lease was gone.
        results = await asyncio.gather(*jobs, return_exceptions=True)
        # A lost lease first: it ends the leader work, where another error only ends the round.
        errors = sorted((r for r in results if isinstance(r, BaseException)), key=_lost_first)
        if errors:
            raise errors[0]
        return sum(r for r in results if isinstance(r, int))

    async def _expire(self, fence: Fence | None = None) -> None:
        """Give up, on the record, the alerts past ``max_age``: once a minute, sooner while a
        backlog (a sink down for a day) is still being recorded."""
        s = self.settings
        expired = await self.store.transact(
            expire, [k.name for k in self.sinks], EXPIRE_BATCH, s.max_age, self.me, fence
        )
        backlog = any(len(ids) >= EXPIRE_BATCH for ids in expired.values())
        self._next_expiry = self.clock.monotonic() + (0.0 if backlog else EXPIRE_EVERY)
        for sink, ids in expired.items():
            self.expired += len(ids)
            log.error(
                "alert sink %s: %d alert(s) not delivered within max_age (%g s), no longer tried: %s",
                sink,
                len(ids),
                s.max_age,
                ", ".join(map(str, ids[:10])) + (", ..." if len(ids) > 10 else ""),
            )

    async def _drain(self, sink: AlertSink, items: list[tuple[Alert, int]], lead: Leadership | None) -> int:
        ok = 0
        for alert, attempts in items:
            ok += await self.deliver(sink, alert, attempts, lead)
            if lead is not None:
                lead.progress()
        return ok

    async def deliver(
        self, sink: AlertSink, alert: Alert, attempts: int = 0, lead: Leadership | None = None
    ) -> bool:
        """Send one alert to one sink and record the outcome, fenced by ``lead``'s term if given
        (LostOwnership, nothing recorded, when the lease was lost meanwhile)."""
        fence = None if lead is None else Fence.of(lead)
        try:
            await _alive_while(lead, asyncio.wait_for(sink.send(alert), timeout=sink.timeout))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            n = attempts + 1
            give_up = sink.max_attempts is not None and n >= sink.max_attempts
            delay = sink.backoff.delay(n, self.rng)
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            await self.store.transact(record_failed, sink.name, alert.id, delay, give_up, why, self.me, fence)
            self.failed += 1
            if give_up:
                log.error("alert %d: sink %s failed %d time(s), giving up: %s", alert.id, sink.name, n, why)
            else:
                log.warning(
                    "alert %d: sink %s failed (attempt %d, next in %.1fs): %s",
                    alert.id,
                    sink.name,
                    n,
                    delay,
                    why,
                )
            return False
        await self.store.transact(record_delivered, sink.name, alert.id, self.me, fence)
        self.delivered += 1
        return True


def _lost_first(e: BaseException) -> bool:
    return not isinstance(e, LostOwnership)


# Alerts past max_age are given up on the record once a minute, this many per sink per round.
EXPIRE_EVERY = 60.0
EXPIRE_BATCH = 500

# How often a leader waiting on something bounded (a send under its sink's timeout, the interval
# between rounds) tells its lease keeper it is alive; below LeaseSettings.stall_after's default.
ALIVE_EVERY = 1.0


async def _alive_while(lead: Leadership | None, bounded: Awaitable[None]) -> None:
    """Await ``bounded`` (it ends by itself: a send under ``wait_for``, a sleep), reporting progress
    to the lease keeper meanwhile. A sink timeout above the lease's ``stall_after`` had the keeper cancel
    the send as a stall: no failure was recorded, so the alert never reached ``max_attempts``
    and the lease went from worker to worker, each sending it again."""
    job = asyncio.ensure_future(bounded)
    try:
        while True:
            done, _ = await asyncio.wait({job}, timeout=ALIVE_EVERY)
            if lead is not None:
                lead.progress()
            if done:
                return job.result()
    finally:
        if not job.done():
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await job
