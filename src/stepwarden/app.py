"""The application object: a registry of agents and workflows, and the door to the store.

``App`` holds no global state: make one per application (usually at module level so
``stepwarden worker --app module:app`` can import it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .agent import Agent, default_classify
from .alerts import AlertSink, ack_alert, as_sink
from .app_transaction import AppTransaction
from .clock import SYSTEM_CLOCK, Clock
from .errors import InputError, NotFound, StoreError, StoreUnreachable, UnknownWorkflow
from .leader import LeaseSettings, Work, check_leader_arguments, run_while_leader
from .policies import check_count, check_id, check_number, show
from .replies import Replies, TaskResult, wait_for_result, wait_for_result_sync
from .store import (
    FINAL_TASK_STATES,
    Store,
    StoreMissing,
    open_existing,
    open_store,
    resolve_url,
    transitions,
    views,
)
from .worker import Worker, WorkerSettings, make_identity
from .workflow import (
    DEFAULT_MAX_INPUT_BYTES,
    MAX_INPUT_LIMIT,
    Step,
    Workflow,
    check_ident,
    check_key,
    check_name,
    encode_input,
)

MAX_PRIORITY = 2**31 - 1


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
        self._store_lock = threading.Lock()
        # Workflows whose operations were found on this app's agents: operations are only ever
        # added, so a workflow that passed once passes for good, and a submission checks nothing.
        self._operations_found: set[str] = set()

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
        self.workflows[name] = wf
        return wf

    def check_operations(self) -> None:
        """Every operation the app's workflows name on an agent this app defines exists
        (:class:`InputError` naming the first missing one); a worker checks it as it starts.

        Not checked in :meth:`workflow`: there the result hung on the order of the definitions
        (an agent defined first with its operations added later was refused, one defined after
        the workflow never checked, so ``payments.chrage`` went through and its requests waited,
        taken by no agent, until their complete-by). Agents the app does not define are other
        workers' to run. A submission checks its own workflow the same way (:meth:`own_workflow`)."""
        for wf in self.workflows.values():
            self._check_operations_of(wf, strict=True)

    def _check_operations_of(self, wf: Workflow, *, strict: bool = False) -> None:
        """``strict`` (a worker, which runs the app's agents): every agent the app defines. Else
        (a submission) only the agents with operations in this process: code that submits may
        import the definitions without the module of an agent's operations, which only its
        workers import (refused, found by review), while a typo beside the operations it does
        have is still caught."""
        if wf.name in self._operations_found:
            return
        for s in wf.steps:
            for ref in (s.operation, s.compensate):
                if ref is None:
                    continue
                agent, op = ref.split(".", 1)
                have = self.agents[agent].operations if agent in self.agents else None
                if have is None or op in have or (not have and not strict):
                    continue
                raise InputError(
                    f"workflow {wf.name!r} step {s.name!r}: agent {agent!r} has no operation"
                    f" {op!r} (it has: {', '.join(sorted(have)) or 'none'})"
                )
        if strict or all(self.agents[a].operations for a in _agents_of(wf) if a in self.agents):
            self._operations_found.add(wf.name)  # else checked again: its operations may come later

    def own_workflow(self, name: str) -> Workflow | None:
        """This app's workflow ``name``, its operations checked (:class:`InputError` for one its
        own agent lacks, before anything is written: a typo such as ``pay.chrage`` was written
        and waited, taken by no worker, until a worker refused to start on the app); None if the
        app does not define it (the store's definition, other workers' agents, is used then)."""
        wf = self.workflows.get(name)
        if wf is not None:
            self._check_operations_of(wf)
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
    def db(self) -> str | None:
        """The store URL this app was made with, or None (``STEPWARDEN_DB`` or the default then).
        The command line runs ``--app`` on it too, unless ``--db`` names another."""
        return self._db

    @property
    def url(self) -> str:
        return self._store.url if self._store is not None else resolve_url(self._db)

    @property
    def store(self) -> Store:
        """The app's store, opened (and on SQLite migrated) when first asked for. Under a lock:
        the threads of a web server submitting at once on a fresh app would otherwise each open
        one, and all but one be left open, with their connections and threads, never closed."""
        if self._store is None:
            with self._store_lock:
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
        own = self.own_workflow(name)
        if own is not None:
            return own
        if self._store is None:
            # Looked up in a store that must exist already: opening the app's store would create
            # (and migrate) one at a mistyped path, for a submission that then writes nothing.
            # The store opened to look is the app's from then on (its schema is current: an older
            # one is refused, and opened below with its migration), not opened a second time.
            try:
                probed = open_existing(self._db, clock=self.clock)
            except StoreMissing as e:
                raise UnknownWorkflow(f"unknown workflow {name!r}: {e}") from None
            except StoreUnreachable:
                raise  # waited for already: opening the app's store would wait as long again
            except StoreError:
                pass  # an older schema, say: the app's own store upgrades it, as for any submit
            else:
                with self._store_lock:
                    if self._store is None:
                        self._store = probed
                if self._store is not probed:  # another thread opened it meanwhile
                    probed.close()
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
        """Submit a task from plain code; returns its id (an existing one for a repeated idempotency
        key; :class:`~stepwarden.errors.InputError` if a task of another workflow holds the key)."""
        text, kw = self._prepare(workflow, input, correlation_id, idempotency_key, priority, reply_to)
        wf = self._workflow(workflow)
        with _outage_said("submit", writes=True):
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
        wf = self.own_workflow(workflow)
        if wf is None:
            wf = await asyncio.to_thread(self._workflow, workflow)
        with _outage_said("submit", writes=True):
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
        is written: the task would be committed statement by statement. So is one to another
        database (another store, or none): its workers, not this app's, would see the task.
        The handle ``tx`` is for inside the block: used after it, :class:`InputError`.

        The block must not end the transaction itself (``COMMIT`` or ``ROLLBACK``, in SQL or on
        the connection): that raises :class:`StoreError` (at once through ``tx.execute``, else at
        the next ``tx.submit`` or when the block ends), and nothing of stepwarden's is written
        after it. On PostgreSQL, SQL sent on the connection after such an end begins a new
        transaction, in which later submissions are written: that is found when the block ends,
        by a mark the block set in its transaction when it began (a transaction-local setting),
        and raises :class:`StoreError` naming the tasks the end committed apart from the rest (a
        lent connection's new transaction is rolled back), also for an end before the block's
        first submission. With your own ``sqlite3`` connection in its default mode (it begins a
        transaction before a write) the block marks its transaction with a savepoint once one is
        open; its end raises the same error when the savepoint is gone, or
        when another connection, which sees committed rows only, finds a task of the block. A
        PostgreSQL transaction aborted by a failed statement that the block caught raises it too
        when the block ends: it could commit nothing. On SQLite a block inside
        another one on the same database in the same thread is refused at once
        (:class:`InputError`): it would wait for the write lock the outer block holds; on
        PostgreSQL it is a transaction of its own. On PostgreSQL a lent session left idle inside
        its transaction for more than a minute is ended by the server: :class:`StoreError` says
        so, and nothing of the block is committed.
        """
        store = self.store
        if connection is not None:
            tx = store.tx_on(connection)  # refuses a connection in autocommit mode
            block = AppTransaction(self, connection, tx)
            try:
                yield block
            finally:
                block._ended_block = True
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
                try:
                    try:
                        yield block
                    finally:
                        block._ended_block = True
                    block._check_end()
                except BaseException as e:
                    if store.in_transaction(conn):
                        store.rollback(conn)
                    elif block._opened and not block._reported:
                        # Ended inside the block (a ROLLBACK on SQLite, after it nothing to undo):
                        # the caller's own exception goes on, with a word on what that end did.
                        e.add_note(f"stepwarden: {block._ended()}")
                    raise
                store.commit(conn, tx)
            except Exception as e:  # in the block or at its commit: said in the store's words
                if (explained := store.block_error(e)) is not None:
                    raise explained from e
                raise

    # -- results -------------------------------------------------------------------------------
    def task(self, task_id: int) -> dict[str, Any]:
        task_id = _task_id(task_id)
        with _outage_said("task", writes=False):
            return self.store.transact_sync(views.show_task, task_id)

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
        with _outage_said("alerts", writes=False):
            return self.store.transact_sync(views.list_alerts, not unacked)

    def ack_alert(self, alert_id: int, by: str = "api") -> dict[str, Any]:
        """Acknowledge an alert (idempotent: a second acknowledgement keeps the first); returns it.
        ``alert_id`` is a positive int, ``by`` 1-255 printable characters: else InputError."""
        alert_id = check_id("alert id", alert_id)
        check_key("acknowledged-by name", by)
        with _outage_said("ack_alert", writes=False):  # idempotent: simply done again
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
        holder = make_identity() if holder is None else holder
        check_leader_arguments(name, holder, work, stop, settings)  # before the store is opened
        await run_while_leader(self.store, name, holder, work, stop, settings=settings, clock=self.clock)

    def worker(self, settings: WorkerSettings | None = None, **kw: Any) -> Worker:
        """A worker of this app: ``settings``, or WorkerSettings made of the keyword arguments."""
        if settings is not None and not isinstance(settings, WorkerSettings):
            raise InputError(f"settings must be WorkerSettings or None, not {show(settings)}")
        if settings is not None and kw:
            raise InputError(f"give settings or keyword arguments ({', '.join(kw)}), not both")
        return Worker(self, settings or WorkerSettings(**kw))


def _task_id(value: object) -> int:
    """A task id as the stores hold them (a positive 64-bit integer); anything else is bad input,
    not an OverflowError from the driver or a wait for a task that cannot exist."""
    return check_id("task id", value)


def _seconds(name: str, value: object) -> float:
    """A finite, non-negative number of seconds: nan would never time out, a string is a slip.
    No upper bound: a long timeout only means "wait"."""
    return check_number(name, value, unit=" of seconds")


def _agents_of(wf: Workflow) -> set[str]:
    return {ref.split(".", 1)[0] for s in wf.steps for ref in (s.operation, s.compensate) if ref}


@contextmanager
def _outage_said(what: str, *, writes: bool) -> Iterator[None]:
    """The driver's errors of a store that does not answer (psycopg's OperationalError and
    InterfaceError, its pool's PoolTimeout), raised by a call of the app API, as one
    :class:`StoreError` that says what it means for the caller: the API raised them as they
    came, and code that caught StoreError, as documented, crashed on them (found by review). A
    write that never got a connection wrote nothing; one whose connection was lost may have
    committed. Other errors go on as they came."""
    try:
        yield
    except StoreError:
        raise
    except Exception as e:
        if not _driver_outage(e):
            raise
        if not writes:
            said = "try again once it answers"
        elif type(e).__name__ == "PoolTimeout":
            said = "no connection was had, so nothing was written"
        else:
            said = (
                "the connection was lost, so it may have been written: submit it again with the"
                " same idempotency key, which returns the task if it was"
            )
        raise StoreError(f"{what}: the store did not answer ({type(e).__name__}: {e}); {said}") from e


def _driver_outage(e: BaseException) -> bool:
    return any(
        c.__name__ in ("OperationalError", "InterfaceError") and c.__module__.startswith("psycopg")
        for c in type(e).__mro__
    )
