"""Reply queues for applications (SCH8): a task's status messages, in order, at least once.

A task submitted with ``reply_to="web-1"`` gets a message on queue ``web-1`` at every change an
application cares about (``received``, ``step_completed``, ``processed``, ``error``,
``compensating``, ``step_compensated``, ``compensated``, ``cancelled``, ``retried``), written in
the same transaction as the change itself. Consumers read a queue in order:

* **Positions in commit order.** A message gets its position in the queue (``seq``) from the
  first reader after it committed, one reader per queue at a time (``replies.sql`` says why ids
  would not do on PostgreSQL), so a cursor never passes a message that is committed later.
* **Durable cursors.** A consumer with a name keeps its cursor in the store, per (queue, consumer):
  acknowledging a message moves the cursor to it (acknowledgements are cumulative), and a consumer
  that restarts under the same name resumes after the last message it acknowledged. Only messages
  delivered but not yet acknowledged can come twice. Several names read the same queue
  independently (each gets every message); one name is one reader at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .clock import SYSTEM_CLOCK, Clock, sleep_or_wake
from .errors import InputError, NotFound, StoreError
from .policies import check_count, check_seconds, show
from .store import FINAL_TASK_STATES, Store
from .store.base import Row, Tx, read_only
from .store.sqlite_files import primary_code
from .workflow import check_name

if TYPE_CHECKING:
    from typing import Self

log = logging.getLogger("stepwarden.replies")

#: Message kinds after which a task is final (until an operator retries it: ``retried``).
FINAL_KINDS = FINAL_TASK_STATES
#: How many messages one read gives positions to; the rest wait for the next read.
SEQUENCE_BATCH = 1000


@dataclass(frozen=True)
class ReplyMessage:
    """One status message of a reply queue. ``body`` is the message as written (it carries
    ``task_id``, ``correlation_id``, ``kind`` and, by kind, ``step``, ``results``, ``error``,
    ``reason``); ``seq`` is its position in the queue, ``id`` its row id."""

    queue: str
    seq: int
    id: int
    task_id: int
    correlation_id: str | None
    kind: str
    body: dict[str, Any]
    created_at: float
    raw: str = field(repr=False, compare=False, default="")

    @property
    def step(self) -> str | None:
        step = self.body.get("step")
        return None if step is None else str(step)

    def to_dict(self) -> dict[str, Any]:
        return {**self.body, "queue": self.queue, "seq": self.seq}


def _message(row: Row, queue: str | None = None) -> ReplyMessage:
    raw = str(row["body"])
    return ReplyMessage(
        queue=str(row.get("queue") or queue or ""),
        seq=int(row["seq"]) if row.get("seq") is not None else 0,
        id=int(row["id"]),
        task_id=int(row["task_id"]),
        correlation_id=row["correlation_id"],
        kind=str(row["kind"]),
        body=json.loads(raw),
        created_at=float(row["created_at"]),
        raw=raw,
    )


# -- transactions -----------------------------------------------------------------------------------


def sequence(tx: Tx, queue: str, limit: int = SEQUENCE_BATCH) -> int:
    """Give the queue's committed messages that have no position yet their positions, in id
    order, under the queue's lock; returns how many got one."""
    if tx.one("reply_unsequenced", queue=queue) is None:
        return 0
    row = tx.one("reply_queue_lock", queue=queue)
    assert row is not None
    base = int(row["last_seq"])
    n = tx.run("reply_sequence", queue=queue, base=base, limit=limit)
    if n:
        tx.run("reply_queue_advance", queue=queue)  # to the highest position given (gaps allowed)
    return n


def read(
    tx: Tx, queue: str, consumer: str | None, after: int | None, limit: int
) -> tuple[int, list[ReplyMessage]]:
    """Position new messages, then read up to ``limit`` after ``after`` (``None``: after the
    consumer's durable cursor, created at 0 for a new consumer). Returns ``(after, messages)``."""
    sequence(tx, queue)
    if after is None:
        if consumer is None:
            after = 0
        else:
            tx.run("reply_cursor_create", queue=queue, consumer=consumer)
            row = tx.one("reply_cursor", queue=queue, consumer=consumer)
            after = int(row["position"]) if row else 0
    rows = tx.all("reply_read", queue=queue, after=after, limit=limit)
    return after, [_message(r, queue) for r in rows]


@read_only
def anything_to_read(tx: Tx, queue: str, after: int) -> bool:
    """Whether :func:`read` would position or return anything after ``after``: asked first on
    SQLite, in a transaction that takes no write lock, so that an idle consumer polling its queue
    does not take the workers' write lock several times a second for nothing."""
    return (
        tx.one("reply_unsequenced", queue=queue) is not None
        or tx.one("reply_after", queue=queue, after=after) is not None
    )


@read_only
def cursor_position(tx: Tx, queue: str, consumer: str) -> int | None:
    """The consumer's durable position, or None if it has none yet."""
    row = tx.one("reply_cursor", queue=queue, consumer=consumer)
    return int(row["position"]) if row else None


def ack(tx: Tx, queue: str, consumer: str, position: int) -> None:
    """Move the consumer's cursor forward to ``position`` (never back)."""
    tx.run("reply_cursor_create", queue=queue, consumer=consumer)
    tx.run("reply_ack", queue=queue, consumer=consumer, position=position)


def cursors(tx: Tx, queue: str) -> list[Row]:
    return tx.all("reply_cursors_of_queue", queue=queue)


def _denied(e: BaseException) -> bool:
    """The store refused a write for lack of rights (a read-only PostgreSQL role, a SQLite file
    opened read-only): found by its code, as each driver gives it."""
    link: BaseException | None = e
    for _ in range(4):  # the store may have said it in its own words, the driver's error the cause
        if link is None:
            return False
        if getattr(link, "sqlstate", None) == "42501":  # insufficient_privilege
            return True
        if isinstance(link, sqlite3.Error) and primary_code(link) == sqlite3.SQLITE_READONLY:
            return True
        link = link.__cause__ or link.__context__
    return False


# -- the consumer ---------------------------------------------------------------------------------


class Replies:
    """An async iterator over a reply queue's status messages, in order, at least once.

    ``async for msg in app.replies("web-1", consumer="web-1-worker"):`` delivers each message
    once its predecessors were delivered. With ``auto_ack`` (the default) a message is
    acknowledged when the loop asks for the next one, that is once its body has run; with
    ``auto_ack=False`` call :meth:`ack` yourself. Without a consumer name the cursor lives in
    memory only and reading starts at the beginning of the queue.

    Idle, it polls with back-off (``poll_interval`` up to ``idle_poll_max``) and, with ``listen``,
    wakes early on the store's hints. Iteration ends when ``stop`` is set or :meth:`aclose` is called.

    ``batch`` (messages read per transaction) is an int from 1 to 2**31-1; ``poll_interval`` and
    ``idle_poll_max`` are finite numbers of seconds more than 0 and at most 10**9 (31 years); ``stop`` is
    an :class:`asyncio.Event` or None. Anything else raises :class:`~stepwarden.errors.InputError`
    here, before anything is read.
    """

    def __init__(
        self,
        store: Store,
        queue: str,
        consumer: str | None = None,
        *,
        auto_ack: bool = True,
        batch: int = 100,
        stop: asyncio.Event | None = None,
        listen: bool = True,
        clock: Clock = SYSTEM_CLOCK,
        poll_interval: float = 0.02,
        idle_poll_max: float = 0.5,
    ) -> None:
        check_name("reply queue", queue)
        if consumer is not None:
            check_name("consumer name", consumer)
        batch = check_count("batch", batch)
        check_seconds("poll_interval", poll_interval, above=True)
        check_seconds("idle_poll_max", idle_poll_max, above=True)
        if stop is not None and not isinstance(stop, asyncio.Event):
            raise InputError(f"stop must be an asyncio.Event or None, not {show(stop)}")
        self.store = store
        self.queue = queue
        self.consumer = consumer
        self.auto_ack = auto_ack
        self.batch = batch
        self.stop = stop
        self.listen = listen
        self.clock = clock
        self.poll_interval = poll_interval
        self.idle_poll_max = idle_poll_max
        self.position: int | None = None  # the last message delivered (in memory)
        self.acked: int | None = None  # the last position acknowledged
        self._buffer: deque[ReplyMessage] = deque()
        self._unacked: ReplyMessage | None = None
        self._wake: asyncio.Event | None = None
        self._listen_stop: asyncio.Event | None = None
        self._listener: asyncio.Task[None] | None = None
        self._closed = False
        self._closing = asyncio.Event()  # set by aclose(): ends the waits of a loop in another task

    # -- iteration --------------------------------------------------------------------------------
    def __aiter__(self) -> Replies:
        return self

    async def __anext__(self) -> ReplyMessage:
        if self._closed:
            raise StopAsyncIteration
        if self.auto_ack and self._unacked is not None:
            await self._auto_ack(self._unacked)
        idle = self.poll_interval
        while True:
            if self._closed:  # closed from another task while this one waited
                raise StopAsyncIteration
            if self.stop is not None and self.stop.is_set():
                await self.aclose()
                raise StopAsyncIteration
            if self._buffer:
                break
            last = self.clock.monotonic()
            try:
                got = await self._fetch()
            except Exception as e:  # the store is down: back off and keep trying (REL3)
                if _denied(e):  # not an outage: waiting would change nothing
                    raise StoreError(
                        f"reply queue {self.queue}: the store refused the read: {e}; reading a"
                        " reply queue gives new messages their positions (and records a named"
                        " consumer's), which needs the right to write them, not only SELECT"
                    ) from e
                log.warning("reply queue %s: read failed: %r", self.queue, e)
                got = 0
                idle = self.idle_poll_max
            if got:
                break
            await self._idle(idle, last)
            idle = min(self.idle_poll_max, idle * 2)
        msg = self._buffer.popleft()
        self.position = msg.seq
        self._unacked = msg
        return msg

    async def _fetch(self) -> int:
        if (
            self.position is not None
            and self.store.dialect == "sqlite"
            and not await self.store.transact(anything_to_read, self.queue, self.position)
        ):
            return 0
        after, msgs = await self.store.transact(read, self.queue, self.consumer, self.position, self.batch)
        if self.position is None:
            self.position = self.acked = after
        self._buffer.extend(m for m in msgs if m.seq > (self.position or 0))
        return len(self._buffer)

    async def _idle(self, seconds: float, last_poll: float) -> None:
        """Wait up to ``seconds`` for a wake-up hint or ``stop``; never poll more often than
        every ``poll_interval`` (hints come with every commit on a busy store)."""
        if self._wake is None:
            self._wake = asyncio.Event()
        self._start_listening()
        await sleep_or_wake(self.clock, seconds, self._wake, *self._ends())
        self._wake.clear()
        spent = self.clock.monotonic() - last_poll
        if spent < self.poll_interval and not any(e.is_set() for e in self._ends()):
            await self.clock.sleep(self.poll_interval - spent)

    def _start_listening(self) -> None:
        if not self.listen or self._listener is not None:
            return
        wake = self._wake
        assert wake is not None
        self._listen_stop = asyncio.Event()
        self._listener = asyncio.create_task(
            self.store.listen(lambda channel: wake.set(), self._listen_stop), name=f"replies-{self.queue}"
        )

    # -- acknowledgement ----------------------------------------------------------------------------
    async def ack(self, msg: ReplyMessage | None = None) -> None:
        """Acknowledge ``msg`` (default: the last message delivered) and every message before it.

        ``msg`` must be a message this reader delivered: an acknowledgement moves the consumer's
        durable position, so a message of another queue (or one not delivered yet) would skip
        the messages before it for good (:class:`InputError`, nothing acknowledged)."""
        if msg is not None:
            if not isinstance(msg, ReplyMessage):
                raise InputError(f"ack takes a ReplyMessage this reader delivered, not {show(msg)}")
            if msg.queue != self.queue:
                raise InputError(
                    f"ack: message {msg.seq} is of reply queue {msg.queue!r}, not {self.queue!r}"
                    " (this reader's); nothing was acknowledged"
                )
            if (self.position is None or msg.seq > self.position) and not await self._acked_already(msg):
                raise InputError(
                    f"ack: message {msg.seq} of {self.queue!r} has not been delivered by this reader"
                    f" (the last it delivered: {self.position if self.position is not None else 'none'});"
                    " nothing was acknowledged"
                )
        target = msg if msg is not None else self._unacked
        if target is None:
            return
        if self.consumer is not None and (self.acked is None or target.seq > self.acked):
            await self.store.transact(ack, self.queue, self.consumer, target.seq)
        self.acked = max(self.acked or 0, target.seq)
        if self._unacked is not None and self._unacked.seq <= target.seq:
            self._unacked = None

    async def _acked_already(self, msg: ReplyMessage) -> bool:
        """A message a named consumer acknowledged before (a reader made again after an error,
        acknowledging what it was handling): acknowledging it again moves nothing."""
        if self.consumer is None:
            return False
        acked = await self.store.transact(cursor_position, self.queue, self.consumer)
        return acked is not None and msg.seq <= acked

    async def _auto_ack(self, msg: ReplyMessage) -> None:
        """Acknowledge the message the loop body finished, waiting out a store that is down (with
        back-off, as reads do: REL3) before anything more is delivered. Moving on without it would
        leave two messages unacknowledged once the next one is handed out, and a consumer that
        stops while handling that one would get both again, not only the one it was handling. A
        stop or a close ends the wait: the message comes again to the next reader."""
        delay = self.poll_interval
        while True:
            try:
                await self.ack(msg)
                return
            except Exception as e:
                log.warning(
                    "reply queue %s: acknowledging %d failed, trying again in %gs: %r",
                    self.queue,
                    msg.seq,
                    delay,
                    e,
                )
            if self._closed or (self.stop is not None and self.stop.is_set()):
                return
            await sleep_or_wake(self.clock, delay, *self._ends())
            delay = min(self.idle_poll_max, delay * 2)

    def _ends(self) -> list[asyncio.Event]:
        """What ends a wait early: a close, and ``stop``."""
        return [self._closing] + ([self.stop] if self.stop is not None else [])

    # -- closing ------------------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Stop reading (a loop waiting in another task ends too). The last message delivered
        stays unacknowledged unless :meth:`ack` was called."""
        self._closed = True
        self._closing.set()
        self._buffer.clear()
        if self._listen_stop is not None:
            self._listen_stop.set()
        if self._listener is not None:
            listener, self._listener = self._listener, None
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(listener, timeout=5)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        stop = getattr(self, "_listen_stop", None)  # None too if __init__ refused its arguments
        if stop is not None and not self._closed:
            with contextlib.suppress(Exception):
                stop.set()


# -- a task's result --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskResult:
    """What became of a task: its final ``state``, the steps' ``results`` when it was processed,
    the ``error`` when it failed, and the status messages it sent (empty without a reply queue)."""

    task_id: int
    state: str
    correlation_id: str | None
    results: dict[str, Any] | None
    error: str | None
    messages: tuple[ReplyMessage, ...] = ()

    @property
    def ok(self) -> bool:
        return self.state == "processed"


@read_only
def _task_progress(tx: Tx, task_id: int, after: int) -> tuple[Row, list[ReplyMessage], TaskResult | None]:
    """The task's messages after id ``after``, and its result if it is final."""
    task = tx.one("task_reply_state", task_id=task_id)
    if task is None:
        raise NotFound(f"no task {task_id}")
    msgs = (
        [_message(r) for r in tx.all("task_messages", task_id=task_id, after=after)]
        if task["reply_to"]
        else []
    )
    result = None
    if not task["reply_to"] and task["state"] in FINAL_TASK_STATES:
        result = _result_from_rows(tx, task_id, str(task["state"]))
    return task, msgs, result


def _result_from_rows(tx: Tx, task_id: int, state: str) -> TaskResult:
    """The result of a task without a reply queue, read from its rows."""
    row = tx.sql("SELECT correlation_id, last_error FROM tasks WHERE id = ?", (task_id,))[0]
    results = {
        s["name"]: json.loads(s["result"])
        for s in tx.sql(
            "SELECT name, result FROM steps WHERE task_id = ? AND state = 'completed' ORDER BY idx",
            (task_id,),
        )
        if s["result"]
    }
    return TaskResult(
        task_id,
        state,
        row["correlation_id"],
        results if state == "processed" else None,
        row["last_error"] if state == "error" else None,
    )


def result_from_messages(task_id: int, msgs: Iterable[ReplyMessage]) -> TaskResult | None:
    """The task's result if its last message says it is final (a ``retried`` after an ``error``
    means it runs again), else ``None``."""
    msgs = tuple(msgs)
    if not msgs or msgs[-1].kind not in FINAL_KINDS:
        return None
    last = msgs[-1]
    results = last.body.get("results") if last.kind == "processed" else None
    error = last.body.get("error") if last.kind == "error" else None
    return TaskResult(task_id, last.kind, last.correlation_id, results, error, msgs)


def wait_for_result_sync(
    store: Store, task_id: int, timeout: float, poll: float = 0.02, poll_max: float = 0.25
) -> TaskResult:
    end = time.monotonic() + timeout
    seen: list[ReplyMessage] = []
    while True:
        task, new, result = store.transact_sync(_task_progress, task_id, seen[-1].id if seen else 0)
        seen += new
        result = result or result_from_messages(task_id, seen)
        if result is not None:
            return result
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"task {task_id} is still {task['state']} after {timeout}s")
        time.sleep(min(poll, left))
        poll = min(poll_max, poll * 2)


async def wait_for_result(
    store: Store,
    task_id: int,
    timeout: float,
    *,
    clock: Clock = SYSTEM_CLOCK,
    poll: float = 0.02,
    poll_max: float = 0.25,
) -> TaskResult:
    end = clock.monotonic() + timeout
    seen: list[ReplyMessage] = []
    while True:
        task, new, result = await store.transact(_task_progress, task_id, seen[-1].id if seen else 0)
        seen += new
        result = result or result_from_messages(task_id, seen)
        if result is not None:
            return result
        left = end - clock.monotonic()
        if left <= 0:
            raise TimeoutError(f"task {task_id} is still {task['state']} after {timeout}s")
        await clock.sleep(min(poll, left))
        poll = min(poll_max, poll * 2)
