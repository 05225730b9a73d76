"""The PostgreSQL store (DEP2): many workers on many machines, one database.

Transactions run at READ COMMITTED on a ``psycopg_pool`` connection pool. Claims use a
``MATERIALIZED`` CTE with ``FOR UPDATE SKIP LOCKED`` so schedulers and agents take disjoint
batches without waiting for each other; every other transition locks its task row first
(``FOR UPDATE``), and the supervisor's fence takes ``FOR SHARE`` on its lease row so a successor
cannot be granted the lease while a fenced sweep is still writing. Deadlines and leases use the
server's clock (``statement_timestamp()``), one clock for every machine.

Transitions are the same Python functions as on SQLite (``transitions.py``), run in a worker
thread on a pooled connection; only the SQL text differs. LISTEN/NOTIFY is a wake-up hint
carried by an async psycopg connection; polling remains the fallback, so a lost notification
only costs latency.

Behind a transaction-mode pooler (PgBouncer ``pool_mode = transaction``) each transaction may run
on a different server session, so nothing may live in a session: ``?pooler=transaction`` turns off
LISTEN and server-side prepared statements and sets the session limits per transaction instead of
per connection (see :func:`pg_options`).

This module is the store itself (opening, retrying and committing transactions, lending callers
connections, listening); its parts live beside it: ``pg_tx.py`` (the transaction the transitions
write through), ``pg_options.py`` (the URL's options and the first connection),
``pg_sessions.py`` (what a server session carries, and how a lent one is set back) and
``pg_migrate.py`` (the schema's migrations, under their advisory lock). The names that other code
imports from here are still here (``__all__``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

from ..clock import SYSTEM_CLOCK, Clock, SystemClock
from ..errors import InputError, StoreError, StoreMisconfigured, StoreUnreachable
from . import pg_batching, pg_migrate
from .base import redact_url
from .core import Store
from .pg_migrate import MIGRATION_LOCK, MIGRATION_LOCK_POLL, MIGRATION_LOCK_REPORT, MIGRATION_LOCK_WAIT
from .pg_options import (
    TCP_DEFAULTS,
    URL_OPTIONS,
    PgOptions,
    _first_connection,
    _first_line,
    parse_url,
    pg_options,
)
from .pg_sessions import (
    CALLER_IDLE_LIMIT,
    CALLER_RESET,
    CALLER_SESSIONS,
    INSUFFICIENT_PRIVILEGE,
    OUR_SESSIONS,
    PLANNER_SETTINGS,
    READ_ONLY,
    SESSION_LIMITS,
    _configure,
    _pin_isolation,
    _quiet_deliberate_discards,
    _quiet_repeats,
    _settle_caller,
    pooler_in_between,
    pooler_text,
    read_only_text,
)
from .pg_tx import CHANNELS, NOTIFY_ON, REQUESTS, PgTx, _to_psycopg
from .sql import load_queries

try:
    import psycopg
    from psycopg.rows import dict_row
    from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

# The public names of this module before its parts moved out, so imports of them keep working.
__all__ = [
    "CALLER_POOL_MAX",
    "CALLER_POOL_WAIT",
    "CALLER_RESET",
    "CALLER_SESSIONS",
    "CHANNELS",
    "FAKE_NOW",
    "MIGRATION_LOCK",
    "MIGRATION_LOCK_POLL",
    "MIGRATION_LOCK_REPORT",
    "MIGRATION_LOCK_WAIT",
    "NOTIFY_ON",
    "OUR_SESSIONS",
    "PLANNER_SETTINGS",
    "REQUESTS",
    "SESSION_LIMITS",
    "SYSTEM_NOW",
    "TCP_DEFAULTS",
    "URL_OPTIONS",
    "PgOptions",
    "PgTx",
    "PostgresStore",
    "parse_url",
    "pg_options",
]

P = ParamSpec("P")
R = TypeVar("R")
log = logging.getLogger("stepwarden.postgres")

SYSTEM_NOW = "extract(epoch from statement_timestamp())::float8"
FAKE_NOW = "COALESCE(NULLIF(current_setting('stepwarden.now', true), '')::float8, " + SYSTEM_NOW + ")"
# Connections kept for app.transaction() in one process (each opened on demand; idle ones are
# closed one a minute). A block that finds them all lent for CALLER_POOL_WAIT seconds (a block
# inside a block, or more blocks at once than this) opens a connection of its own, as before.
CALLER_POOL_MAX = 16
CALLER_POOL_WAIT = 0.5
# Seconds a pooled connection lost in an outage is reconnected for before the pool gives that
# try up and counts the connection gone (the next caller who needs one starts a fresh try, at
# once). psycopg_pool's default, 300 s, backs off 1, 2, 4 ... 128 s between tries and still
# counts the connection as coming: after a 90-200 s outage a worker sat idle for 12-35 s with
# the server back, its tries asleep. Within this bound the longest sleep is about 4 s.
RECONNECT_TIMEOUT = 10.0


class PostgresStore(Store):
    dialect = "postgres"

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        migrate: bool = True,
        beside: bool = False,
        pool_size: int | None = None,
        listen: bool | None = None,
        prepare: bool | None = None,
    ) -> None:
        super().__init__()
        if psycopg is None:
            raise InputError("PostgreSQL needs the postgres extra: pip install 'stepwarden[postgres]'")
        self.options = opts = pg_options(url, listen=listen, prepare=prepare, pool_size=pool_size)
        conninfo = opts.conninfo
        self.url = url
        self.clock = clock
        self.listen_enabled = opts.listen
        self.prepare = opts.prepare
        self.misconfigured: str | None = None  # StoreMisconfigured's text, once met (transact_sync)
        self.fake_time = not isinstance(clock, SystemClock)
        self.queries = {
            k: _to_psycopg(v)
            for k, v in load_queries("postgres", FAKE_NOW if self.fake_time else SYSTEM_NOW).items()
        }
        self._caller_pool: Any = None  # app.transaction()'s connections, opened when first asked
        self._callers_lock = threading.Lock()
        self._closed = False
        probe = _first_connection(conninfo)
        # What every connection of the store is opened with: the URL's settings and the TCP
        # defaults it leaves unset (conninfo stays the user's, for messages, redacted).
        self.dsn = psycopg.conninfo.make_conninfo(conninfo, **dict(opts.tcp))
        size = opts.pool_size
        self.threads = size
        self.pool = ConnectionPool(
            self.dsn,
            min_size=1,
            max_size=size,
            open=False,
            name="stepwarden",
            kwargs=self._connect_kwargs(row_factory=dict_row, **pg_batching.cursor_factory()),
            configure=_pin_isolation if opts.pooled else lambda conn: _configure(conn, OUR_SESSIONS),
            timeout=5.0,
            reconnect_timeout=RECONNECT_TIMEOUT,
        )
        # The pool retries with a warning per try; our one-line error says it all, so its own
        # log lines are held back while it opens (a server still starting is waited for).
        quiet = _Quiet()
        logging.getLogger("psycopg.pool").addFilter(quiet)
        _quiet_repeats()  # for the store's whole life: an outage is not a minute of warnings
        try:
            self.pool.open(wait=True, timeout=10)
        except Exception as e:
            self.pool.close()
            # The pool says only that it gave up; the first try's error says why (no such host,
            # no server that satisfies target_session_attrs, ...).
            why = f"{probe} (still failing after 10 s)" if probe else str(e)
            raise StoreUnreachable(f"cannot connect to PostgreSQL at {redact_url(conninfo)}: {why}") from None
        finally:
            logging.getLogger("psycopg.pool").removeFilter(quiet)
        # The lease lane's own connection (Store.transact runs lease transactions on a thread of
        # their own): a renewal or a heartbeat never waits for one of the roles' connections,
        # which may all be held by transactions waiting on row locks. Opened by the first lease
        # transaction, so a process that only submits never holds it.
        self.lease_pool = ConnectionPool(
            self.dsn,
            min_size=0,
            max_size=1,
            open=False,
            name="stepwarden-lease",
            kwargs=self._connect_kwargs(row_factory=dict_row, **pg_batching.cursor_factory()),
            configure=_pin_isolation if opts.pooled else lambda conn: _configure(conn, OUR_SESSIONS),
            timeout=5.0,
            num_workers=1,
            reconnect_timeout=RECONNECT_TIMEOUT,
        )
        try:
            self.lease_pool.open()
            if migrate:
                self.migrate(beside=beside)
        except BaseException:
            with contextlib.suppress(Exception):  # the error that stopped the opening is the one to see
                self.close()  # a caller that goes on after the error keeps no pools open behind it
            raise

    def _connect_kwargs(self, **kw: Any) -> dict[str, Any]:
        kw["autocommit"] = False
        if not self.prepare:
            kw["prepare_threshold"] = None  # never prepare, not even psycopg's automatic ones
        return kw

    def _begin(
        self, conn: Any, *, clock: bool = True, session: tuple[tuple[str, str], ...] = OUR_SESSIONS
    ) -> None:
        """What a transaction sets for itself (``SET LOCAL``), in one statement: the ``session``
        settings when a pooler owns the sessions (else :func:`_configure` set them once), and the
        fake clock's time in tests."""
        settings = list(session) if self.options.pooled else []
        if clock and self.fake_time:
            settings.append(("stepwarden.now", repr(self.clock.wall())))
        if settings:
            calls = ", ".join("set_config(%s, %s, true)" for _ in settings)
            conn.execute(f"SELECT {calls}", [v for kv in settings for v in kv], prepare=self.prepare)

    def transact_sync(self, fn: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """One transaction; if the connection turns out dead before COMMIT was sent (a restarted
        server, a killed backend, a pooled connection gone stale), retry once on a fresh one.
        A failure in the round trip that carries COMMIT (with the writes kept for it) is not
        retried: whether it committed is unknown. A transition
        marked ``stepwarden_autocommit`` (one statement) is sent on its own (:meth:`_autocommit`).

        A transaction-mode pooler met without ``?pooler=transaction`` (its prepared statements'
        signature, :func:`pooler_in_between`) raises :class:`StoreMisconfigured`, and so does every
        transaction after it: some would go through and some not, for as long as the process
        runs, and a worker took it for an outage that began and ended every few rounds, warning
        about it for ever (found by review)."""
        if self.misconfigured is not None:
            raise StoreMisconfigured(self.misconfigured)
        try:
            return self._transact_retrying(fn, *args, **kwargs)
        except psycopg.Error as e:
            if getattr(e, "sqlstate", None) == READ_ONLY:
                raise StoreError(read_only_text(f"PostgreSQL at {redact_url(self.url)}", e)) from e
            if getattr(e, "sqlstate", None) == INSUFFICIENT_PRIVILEGE:
                # No wait heals it: a worker ends with this line (Outage.failed) instead of warning
                # every round for ever, at start as later (a grant revoked while it runs).
                raise StoreMisconfigured(
                    f"PostgreSQL at {redact_url(self.url)}: the store's database role may not write"
                    f" ({_first_line(e)}); workers, the CLI's actions and submitting applications"
                    " need SELECT, INSERT, UPDATE and DELETE on the tables and USAGE, SELECT on the"
                    " sequences (see deploying.md, least privilege)"
                ) from e
            if not (self.prepare and pooler_in_between(e)):
                raise
            self.misconfigured = pooler_text(redact_url(self.url), e)
            raise StoreMisconfigured(self.misconfigured) from e

    def _transact_retrying(
        self, fn: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        if getattr(fn, "stepwarden_autocommit", False) and not (self.fake_time or self.options.pooled):
            try:
                return self._autocommit(fn, *args, **kwargs)
            except _NoLiveConnection:
                log.info("pooled connections found dead; taking the transactional path")
                self._pool_for(fn).check()
        stage = ["begin"]
        try:
            return self._transact_once(stage, fn, *args, **kwargs)
        except psycopg.OperationalError as e:
            if stage[0] == "commit" or not _connection_lost(e):
                raise
            log.debug("connection lost before commit; retrying the transaction on a fresh connection")
            self._pool_for(fn).check()  # the other idle connections likely died with it: replace them now
            return self._transact_once(stage, fn, *args, **kwargs)

    def _autocommit(self, fn: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """A transition that is ONE statement (a submission), sent on its own: the statement is its
        own transaction, so it costs one round trip instead of three (BEGIN, statement, COMMIT).
        Raises :class:`_NoLiveConnection` if no live pooled connection turned up (nothing was
        sent): the caller then takes the transactional path, with its retry.

        What this gives up, and how little: a connection that fails while the statement is in
        flight leaves it unknown whether it committed, exactly as a failure during COMMIT does on
        the transactional path, so it is raised, never retried. The usual way to meet a dead
        connection, a pooled one gone stale while idle (a restarted server, a killed backend), is
        caught before anything is sent: its socket has something to read (the server's goodbye,
        or end of file) when an idle session has nothing to say, and it is replaced first. Only
        where the transactional path must set something for the transaction (a fake clock in
        tests, the session limits behind a pooler) is that path taken instead."""
        for _ in range(3):
            with self._pool_for(fn).connection() as conn:
                if _stale(conn):
                    conn.close()  # the pool discards it and opens a replacement
                    continue
                conn.autocommit = True
                try:
                    tx = PgTx(conn, self.queries, set(), prepare=self.prepare)
                    out = fn(tx, *args, **kwargs)
                except psycopg.OperationalError as e:
                    if not _connection_lost(e):  # the server stopped the statement: not written
                        raise StoreError(f"the submission was not written: {_stopped(e)}") from e
                    raise StoreError(
                        "lost the connection to PostgreSQL while a submission was in flight: it may "
                        "or may not have been written (look for it by correlation id: `stepwarden tasks "
                        "--correlation-id ID`; with an idempotency key a retry is safe): "
                        f"{_first_line(e)}"
                    ) from e
                finally:
                    with contextlib.suppress(psycopg.Error):
                        conn.autocommit = False
                # Anything kept for commit would now go out as statements of their own, not
                # atomically with the first: such a transition must not carry the marker.
                if tx.deferred or tx.kept or tx.notify or tx.tail or tx.if_queued is not None:
                    raise AssertionError(f"{fn.__name__} is marked autocommit but wrote more than one")
                return out
        raise _NoLiveConnection

    def _transact_once(
        self, stage: list[str], fn: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        notify: set[str] = set()
        # Pipeline mode: writes whose results are not read (Tx.put) go out without waiting for
        # a round trip each; reads sync the pipeline when they fetch. A transaction of one
        # statement (a submission) gains nothing from it and pays its bookkeeping: it goes plain.
        # Behind a transaction-mode pooler nothing is pipelined: psycopg ends a pipeline with a
        # Sync and then, often in a packet of its own, a Flush. A pooler that has already handed
        # the server session back on the Sync's ReadyForQuery takes one again for the lone Flush,
        # which has no reply, and so keeps it linked to this idle client until its next
        # transaction (PgBouncer does; other poolers do not support pipelining at all).
        piped = getattr(fn, "stepwarden_pipeline", True) and not self.options.pooled
        with self._pool_for(fn).connection() as conn:
            if piped:
                return self._piped(conn, stage, notify, fn, *args, **kwargs)
            with conn.transaction():
                self._begin(conn)
                tx = PgTx(conn, self.queries, notify, prepare=self.prepare)
                out = _run_to_commit(tx, stage, fn, *args, **kwargs)
            tx.read_tail()
            return out

    def _pool_for(self, fn: Callable[..., Any]) -> Any:
        """The lease lane's transactions run on its own connection; every other on the roles' pool."""
        return self.lease_pool if getattr(fn, "stepwarden_lane", "main") == "lease" else self.pool

    def _piped(
        self,
        conn: Any,
        stage: list[str],
        notify: set[str],
        fn: Callable[Concatenate[Any, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """One transaction in pipeline mode, with BEGIN and COMMIT sent as statements of the
        pipeline: BEGIN goes out with the first read, COMMIT with the last writes, in the single
        Sync that ends the pipeline. (psycopg's ``conn.transaction()`` would sync on its own after
        BEGIN and before COMMIT, and the pipeline's end would sync once more: three round trips
        more per transaction.) The connection is in autocommit mode meanwhile, so that psycopg
        sends no BEGIN of its own."""
        conn.autocommit = True
        try:
            with conn.pipeline() as pipeline:
                conn.execute("BEGIN", prepare=False)
                self._begin(conn)
                tx = PgTx(conn, self.queries, notify, pipeline, prepare=self.prepare)
                out = _run_to_commit(tx, stage, fn, *args, **kwargs)
                conn.execute("COMMIT", prepare=False)
            tx.read_tail()
            return out
        except BaseException:
            # A statement failed (the server skipped the rest, COMMIT included) or the
            # transaction's own code raised: end the transaction, if the session still lives.
            with contextlib.suppress(psycopg.Error):
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    conn.execute("ROLLBACK")
            raise
        finally:
            with contextlib.suppress(psycopg.Error):
                conn.autocommit = False

    def connect(self) -> Any:
        """A new connection for a caller's own transaction (``app.transaction()``)."""
        conn = psycopg.connect(self.dsn, **self._connect_kwargs())
        if not self.options.pooled:
            _configure(conn, CALLER_SESSIONS)
        return conn

    @contextmanager
    def lend(self) -> Iterator[Any]:
        """A connection for a caller's transaction, borrowed from a pool of its own: a new
        connection per ``app.transaction()`` cost a new server process, which then loaded its
        caches and planned every statement afresh (136 one-task blocks a second, against 750 with
        the pool: docs/performance.md, "A caller's transaction"). Kept apart from the roles' pool
        because the caller's SQL is planned as usual (``CALLER_SESSIONS``). A connection found
        dead is replaced before it is lent; one given back is set back as it was lent
        (:func:`_settle_caller`) or closed. When all are lent (or the store is closed), a block
        gets a new connection of its own, as before."""
        pool = self._callers()
        conn = None
        if pool is not None:
            with contextlib.suppress(PoolTimeout, PoolClosed):  # all lent, or the store closing
                conn = pool.getconn(timeout=CALLER_POOL_WAIT)
        if conn is None:
            with super().lend() as own:
                yield own
            return
        try:
            yield conn
        finally:
            try:
                _settle_caller(conn, self.options.pooled)
            finally:
                pool.putconn(conn)

    def _callers(self) -> Any:
        with self._callers_lock:
            if self._caller_pool is None and not self._closed:
                pool = ConnectionPool(
                    self.dsn,
                    min_size=0,  # nothing opened until a caller's transaction asks
                    max_size=CALLER_POOL_MAX,
                    open=False,
                    name="stepwarden-callers",
                    kwargs=self._connect_kwargs(),
                    configure=None if self.options.pooled else lambda conn: _configure(conn, CALLER_SESSIONS),
                    check=_check_live,
                    max_idle=60.0,
                    num_workers=1,
                )
                _quiet_deliberate_discards()
                pool.open()
                self._caller_pool = pool
            return self._caller_pool

    def in_transaction(self, conn: Any) -> bool:
        return bool(conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE)

    def aborted(self, conn: Any) -> bool:
        return bool(conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR)

    def tx_on(self, conn: Any) -> PgTx:
        """A :class:`Tx` over the caller's psycopg connection, inside the caller's transaction (SUB2)."""
        if psycopg is None or not isinstance(conn, psycopg.Connection):
            raise InputError(
                "app.transaction(connection): the PostgreSQL store needs a psycopg (3) connection"
                f" to its database, not a {type(conn).__name__}"
            )
        if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            raise InputError(
                "app.transaction(connection): the psycopg connection is in autocommit mode and not"
                " inside a transaction, so each statement would commit on its own; open one first"
                " (with conn.transaction(): ...), or connect with autocommit=False"
            )
        self._begin(conn, session=())  # the fake clock's time; a caller's session is its own
        return PgTx(conn, self.queries, set(), prepare=self.prepare, caller_managed=True)

    def begin(self, conn: Any) -> None:
        """psycopg opens a transaction with the first statement; behind a transaction-mode pooler
        the session limits are that statement (a caller's own connection is left as it is)."""
        self._begin(conn, clock=False, session=CALLER_SESSIONS)  # tx_on sets the clock

    def commit(self, conn: Any, tx: Any) -> None:
        tx.flush()
        tx.send_notifications()
        conn.commit()
        tx.read_tail()

    def rollback(self, conn: Any) -> None:
        if conn.broken or conn.closed:
            return  # the server ended the session, and its transaction with it: nothing to undo
        conn.rollback()

    def block_error(self, e: BaseException) -> StoreError | None:
        if getattr(e, "sqlstate", None) == "25P03":  # idle_in_transaction_session_timeout
            return StoreError(
                "PostgreSQL ended the app.transaction() block's session: it sat idle inside its"
                " transaction past idle_in_transaction_session_timeout (a block's session has"
                f" {CALLER_IDLE_LIMIT} s; after tx.fence, the lease's ttl - margin), so nothing of"
                " the block was committed; make slow calls (a remote service) before or after the"
                " block, not inside it"
            )
        return None

    def migrate(
        self, target: int | None = None, *, lock_wait: float | None = None, beside: bool = False
    ) -> int:
        """Apply missing migrations, serialised across processes by an advisory lock (waited for
        at most ``lock_wait`` seconds, :data:`MIGRATION_LOCK_WAIT` by default, saying who holds it).
        A connection lost meanwhile (a worker starting while the server restarts), or a table lock
        a migration waited ``lock_timeout`` for, is retried with back-off: the migration
        transaction either committed whole or not at all (:mod:`.pg_migrate`). ``beside``: create
        a store where the search_path points even if another schema holds one (``init``)."""
        return pg_migrate.migrate(self, target, lock_wait, beside)

    async def listen(
        self, wake: Callable[[str], None], stop: asyncio.Event, channels: Sequence[str] | None = None
    ) -> None:
        """Call ``wake(channel)`` on every notification on ``channels`` (default: all of ours) until
        ``stop``; reconnect with back-off."""
        if not self.listen_enabled:
            await stop.wait()
            return
        wanted = sorted(set(channels) & set(CHANNELS)) if channels is not None else CHANNELS
        delay = 0.2
        lost_at: float | None = None  # the outage's start (monotonic): logged once, at each end
        while not stop.is_set():
            try:
                aconn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
                async with aconn:
                    if aconn.info.server_version >= 140000:
                        # Idle by design between notifications: a role's or database's
                        # idle_session_timeout ended it every few seconds, a warning each time
                        # (found by review). Its own session only; PostgreSQL 14 and later.
                        await aconn.execute("SET idle_session_timeout = 0")
                    for ch in wanted:
                        await aconn.execute(f"LISTEN {ch}")
                    delay = 0.2
                    if lost_at is not None:
                        log.info("LISTEN connection back after %.1fs", time.monotonic() - lost_at)
                        lost_at = None
                    for ch in wanted:  # anything sent while we were not listening
                        wake(ch)
                    gen = aconn.notifies()
                    stopper = asyncio.create_task(stop.wait())
                    try:
                        while not stop.is_set():
                            nxt = asyncio.ensure_future(anext(gen))
                            done, _ = await asyncio.wait({nxt, stopper}, return_when=asyncio.FIRST_COMPLETED)
                            if nxt in done:
                                wake(nxt.result().channel)
                            else:
                                nxt.cancel()
                                with contextlib.suppress(BaseException):
                                    await nxt
                    finally:
                        stopper.cancel()
            except Exception as e:
                if lost_at is None:
                    lost_at = time.monotonic()
                    log.warning("LISTEN connection lost (%r); polling until it is back", e)
                else:  # one warning per outage, not one per try (every 0.2 s to 5 s)
                    log.debug("LISTEN connection still lost (%r)", e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                delay = min(5.0, delay * 2)

    def close(self) -> None:
        """Close the pools, then wait for the store's threads. A transaction still waiting for a
        connection, or still queued for a thread, then fails with PoolClosed, having written
        nothing, as soon as the pool's own threads have stopped (at once when the server refuses
        connections; up to 5 s while one hangs in a connect): one its caller gave up on (a
        stopping worker's write to a server that is down) no longer holds the close for the
        pool's timeout, and again for its retry (7 s measured). One that holds a
        connection runs to its end; the pool closes that connection when it comes back. Unlike
        SQLite's close, which waits for every transaction: close a store once its callers are done."""
        self.pool.close()
        self.lease_pool.close()
        super().close()
        with self._callers_lock:
            self._closed = True
            if self._caller_pool is not None:
                self._caller_pool.close()
                self._caller_pool = None


def _run_to_commit(
    tx: PgTx, stage: list[str], fn: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs
) -> R:
    """A transaction's own work and what it sends last (the kept writes, the at_commit statements,
    the wake-up hints, delivered when it commits); the caller then sends COMMIT. A connection found
    dead before this returns never carried COMMIT, so that is retried (the last writes are pushed
    out first, so a connection already closed is found here); one lost from here on leaves the
    outcome unknown, and is raised."""
    out = fn(tx, *args, **kwargs)
    tx.flush()
    tx.send_notifications()
    pg_batching.push(tx.conn)  # the writes leave before COMMIT is queued (see pg_batching)
    stage[0] = "commit"
    return out


class _NoLiveConnection(Exception):
    """Three pooled connections in a row were found dead before anything was sent."""


def _connection_lost(e: BaseException) -> bool:
    """Whether an OperationalError means the session is gone (worth one retry on a fresh
    connection) rather than a statement stopped by the server in a live one: a lock timeout
    (55P03) or a cancelled statement (57014) would only wait, or fail, again. A wait for a
    pooled connection that ran out (PoolTimeout) or a pool closed lost no session either: the
    retry would only wait the pool's timeout a second time (10 s per round, not 5, while the
    server is down, a stopping worker's rounds among them)."""
    if isinstance(e, (PoolTimeout, PoolClosed)):
        return False
    state = getattr(e, "sqlstate", None)
    return state is None or state.startswith("08") or state in ("57P01", "57P02", "57P03")


def _stopped(e: psycopg.OperationalError) -> str:
    """Why the server stopped a statement in a live session, for a one-line error."""
    if getattr(e, "sqlstate", None) == "55P03":  # lock_not_available: lock_timeout ran out
        return (
            "it waited lock_timeout for a row another transaction holds, most likely a"
            " submission with the same idempotency key that has not committed yet; submit again"
            f" once that transaction has ended: {_first_line(e)}"
        )
    return _first_line(e)


def _stale(conn: Any) -> bool:
    """Whether an idle pooled connection is dead, without a round trip. An idle session is sent
    nothing by the server (our pooled connections do not LISTEN), so a readable socket means the
    server is saying goodbye (a terminated backend's error, then end of file): the connection is
    replaced rather than trusted. A ``poll`` with no timeout costs one system call."""
    pgconn = conn.pgconn
    if conn.closed or pgconn.status != psycopg.pq.ConnStatus.OK:
        return True
    try:
        waiting = select.poll()  # not select(): that refuses descriptors above 1023
        waiting.register(pgconn.socket, select.POLLIN)
        return bool(waiting.poll(0))
    except (OSError, psycopg.OperationalError):
        return True


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def _check_live(conn: Any) -> None:
    """The caller pool's check when it lends a connection: a dead one is replaced, not lent.
    Closed here, not only refused: psycopg_pool puts a connection that failed its check back in
    the pool unless it looks broken, and the server's goodbye unread leaves it looking fine, so
    every later lend met the same dead connection until its 0.5 s wait ran out (and then opened a
    private one): each app.transaction() after one server restart took half a second, for good."""
    if _stale(conn):
        conn.close()
        raise psycopg.OperationalError("the pooled connection was closed by the server")
