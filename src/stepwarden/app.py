"""The application object: a registry of agents and workflows, and the door to the store.

``App`` holds no global state: make one per application (usually at module level so
``stepwarden worker --app module:app`` can import it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .agent import Agent, default_classify
from .alerts import AlertSink, ack_alert, as_sink
from .clock import SYSTEM_CLOCK, Clock
from .errors import InputError, NotFound, StoreError, UnknownWorkflow
from .leader import Leadership, LeaseSettings, Work, run_while_leader
from .policies import check_count, check_id, check_number, show
from .replies import Replies, TaskResult, wait_for_result, wait_for_result_sync
from .store import FINAL_TASK_STATES, Store, open_store, resolve_url, transitions, views
from .store.base import Tx, read_only
from .store.supervision import fence
from .worker import Worker, WorkerSettings, make_identity
from .workflow import (
    DEFAULT_MAX_INPUT_BYTES,
    Step,
    Workflow,
    check_ident,
    check_key,
    check_name,
    encode_input,
)

MAX_PRIORITY = 2**31 - 1
# The largest max_input_bytes: about the largest text a store keeps in one value (SQLite's
# default SQLITE_MAX_LENGTH is 10**9 bytes, a PostgreSQL field holds at most 1 GiB).
MAX_INPUT_LIMIT = 10**9


class App:
    """An application's agents and workflows, and its door to the store.

    ``db`` is a store URL (text), or None for ``STEPWARDEN_DB`` or the default file; ``clock``
    a :class:`~stepwarden.clock.Clock` (``wall()``, ``monotonic()``, ``async sleep()``);
    ``max_input_bytes`` the largest task input, as UTF-8 JSON, an int from 1 to 10**9 (not a
    bool). A bad argument raises :class:`~stepwarden.errors.InputError` naming it, here.
    """

    def __init__(
        self,
        db: str | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES,
    ) -> None:
        if db is not None and not isinstance(db, str):
            raise InputError(f"App.db must be a store URL (text) or None, not {show(db)}")
        if not all(callable(getattr(clock, m, None)) for m in ("wall", "monotonic", "sleep")):
            raise InputError(
                f"App.clock must be a Clock (with wall(), monotonic() and async sleep()), not {show(clock)}"
            )
        max_input_bytes = check_count(
            "App.max_input_bytes", max_input_bytes, high=MAX_INPUT_LIMIT, unit=" of bytes"
        )
        self._db = db
        self.clock = clock
        self.max_input_bytes = max_input_bytes
        self.agents: dict[str, Agent] = {}
        self.workflows: dict[str, Workflow] = {}
        self.alert_sinks: list[AlertSink] = []
        self._store: Store | None = None

    # -- definitions ---------------------------------------------------------------------------
    def agent(
        self,
        name: str,
        *,
        concurrency: int = 8,
        breaker_threshold: int = 5,
        breaker_cool_off: float = 5.0,
        classify: Callable[[BaseException], str] = default_classify,
    ) -> Agent:
        check_ident("agent name", name)  # before the lookup: a list is no name, nor hashable
        if name in self.agents:
            raise InputError(f"agent {name!r} is already defined")
        a = Agent(name, concurrency, breaker_threshold, breaker_cool_off, classify)
        self.agents[name] = a
        return a

    def workflow(self, name: str, steps: Sequence[Step], *, version: int = 1) -> Workflow:
        check_name("workflow name", name)  # before the lookup: a list is no name, nor hashable
        if name in self.workflows:
            raise InputError(f"workflow {name!r} is already defined")
        wf = Workflow.of(name, steps, version)
        for s in wf.steps:
            for ref in (s.operation, s.compensate):
                if ref is None:
                    continue
                agent, op = ref.split(".", 1)
                if agent in self.agents and op not in self.agents[agent].operations:
                    raise InputError(
                        f"workflow {name!r} step {s.name!r}: agent {agent!r} has no operation {op!r}"
                    )
        self.workflows[name] = wf
        return wf

    def alert_sink(self, sink: Any = None, *, name: str | None = None) -> Any:
        """Send operator alerts to ``sink`` (OPS4): a :class:`~stepwarden.alerts.LogSink`,
        :class:`~stepwarden.alerts.WebhookSink`, any object with ``name`` and ``async send(alert)``,
        or a plain or async function of one :class:`~stepwarden.alerts.Alert`. Works as a
        decorator too (``@app.alert_sink``). Workers of this app deliver every alert to every sink,
        one process at a time (the ``alerts`` lease), retrying failures with back-off."""
        if sink is None:
            return lambda fn: self.alert_sink(fn, name=name)
        s = as_sink(sink, name)
        if any(x.name == s.name for x in self.alert_sinks):
            raise InputError(f"an alert sink named {s.name!r} is already configured; give this one a name=")
        self.alert_sinks.append(s)
        return sink

    # -- the store -----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._store.url if self._store is not None else resolve_url(self._db)

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_store(self._db, clock=self.clock)
        return self._store

    def use_store(self, store: Store) -> None:
        """Point the app at an already open store (tests, embedding)."""
        self._store = store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- submission ----------------------------------------------------------------------------
    def _prepare(
        self,
        workflow: str,
        input: Any,
        correlation_id: str | None,
        idempotency_key: str | None,
        priority: int,
        reply_to: str | None,
    ) -> tuple[str, dict[str, Any]]:
        """Validate everything before touching the store, so bad input writes nothing (SUB4)."""
        check_name("workflow name", workflow)
        text = encode_input(input, self.max_input_bytes)
        if correlation_id is not None:
            check_key("correlation id", correlation_id)
        if idempotency_key is not None:
            check_key("idempotency key", idempotency_key)
        if reply_to is not None:
            check_name("reply queue", reply_to)
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
            raise InputError(f"priority must be an integer between -{MAX_PRIORITY} and {MAX_PRIORITY}")
        return text, {
            "correlation_id": correlation_id,
            "idempotency_key": idempotency_key,
            "priority": priority,
            "reply_to": reply_to,
        }

    def _workflow(self, name: str) -> Workflow:
        if name in self.workflows:
            return self.workflows[name]
        try:
            return self.store.workflow_sync(name)
        except UnknownWorkflow:
            known = sorted(self.workflows)
            raise UnknownWorkflow(
                f"unknown workflow {name!r}"
                + (
                    f"; this app defines: {', '.join(known)}"
                    if known
                    else ": no worker has registered it in this store"
                )
            ) from None

    def submit(
        self,
        workflow: str,
        input: Any,
        *,
        correlation_id: str | None = None,
        idempotency_key: str | None = None,
        priority: int = 0,
        reply_to: str | None = None,
    ) -> int:
        """Submit a task from plain code; returns its id (an existing one for a repeated idempotency key)."""
        text, kw = self._prepare(workflow, input, correlation_id, idempotency_key, priority, reply_to)
        wf = self._workflow(workflow)
        return self.store.transact_sync(transitions.submit, wf, text, **kw)[0]

    async def submit_async(
        self,
        workflow: str,
        input: Any,
        *,
        correlation_id: str | None = None,
        idempotency_key: str | None = None,
        priority: int = 0,
        reply_to: str | None = None,
    ) -> int:
        text, kw = self._prepare(workflow, input, correlation_id, idempotency_key, priority, reply_to)
        wf = self.workflows.get(workflow)
        if wf is None:
            wf = await asyncio.to_thread(self._workflow, workflow)
        task_id, _ = await self.store.transact(transitions.submit, wf, text, **kw)
        return task_id

    @contextmanager
    def transaction(self, connection: Any = None) -> Iterator[AppTransaction]:
        """A transaction in which business rows and tasks commit together, or not at all (SUB2).

        Without ``connection``: a connection the store lends from a few it keeps for this,
        committed when the block ends and rolled back if it raises. What the block leaves on it
        (settings, temporary tables, locks) does not reach the next block: it is set back or the
        connection closed. Leave the driver's connection object itself as it is (its handlers and
        adapters); for that, pass a connection of your own.

        With ``connection`` (your own ``sqlite3`` or psycopg connection to the same database,
        already inside your transaction, or one its driver starts a transaction on): tasks are
        written in your transaction, and you commit or roll back as usual. A connection in
        autocommit mode outside a transaction is refused (:class:`InputError`) before anything
        is written: the task would be committed statement by statement.

        The block must not end the transaction itself (``COMMIT`` or ``ROLLBACK``, in SQL or on
        the connection): that raises :class:`StoreError` (at once through ``tx.execute``, else at
        the next ``tx.submit`` or when the block ends), and nothing of stepwarden's is written
        after it. On PostgreSQL, SQL sent on the connection after such an end begins a new
        transaction, in which later submissions are written: that is found when the block ends,
        by the transaction's id, and raises :class:`StoreError` naming the tasks the end
        committed apart from the rest (a lent connection's new transaction is rolled back). With
        your own ``sqlite3`` connection in its default mode (it begins a transaction before a
        write) the block's end reads its tasks on another connection, which sees committed rows
        only, and raises the same error for any it finds there. A
        PostgreSQL transaction aborted by a failed statement that the block caught raises it too
        when the block ends: it could commit nothing. On SQLite a block inside
        another one on the same database in the same thread is refused at once
        (:class:`InputError`): it would wait for the write lock the outer block holds.
        """
        store = self.store
        if connection is not None:
            tx = store.tx_on(connection)  # refuses a connection in autocommit mode
            block = AppTransaction(self, connection, tx)
            yield block
            block._check_end()
            tx.flush()  # anything kept for the end of the block (each submission wrote its own)
            if hasattr(tx, "send_notifications"):
                tx.send_notifications()  # delivered when the caller commits
            return
        with store.lend() as conn:
            store.begin(conn)
            tx = store.tx_on(conn)
            block = AppTransaction(self, conn, tx, lent=True)
            try:
                yield block
                block._check_end()
            except BaseException as e:
                if store.in_transaction(conn):
                    store.rollback(conn)
                elif block._opened and not block._reported:
                    # Ended inside the block (a ROLLBACK on SQLite, after it nothing to undo): the
                    # caller's own exception goes on, with a word on what that end did.
                    e.add_note(f"stepwarden: {block._ended()}")
                raise
            store.commit(conn, tx)

    # -- results -------------------------------------------------------------------------------
    def task(self, task_id: int) -> dict[str, Any]:
        return self.store.transact_sync(views.show_task, _task_id(task_id))

    def wait(self, task_id: int, timeout: float = 30.0, poll: float = 0.05) -> dict[str, Any]:
        """Block until the task is final; returns its view. Raises TimeoutError otherwise."""
        task_id, timeout = _task_id(task_id), _seconds("timeout", timeout)
        poll = check_number("poll", poll, above=True, unit=" of seconds")
        end = time.monotonic() + timeout
        while True:
            state = self.store.transact_sync(views.task_state, task_id)
            if state is None:
                raise NotFound(f"no task {task_id}")
            if state in FINAL_TASK_STATES:
                return self.task(task_id)
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"task {task_id} is still {state} after {timeout}s")
            time.sleep(min(poll, left))  # a poll longer than the timeout does not outlast it

    def wait_for_result(self, task_id: int, timeout: float = 30.0) -> TaskResult:
        """Block until the task is final; its result, read from the task's status messages (SCH8)
        when it has a reply queue, else from its rows. ``TimeoutError`` if it is not final in time.

        A task in ``error`` is final until an operator retries it; then wait again."""
        return wait_for_result_sync(self.store, _task_id(task_id), _seconds("timeout", timeout))

    async def wait_for_result_async(self, task_id: int, timeout: float = 30.0) -> TaskResult:
        return await wait_for_result(
            self.store, _task_id(task_id), _seconds("timeout", timeout), clock=self.clock
        )

    def replies(
        self,
        queue: str,
        consumer: str | None = None,
        *,
        auto_ack: bool = True,
        batch: int = 100,
        stop: asyncio.Event | None = None,
        listen: bool = True,
    ) -> Replies:
        """The status messages of reply queue ``queue``, in order, at least once:
        ``async for msg in app.replies("web-1", consumer="web-1"): ...``.

        A named ``consumer`` keeps a durable cursor in the store and resumes after its last
        acknowledged message when it starts again; each message is acknowledged when the loop
        asks for the next one (or by ``await replies.ack(msg)`` with ``auto_ack=False``). Without
        a name the cursor is in memory and reading starts at the queue's beginning. The iteration
        ends when ``stop`` is set."""
        return Replies(
            self.store,
            queue,
            consumer,
            auto_ack=auto_ack,
            batch=batch,
            stop=stop,
            listen=listen,
            clock=self.clock,
        )

    # -- alerts --------------------------------------------------------------------------------
    def alerts(self, unacked: bool = False) -> list[dict[str, Any]]:
        """Operator alerts, oldest first, as ``stepwarden alerts --json`` prints them."""
        return self.store.transact_sync(views.list_alerts, not unacked)

    def ack_alert(self, alert_id: int, by: str = "api") -> dict[str, Any]:
        """Acknowledge an alert (idempotent: a second acknowledgement keeps the first); returns it.
        ``alert_id`` is a positive int, ``by`` 1-255 printable characters: else InputError."""
        alert_id = check_id("alert id", alert_id)
        check_key("acknowledged-by name", by)
        return self.store.transact_sync(ack_alert, alert_id, by)[0]

    # -- leadership ------------------------------------------------------------------------------
    async def run_while_leader(
        self,
        name: str,
        work: Work,
        stop: asyncio.Event,
        *,
        holder: str | None = None,
        settings: LeaseSettings | None = None,
    ) -> None:
        """Run ``work(leadership)`` only while this process holds lease ``name`` (LEAD7), until
        ``stop`` is set; see :func:`stepwarden.run_while_leader`. ``holder`` defaults to a fresh
        worker identity ``HOST:PID:RANDOM``. A bad argument raises InputError before campaigning."""
        check_name("lease name", name)
        if holder is not None:
            check_key("lease holder", holder)
        if not callable(work):
            raise InputError(f"work must be an async function of the Leadership, not {show(work)}")
        if not isinstance(stop, asyncio.Event):
            raise InputError(f"stop must be an asyncio.Event, not {show(stop)}")
        if settings is not None and not isinstance(settings, LeaseSettings):
            raise InputError(f"settings must be LeaseSettings or None, not {show(settings)}")
        await run_while_leader(
            self.store, name, holder or make_identity(), work, stop, settings=settings, clock=self.clock
        )

    def worker(self, settings: WorkerSettings | None = None, **kw: Any) -> Worker:
        """A worker of this app: ``settings``, or WorkerSettings made of the keyword arguments."""
        if settings is not None and not isinstance(settings, WorkerSettings):
            raise InputError(f"settings must be WorkerSettings or None, not {show(settings)}")
        if settings is not None and kw:
            raise InputError(f"give settings or keyword arguments ({', '.join(kw)}), not both")
        return Worker(self, settings or WorkerSettings(**kw))


class AppTransaction:
    """The caller's open transaction: run their SQL and submit tasks; all commit or none."""

    def __init__(self, app: App, conn: Any, tx: Tx, *, lent: bool = False) -> None:
        self.app = app
        self._lent = lent  # the store's connection: whatever the block leaves open is rolled back
        self.connection = conn
        self._tx = tx
        # Whether the block's transaction has begun (psycopg begins one with the first statement,
        # as sqlite3 does with the first write when it manages transactions itself): found ended
        # after that, the caller ended it.
        self._opened = app.store.in_transaction(conn)
        self._submitted: list[int] = []  # the tasks this block created
        self._reported = False  # the end was raised as a StoreError already
        # PostgreSQL: the id of the transaction the block's first submission wrote in. psycopg
        # begins a new transaction with the first statement after a COMMIT, so one ended on the
        # connection and followed by more SQL looks open again; a different id at the end says so.
        self._xact: str | None = None

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        """Your SQL in this transaction, with the driver's placeholders (``?`` sqlite3, ``%s`` psycopg).
        A statement that ends the transaction (``COMMIT``, ``ROLLBACK``) raises :class:`StoreError`.

        On PostgreSQL it is never prepared on the server: a lent session outlives the block, and
        a statement psycopg had prepared on it would fail ("cached plan must not change result
        type") once your schema changed under it."""
        conn = self.connection
        was_open = self._open_now()
        if self._opened and not was_open:
            raise self._ended_error()  # ended on the connection itself: this would run outside it
        if self.app.store.dialect != "postgres":
            out = conn.execute(sql, params)
        else:
            try:
                out = conn.execute(sql, params, prepare=False)
            except Exception as e:
                # The likeliest slip of code moved from SQLite: the error stays psycopg's own.
                if params and "?" in sql and "placeholder" in str(e):
                    e.add_note("stepwarden: on PostgreSQL tx.execute takes psycopg's %s placeholders, not ?")
                raise
        if self._open_now():
            self._opened = True
        elif was_open:  # this statement ended it: stopped here, what follows would run outside it
            raise self._ended_error()
        return out

    def fence(self, lead: Leadership) -> None:
        """Raise :class:`~stepwarden.errors.LostOwnership` unless ``lead``'s term still holds
        its lease on the database clock, so that the block's writes commit only under a current
        term (LEAD4 for an application's own leader work, LEAD7). Call it first in the block. On
        PostgreSQL the lease row stays share-locked until the block ends, so a successor's
        acquire waits for it (and so does this process's own renewal: keep a fenced block well
        under the lease's ``ttl - margin``); on SQLite the block's write lock orders them."""
        if not isinstance(lead, Leadership):
            raise InputError(f"fence takes the Leadership your leader work was given, not {show(lead)}")
        if self._opened and not self._open_now():
            raise self._ended_error()
        fence(self._tx, lead.holder, lead.name, lead.term)
        self._opened = self._opened or self._open_now()

    def submit(
        self,
        workflow: str,
        input: Any,
        *,
        correlation_id: str | None = None,
        idempotency_key: str | None = None,
        priority: int = 0,
        reply_to: str | None = None,
    ) -> int:
        text, kw = self.app._prepare(workflow, input, correlation_id, idempotency_key, priority, reply_to)
        if self._opened and not self._open_now():
            raise self._ended_error()  # ended on the connection itself: nothing written after it
        wf = self.app.workflows.get(workflow)
        if wf is None:  # look it up inside this transaction: another connection would wait on our lock
            row = self._tx.one("get_workflow", name=workflow)
            if row is None:
                raise UnknownWorkflow(f"unknown workflow {workflow!r}")
            wf = Workflow.from_dict(json.loads(row["definition"]))
        task_id, created = transitions.submit(self._tx, wf, text, **kw)
        # The task's received event and message written now, not kept for the commit: a COMMIT
        # the caller's code sends on the connection commits whole tasks, and nothing of ours
        # is left to write once the transaction has ended.
        self._tx.flush()
        self._opened = self._opened or self._open_now()
        if created:
            self._submitted.append(task_id)
            if self._xact is None and self.app.store.dialect == "postgres":
                self._xact = self._current_xact()  # one round trip per block, not per submission
        return task_id

    def _current_xact(self) -> str | None:
        row = self._tx.sql("SELECT pg_current_xact_id_if_assigned()::text AS x")[0]
        return None if row["x"] is None else str(row["x"])

    def _open_now(self) -> bool:
        return self.app.store.in_transaction(self.connection)

    def _check_end(self) -> None:
        """At the end of the block, before anything of ours is sent: the transaction is still open."""
        if self.app.store.aborted(self.connection):
            raise StoreError(
                "a statement inside the block failed and PostgreSQL aborted the transaction, so none"
                " of it can commit; nothing was submitted (to go on after a failed statement, run it"
                " after a SAVEPOINT and ROLLBACK TO that savepoint)"
            )
        if self._opened and not self._open_now():
            raise self._ended_error()
        if self._xact is not None and self._current_xact() != self._xact:
            raise self._restarted_error()
        if self._submitted and not self._lent and self.app.store.dialect == "sqlite":
            self._check_sqlite_split()

    def _restarted_error(self) -> StoreError:
        """The transaction was ended on the connection and a later statement began another: what
        the first one committed is committed apart from the rest of the block, and the tasks
        written since are in the new one (a row's ``xmin`` is the transaction that wrote it)."""
        rows = self._tx.sql(
            "SELECT id, xmin = pg_current_xact_id_if_assigned()::xid AS since FROM tasks"
            " WHERE id = ANY(?) ORDER BY id",
            (self._submitted,),
        )
        before = [int(r["id"]) for r in rows if not r["since"]]
        since = [int(r["id"]) for r in rows if r["since"]]
        return self._split_error(before, since)

    def _check_sqlite_split(self) -> None:
        """The SQLite form of the transaction-id check, for the caller's own ``sqlite3``
        connection in its default mode, which begins a new transaction before the first write
        after a COMMIT: SQLite has no transaction id, but under WAL another connection sees
        committed rows only, so a task of the block that it can read was committed before the
        block's end, apart from the rest. A ROLLBACK then more SQL splits nothing (what the
        block left commits together) and is found only when a submitted task is gone. One read
        on the store's own connection per block that submitted; a lent connection is the
        store's, in autocommit mode, where an end is found as the transaction being closed."""
        ids = self._submitted
        before = self.app.store.transact_sync(_existing_tasks, ids)
        here = set(_existing_tasks(self._tx, ids))
        if before or len(here) < len(set(ids)):
            since = sorted(here - set(before))
            raise self._split_error(before, since)

    def _split_error(self, before: list[int], since: list[int]) -> StoreError:
        self._reported = True
        what = (
            "the transaction was ended inside the block (COMMIT or ROLLBACK on the connection) and a"
            " later statement began a new one"
        )
        if before:
            what += f"; the first committed {_tasks(before)} apart from the rest of the block"
        else:
            what += "; the first committed none of the block's tasks"
        if since:
            where = "rolled back with it" if self._lent else "left in it for you to roll back"
            what += f"; {_tasks(since)}, written in the new transaction, {where}"
        return StoreError(what)

    def _ended_error(self) -> StoreError:
        self._reported = True
        return StoreError(self._ended())

    def _ended(self) -> str:
        """What ending the transaction inside the block did to the tasks it had submitted."""
        what = "the transaction was ended inside the block (COMMIT or ROLLBACK)"
        if not self._submitted:
            return f"{what}; nothing was submitted"
        try:
            committed = self._committed()
        except Exception as e:  # the connection may be gone with its transaction
            ids = ", ".join(map(str, self._submitted))
            return f"{what}; whether it committed the tasks submitted before it ({ids}) is unknown: {e!r}"
        if not committed:
            return f"{what}; nothing was submitted"
        return f"{what}; it committed what the block had written before it, {_tasks(committed)} included"

    def _committed(self) -> list[int]:
        """Which of the block's tasks exist, read on its connection (the transaction has ended;
        on PostgreSQL the read begins one, ended here: with the tasks' wake-up hints when they
        were committed)."""
        found = _existing_tasks(self._tx, self._submitted)
        if self._open_now():
            if found and hasattr(self._tx, "send_notifications"):
                self.app.store.commit(self.connection, self._tx)
            else:
                self.app.store.rollback(self.connection)
        return found


@read_only
def _existing_tasks(tx: Tx, ids: list[int]) -> list[int]:
    """Which of the tasks ``ids`` exist as ``tx`` sees them; on a connection of the store's own,
    which of them are committed."""
    marks = ", ".join("?" for _ in ids)
    rows = tx.sql(f"SELECT id FROM tasks WHERE id IN ({marks}) ORDER BY id", tuple(ids))
    return [int(r["id"]) for r in rows]


def _tasks(ids: list[int]) -> str:
    return f"task {ids[0]}" if len(ids) == 1 else f"tasks {', '.join(map(str, ids))}"


def _task_id(value: object) -> int:
    """A task id as the stores hold them (a positive 64-bit integer); anything else is bad input,
    not an OverflowError from the driver or a wait for a task that cannot exist."""
    return check_id("task id", value)


def _seconds(name: str, value: object) -> float:
    """A finite, non-negative number of seconds: nan would never time out, a string is a slip.
    No upper bound: a long timeout only means "wait"."""
    return check_number(name, value, unit=" of seconds")
