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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import select
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar
from urllib.parse import unquote, urlsplit

from ..clock import SYSTEM_CLOCK, Clock, SystemClock
from ..errors import InputError, MigrationError, StoreError
from .base import DEFERRED, AtCommit, Row, redact_url
from .core import Store
from .sql import load_queries, pending_migrations

try:
    import psycopg
    from psycopg.rows import dict_row, tuple_row
    from psycopg.types.json import Jsonb
    from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

P = ParamSpec("P")
R = TypeVar("R")
log = logging.getLogger("stepwarden.postgres")

# Channels of the wake-up hints, by the query that makes new work for someone.
NOTIFY_ON = {
    "insert_task": "stepwarden_tasks",
    "insert_request": "stepwarden_requests",
    "insert_reply": "stepwarden_replies",
    "release_task": "stepwarden_tasks",
    "finish_task": "stepwarden_done",
}
CHANNELS = sorted(set(NOTIFY_ON.values()))
REQUESTS = NOTIFY_ON["insert_request"]
SYSTEM_NOW = "extract(epoch from statement_timestamp())::float8"
FAKE_NOW = "COALESCE(NULLIF(current_setting('stepwarden.now', true), '')::float8, " + SYSTEM_NOW + ")"
# Our transactions never wait on the network, so a session idle inside one belongs to a paused or
# partitioned process: the server ends it, releasing its row locks (a paused ex-leader's FOR SHARE
# on its lease must not block the successor's acquire). Set once per connection when it is ours
# alone, else at the start of every transaction (SET LOCAL), so it never outlives it on a session
# that a pooler hands to someone else.
# The advisory lock that serialises migrations across processes; how long a migration waits for
# another session's (ours take well under a second; longer means a stuck session, named in the
# error), how often it tries, and how often it says it is still waiting.
MIGRATION_LOCK = 7413000001
MIGRATION_LOCK_WAIT = 120.0
MIGRATION_LOCK_POLL = 0.25
MIGRATION_LOCK_REPORT = 10.0
SESSION_LIMITS = (("idle_in_transaction_session_timeout", "5s"), ("lock_timeout", "10s"))
# Every statement of ours reaches its rows through an index, but a store starts empty, and on an
# empty table (never analysed: the planner assumes 10 pages) a sequential scan is the cheaper plan
# for `= ANY (ARRAY(...))` of the ids of a batch. A prepared statement keeps its generic plan until
# an ANALYZE invalidates it, so a worker started on a new store scanned the whole of `steps` and
# `requests` in every batch while they grew, until autovacuum's first ANALYZE (a minute or more):
# 1,996 rows read for 8 after 2,000 tasks. With sequential scans priced out, the plan made while a
# table is empty is the one that stays right once it is large (a query with no index still scans).
PLANNER_SETTINGS = (("enable_seqscan", "off"),)
# What each kind of session of ours gets: the pool's run only the store's statements; the one
# opened for a caller's own transaction (``App.transaction()``) runs the caller's SQL too, planned
# as usual; a caller's own connection (``tx_on``) gets nothing.
OUR_SESSIONS = SESSION_LIMITS + PLANNER_SETTINGS
CALLER_SESSIONS = SESSION_LIMITS
# Connections kept for app.transaction() in one process (each opened on demand; idle ones are
# closed one a minute). A block that finds them all lent for CALLER_POOL_WAIT seconds (a block
# inside a block, or more blocks at once than this) opens a connection of its own, as before.
CALLER_POOL_MAX = 16
CALLER_POOL_WAIT = 0.5
_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def _to_psycopg(sql: str) -> str:
    return _PARAM.sub(r"%(\1)s", sql)


class PgTx:
    dialect = "postgres"

    def __init__(
        self,
        conn: Any,
        queries: dict[str, str],
        notify: set[str],
        pipeline: Any = None,
        *,
        prepare: bool = True,
        caller_managed: bool = False,
    ) -> None:
        self.conn = conn
        self.q = queries
        self.notify = notify
        self.pipeline = pipeline
        # Server-side prepared statements, each prepared on its first use; off (``prepare=off``)
        # they are never prepared, not even after psycopg's threshold: behind a pooler that does
        # not track them, a statement prepared on one server session is missing on the next.
        self.prepare = prepare
        self.kept: dict[str, list[dict[str, Any]]] = {}  # events, messages: sent at commit
        self.deferred: dict[str, list[dict[str, Any]]] = {}  # hot writes: sent at the next read
        self.dispatched: list[str] = []
        self.quieted: set[str] = set()
        self.tail: list[tuple[str, dict[str, Any], AtCommit]] = []  # at_commit, not yet sent
        self.tail_sent: list[tuple[Any, AtCommit]] = []  # sent: their cursors, read after COMMIT
        self.if_queued: list[str] | None = None  # notify_if_queued's agents
        self.caller_managed = caller_managed

    def _exec(self, query: str, params: dict[str, Any]) -> Any:
        if self.deferred:
            self._send_deferred()
        self._hint(query)
        return self.conn.cursor(row_factory=dict_row).execute(self.q[query], params, prepare=self.prepare)

    def _hint(self, query: str) -> None:
        """Note the wake-up channel of work ``query`` creates; sent once, at commit."""
        channel = NOTIFY_ON.get(query)
        if channel:
            self.notify.add(channel)

    def _send_deferred(self) -> None:
        deferred, self.deferred = self.deferred, {}
        for query, rows in deferred.items():
            keys = DEFERRED[query]
            if len(rows) > 1 and (not keys or len({tuple(r[k] for k in keys) for r in rows}) == len(rows)):
                self._send_many(query, rows)
            else:
                cur = self.conn.cursor()
                for params in rows:
                    cur.execute(self.q[query], params, prepare=self.prepare)

    def _send_many(self, query: str, rows: list[dict[str, Any]]) -> None:
        """Every row of ``rows`` through ``query``, in one statement when the query has a set-based
        form, else one by one (in a pipeline either way: no round trip of its own)."""
        many = self.q.get(query + "__many")
        if many is None:
            self.conn.cursor().executemany(self.q[query], rows)
        else:
            self.conn.cursor().execute(many, {"rows": Jsonb(rows)}, prepare=self.prepare)

    def _sync(self) -> None:
        if self.pipeline is not None:
            self.pipeline.sync()  # a read needs its result: flush the pipelined writes and wait

    @staticmethod
    def _rows(cur: Any) -> list[Row]:
        return list(cur.fetchall()) if cur.description else []

    def one(self, query: str, /, **params: Any) -> Row | None:
        rows = self.all(query, **params)
        return rows[0] if rows else None

    def all(self, query: str, /, **params: Any) -> list[Row]:
        cur = self._exec(query, params)
        self._sync()
        return self._rows(cur)

    def both(
        self, first: tuple[str, dict[str, Any]], second: tuple[str, dict[str, Any]]
    ) -> tuple[list[Row], list[Row]]:
        # Pipelined: the server runs them in order (the second sees the first's locks), and one
        # sync fetches both results.
        a, b = self._exec(*first), self._exec(*second)
        self._sync()
        return self._rows(a), self._rows(b)

    def run(self, query: str, /, **params: Any) -> int:
        cur = self._exec(query, params)
        self._sync()  # the row count is known only once the result is back
        return int(cur.rowcount)

    def put(self, query: str, /, **params: Any) -> None:
        if query in DEFERRED:
            self._hint(query)
            self.deferred.setdefault(query, []).append(params)
        else:
            self._exec(query, params)

    def sql(self, text: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[Row]:
        if isinstance(params, tuple) and params:
            text = text.replace("?", "%s")
        if self.deferred:
            self._send_deferred()
        cur = self.conn.cursor(row_factory=dict_row).execute(
            text, params or None, prepare=None if self.prepare else False
        )
        self._sync()
        return self._rows(cur)

    def quiet(self, channel: str) -> None:
        self.quieted.add(channel)

    def later(self, query: str, /, **params: Any) -> None:
        self.kept.setdefault(query, []).append(params)

    def flush(self) -> None:
        self._send_deferred()
        kept, self.kept = self.kept, {}
        for query, rows in kept.items():
            self._hint(query)
            self._send_many(query, rows)
        tail, self.tail = self.tail, []
        for query, params, out in tail:
            self.tail_sent.append((self._exec(query, params), out))

    def at_commit(self, query: str, /, **params: Any) -> AtCommit:
        out = AtCommit()
        self.tail.append((query, params, out))
        return out

    def read_tail(self) -> None:
        """The rows of the at_commit statements, for their callers; every path calls it once
        COMMIT has come back (in pipeline mode the rows arrive only with it)."""
        sent, self.tail_sent = self.tail_sent, []
        for cur, out in sent:
            out.set(self._rows(cur))

    def notify_if_queued(self, agents: list[str]) -> None:
        self.if_queued = agents

    def send_notifications(self) -> None:
        channels = sorted(self.notify - self.quieted)
        if self.if_queued is not None and REQUESTS in channels:
            # Evaluated after the statements that took requests for our own slots: a hint only
            # if some are left for other workers.
            channels.remove(REQUESTS)
            self._exec("notify_requests_left", {"channel": REQUESTS, "agents": self.if_queued})
        if channels:  # one statement for all channels: each statement costs a message exchange
            calls = ", ".join("pg_notify(%s, '')" for _ in channels)
            self.conn.execute(f"SELECT {calls}", channels, prepare=None if self.prepare else False)
        self.notify.clear()


URL_OPTIONS = ("listen", "pool_size", "prepare", "pooler")
# A partition (packets dropped, not refused) gives a socket no error: a statement waits for an
# answer that never comes, a LISTEN connection for notifications, for as long as the kernel keeps
# the connection: about 15 minutes of retransmissions while data is unacknowledged, else until
# libpq's keepalives (on by default, with the kernel's timings: a first probe after 2 hours). These
# settings end such a connection within about 30 s of silence, so the pool replaces it and the
# transaction's caller sees an error it already handles (REL3), instead of a thread that never
# returns. A live server answers the probes at the TCP level, so a slow statement or a long wait
# on a lock is not cut short. Given in the URL, the user's values win; ignored for Unix sockets.
TCP_DEFAULTS = (
    ("keepalives", "1"),
    ("keepalives_idle", "10"),  # seconds of silence before the first probe
    ("keepalives_interval", "5"),
    ("keepalives_count", "3"),  # unanswered probes, then the connection is dead: 10 + 3 * 5 s
    ("tcp_user_timeout", "30000"),  # ms that sent data may stay unacknowledged
)
_ON = ("on", "1", "true", "yes")
_OFF = ("off", "0", "false", "no")


def parse_url(url: str) -> tuple[str, dict[str, str]]:
    """Split our own options (``?listen=off&pool_size=N&prepare=off&pooler=transaction``) off a
    libpq URL; the rest of the query string is libpq's and goes to the server as given."""
    try:
        urlsplit(url)
    except ValueError as e:  # e.g. an unclosed IPv6 bracket
        raise InputError(f"bad PostgreSQL URL: {e}") from None
    # Cut the text itself: urlunsplit would drop an empty host (postgresql:///db?host=/tmp).
    head, _, rest = url.partition("?")
    query, hash_, fragment = rest.partition("#")
    ours: dict[str, str] = {}
    theirs: list[str] = []
    # libpq's parameters are passed on exactly as written: decoding and encoding them again would
    # turn a %20 into a '+', which libpq does not read as a space (options=-c%20name%3Dvalue).
    for raw in filter(None, query.split("&")):
        key, _, value = raw.partition("=")
        if unquote(key) in URL_OPTIONS:
            ours[unquote(key)] = unquote(value)
        else:
            theirs.append(raw)
    return head + ("?" + "&".join(theirs) if theirs else "") + hash_ + fragment, ours


@dataclass(frozen=True)
class PgOptions:
    """How the store uses its connections, from the URL's options (and constructor overrides)."""

    conninfo: str
    listen: bool  # a LISTEN connection for wake-ups (else polling alone)
    prepare: bool  # server-side prepared statements
    pool_size: int
    pooled: bool  # behind a transaction-mode pooler: no session state at all
    tcp: tuple[tuple[str, str], ...] = ()  # TCP_DEFAULTS the URL does not set, for every connection


def _switch(opts: dict[str, str], key: str, default: bool) -> bool:
    value = opts.get(key)
    if value is None:
        return default
    if value.lower() in _ON:
        return True
    if value.lower() in _OFF:
        return False
    raise InputError(f"URL option {key}={value!r}: expected on or off")


def pg_options(
    url: str, *, listen: bool | None = None, prepare: bool | None = None, pool_size: int | None = None
) -> PgOptions:
    """Our URL options, checked, with their defaults.

    ``pooler=transaction``: the URL names a transaction-mode pooler (PgBouncer), which gives each
    transaction whatever server session is free. Nothing may then rely on a session: LISTEN is
    off, server-side prepared statements are off (``prepare=on`` keeps them, for a pooler that
    tracks them: PgBouncer >= 1.22 with ``max_prepared_statements`` > 0), and the session limits
    are set per transaction. ``pooler=session`` (or ``none``) changes nothing. ``listen`` and
    ``prepare`` also work alone; ``pool_size`` is this process's own pool (default 4).
    """
    conninfo, opts = parse_url(url)
    pooler = opts.get("pooler", "none").lower()
    if pooler == "statement":
        raise InputError(
            "URL option pooler=statement: a statement-mode pooler refuses multi-statement "
            "transactions, which every transition needs; use pool_mode = transaction"
        )
    if pooler not in ("transaction", "session", "none"):
        raise InputError(f"URL option pooler={opts['pooler']!r}: expected transaction, session or none")
    pooled = pooler == "transaction"
    listen_on = listen if listen is not None else _switch(opts, "listen", not pooled)
    if pooled and listen_on:
        raise InputError(
            "URL options pooler=transaction and listen=on: LISTEN needs a session of its own, "
            "which a transaction-mode pooler does not give; leave listen off (workers poll)"
        )
    try:
        size = pool_size or int(opts.get("pool_size", "4"))
    except ValueError:
        raise InputError(f"URL option pool_size={opts['pool_size']!r}: expected a whole number") from None
    if size < 1:
        raise InputError(f"URL option pool_size={size}: expected at least 1")
    return PgOptions(
        conninfo=conninfo,
        listen=listen_on,
        prepare=prepare if prepare is not None else _switch(opts, "prepare", not pooled),
        pool_size=size,
        pooled=pooled,
        tcp=_tcp_defaults(conninfo),
    )


def _tcp_defaults(conninfo: str) -> tuple[tuple[str, str], ...]:
    """The :data:`TCP_DEFAULTS` that ``conninfo`` leaves unset (and that this libpq knows). A
    conninfo libpq cannot parse gets them all: the first connection then reports what is wrong with
    it, in one line. A ``service=`` entry's own settings are not seen here, so ours win over them."""
    given: dict[str, Any] = {}
    if psycopg is not None:
        with contextlib.suppress(psycopg.ProgrammingError):
            given = psycopg.conninfo.conninfo_to_dict(conninfo)
        if psycopg.pq.version() < 120000:  # libpq 10 and 11 reject tcp_user_timeout as unknown
            given["tcp_user_timeout"] = None
    return tuple((k, v) for k, v in TCP_DEFAULTS if k not in given)


class PostgresStore(Store):
    dialect = "postgres"

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        migrate: bool = True,
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
            kwargs=self._connect_kwargs(row_factory=dict_row),
            configure=None if opts.pooled else lambda conn: _configure(conn, OUR_SESSIONS),
            timeout=5.0,
        )
        # The pool retries with a warning per try; our one-line error says it all, so its own
        # log lines are held back while it opens (a server still starting is waited for).
        quiet = _Quiet()
        logging.getLogger("psycopg.pool").addFilter(quiet)
        try:
            self.pool.open(wait=True, timeout=10)
        except Exception as e:
            self.pool.close()
            # The pool says only that it gave up; the first try's error says why (no such host,
            # no server that satisfies target_session_attrs, ...).
            why = f"{probe} (still failing after 10 s)" if probe else str(e)
            raise StoreError(f"cannot connect to PostgreSQL at {redact_url(conninfo)}: {why}") from None
        finally:
            logging.getLogger("psycopg.pool").removeFilter(quiet)
        if migrate:
            self.migrate()

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
        marked ``stepwarden_autocommit`` (one statement) is sent on its own (:meth:`_autocommit`)."""
        if getattr(fn, "stepwarden_autocommit", False) and not (self.fake_time or self.options.pooled):
            try:
                return self._autocommit(fn, *args, **kwargs)
            except _NoLiveConnection:
                log.info("pooled connections found dead; taking the transactional path")
                self.pool.check()
        stage = ["begin"]
        try:
            return self._transact_once(stage, fn, *args, **kwargs)
        except psycopg.OperationalError as e:
            if stage[0] == "commit" or not _connection_lost(e):
                raise
            log.info("connection lost before commit; retrying the transaction on a fresh connection")
            self.pool.check()  # the other idle connections likely died with it: replace them now
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
            with self.pool.connection() as conn:
                if _stale(conn):
                    conn.close()  # the pool discards it and opens a replacement
                    continue
                conn.autocommit = True
                try:
                    tx = PgTx(conn, self.queries, set(), prepare=self.prepare)
                    out = fn(tx, *args, **kwargs)
                except psycopg.OperationalError as e:
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
        with self.pool.connection() as conn:
            if piped:
                return self._piped(conn, stage, notify, fn, *args, **kwargs)
            with conn.transaction():
                self._begin(conn)
                tx = PgTx(conn, self.queries, notify, prepare=self.prepare)
                out = _run_to_commit(tx, stage, fn, *args, **kwargs)
            tx.read_tail()
            return out

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
            raise TypeError("the PostgreSQL store needs a psycopg (3) connection to the same database")
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
        conn.rollback()

    def migrate(self, target: int | None = None, *, lock_wait: float | None = None) -> int:
        """Apply missing migrations, serialised across processes by an advisory lock (waited for
        at most ``lock_wait`` seconds, :data:`MIGRATION_LOCK_WAIT` by default, saying who holds it).
        A connection lost meanwhile (a worker starting while the server restarts), or a table lock
        a migration waited ``lock_timeout`` for, is retried with back-off: the migration
        transaction either committed whole or not at all."""
        wait = MIGRATION_LOCK_WAIT if lock_wait is None else lock_wait
        for delay in (0.5, 1.0, 2.0, 4.0, None):
            try:
                return self._migrate_once(target, wait)
            except psycopg.OperationalError as e:
                if delay is None:
                    raise
                why = str(e).strip()[:200]
                if getattr(e, "sqlstate", None) == "55P03":
                    log.warning(
                        "a migration statement waited too long for a table lock (%s); retrying in %.1fs",
                        why,
                        delay,
                    )
                else:
                    log.warning("connection lost during the migration (%s); retrying in %.1fs", why, delay)
                time.sleep(delay)
                self.pool.check()
        raise AssertionError("unreachable")

    def _migrate_once(self, target: int | None, lock_wait: float) -> int:
        """Take the migration lock without queueing behind it (``pg_try_advisory_xact_lock``, in
        a fresh transaction each try): a plain lock wait would end at ``lock_timeout`` with an
        error that reads like a failure, and would hold a transaction open meanwhile."""
        deadline = time.monotonic() + lock_wait
        said = -math.inf
        while True:
            with self.pool.connection() as conn, conn.transaction():
                self._begin(conn, clock=False)
                row: Any = conn.execute(
                    "SELECT pg_try_advisory_xact_lock(%s) AS ok", (MIGRATION_LOCK,)
                ).fetchone()
                if row["ok"]:
                    return self._apply_migrations(conn, target)
                holder = _migration_lock_holder(conn)
            now = time.monotonic()
            if now >= deadline:
                raise MigrationError(
                    f"another session has held the migration lock for longer than {lock_wait:g} s"
                    f" ({holder}); if it is stuck, end it with SELECT pg_terminate_backend(PID)"
                    " and run init again"
                )
            if now - said >= MIGRATION_LOCK_REPORT:
                log.warning("waiting for another session's migration of this database (%s)", holder)
                said = now
            time.sleep(min(MIGRATION_LOCK_POLL, max(0.0, deadline - now)))

    def _apply_migrations(self, conn: Any, target: int | None) -> int:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
            " name TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"
        )
        row: Any = conn.execute("SELECT COALESCE(MAX(version), 0) AS v FROM schema_migrations").fetchone()
        todo = pending_migrations("postgres", int(row["v"]), target)
        for version, name, statements in todo:
            for stmt in statements:
                conn.execute(stmt)
            conn.execute(
                "INSERT INTO schema_migrations VALUES (%s, %s, extract(epoch from now()))",
                (version, name),
            )
        return len(todo)

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
        while not stop.is_set():
            try:
                aconn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
                async with aconn:
                    for ch in wanted:
                        await aconn.execute(f"LISTEN {ch}")
                    delay = 0.2
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
                log.warning("LISTEN connection lost (%r); polling until it is back", e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                delay = min(5.0, delay * 2)

    def close(self) -> None:
        super().close()
        self.pool.close()
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
    dead before this returns never carried COMMIT, so that is retried (psycopg may send the last
    statements as they are queued); one lost from here on leaves the outcome unknown, and is raised."""
    out = fn(tx, *args, **kwargs)
    tx.flush()
    tx.send_notifications()
    stage[0] = "commit"
    return out


class _NoLiveConnection(Exception):
    """Three pooled connections in a row were found dead before anything was sent."""


def _migration_lock_holder(conn: Any) -> str:
    """Who holds the migration lock, for the operator: the backend's pid, its application name,
    where from, and for how long (what a role may see of another role's session is less)."""
    row: Any = conn.execute(
        "SELECT a.pid, a.application_name AS app, host(a.client_addr) AS addr, a.state,"
        " extract(epoch FROM now() - a.xact_start)::float8 AS held"
        " FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
        " AND l.classid::int8 * 4294967296 + l.objid::int8 = %s LIMIT 1",
        (MIGRATION_LOCK,),
    ).fetchone()
    if row is None or row["pid"] is None:
        return "held by a session this role cannot see"
    parts = [f"pid {row['pid']}"]
    if row["app"]:
        parts.append(f"application {row['app']!r}")
    if row["addr"]:
        parts.append(f"from {row['addr']}")
    if row["state"]:
        parts.append(str(row["state"]))
    if row["held"] is not None:
        parts.append(f"its transaction open {row['held']:.1f} s")
    return "held by " + ", ".join(parts)


def _connection_lost(e: BaseException) -> bool:
    """Whether an OperationalError means the session is gone (worth one retry on a fresh
    connection) rather than a statement stopped by the server in a live one: a lock timeout
    (55P03) or a cancelled statement (57014) would only wait, or fail, again."""
    state = getattr(e, "sqlstate", None)
    return state is None or state.startswith("08") or state in ("57P01", "57P02", "57P03")


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


def _first_connection(conninfo: str) -> str | None:
    """Fail at once, in one line, on a URL that cannot work: a malformed one is bad input (exit 2);
    a server that answers with an error (no such database, authentication failed) or a client
    setting libpq rejects will not get better by waiting. A server that cannot be reached
    (refused, timed out: perhaps restarting; a name not yet in DNS) is left to the pool's patient
    open; the reason is returned, for the message if the pool gives up too."""
    try:
        given = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as e:
        raise InputError(f"bad PostgreSQL URL: {_first_line(e)}") from None
    try:
        # The probe waits 5 s at most (less if the URL says less); a bad connect_timeout of the
        # URL's is bad input here, not a pool that never opens.
        probe_timeout = min(5, psycopg.conninfo.timeout_from_conninfo(given))
    except psycopg.ProgrammingError as e:
        raise InputError(f"bad PostgreSQL URL {redact_url(conninfo)}: {_first_line(e)}") from None
    try:
        psycopg.connect(conninfo, connect_timeout=probe_timeout).close()
    except psycopg.OperationalError as e:
        text = _first_line(e)
        if e.sqlstate is None and "invalid" in text and "value" in text:  # e.g. invalid sslmode value
            raise InputError(f"bad PostgreSQL URL {redact_url(conninfo)}: {text}") from None
        if "FATAL:" in text and not any(t in text for t in _TRANSIENT_FATAL):  # e.g. no such database
            raise StoreError(f"cannot connect to PostgreSQL at {redact_url(conninfo)}: {text}") from None
        return text
    return None


# A server's refusals that pass: it is starting, stopping or full. Any other FATAL at connect time
# (no such database or role, authentication failed) stays until someone changes something.
_TRANSIENT_FATAL = ("starting up", "shutting down", "recovery mode", "too many", "connection slots")


def _first_line(e: BaseException) -> str:
    text = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
    return text[:400] or type(e).__name__


def _check_live(conn: Any) -> None:
    """The caller pool's check when it lends a connection: a dead one is replaced, not lent."""
    if _stale(conn):
        raise psycopg.OperationalError("the pooled connection was closed by the server")


# How a lent session is set back, in one round trip (every part runs inside a transaction
# block): what DISCARD ALL does but DEALLOCATE ALL and DISCARD PLANS, then CALLER_SESSIONS again.
# - Prepared statements stay (ours, and psycopg's of the caller's SQL): psycopg keeps its own list
#   of them, and a DISCARD ALL it does not notice (it looks only at statements new to it) left it
#   naming one the server had forgotten.
# - DISCARD PLANS would have our statements planned again in every block (523 one-task blocks/s
#   with it, 750 without).
# - The first statement counts the statements the caller PREPAREd by hand (psycopg's are named
#   _pg3_*): a session with one is closed rather than lent again with it.
CALLER_RESET = (
    r"SELECT count(*) FROM pg_prepared_statements WHERE name !~ '^_pg3_';"
    " CLOSE ALL; SET SESSION AUTHORIZATION DEFAULT; RESET ALL; RESET ROLE; UNLISTEN *;"
    " SELECT pg_advisory_unlock_all(); DISCARD TEMP; DISCARD SEQUENCES; "
    + "; ".join(f"SET {name} = '{value}'" for name, value in CALLER_SESSIONS)
)


# The callers' connections that _settle_caller closed instead of lending them again. The pool
# warns of each closed connection given back ("discarding closed connection"), as of a fault;
# for these the store has decided, and says why itself (at INFO).
_SET_ASIDE: weakref.WeakSet[Any] = weakref.WeakSet()


class _NotForSetAside(logging.Filter):
    """Drops the pool's "discarding closed connection" record for a connection in ``_SET_ASIDE``
    only: any other connection's (one found closed by the pool itself) still gets its warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            str(record.msg).startswith("discarding closed connection") and args and args[0] in _SET_ASIDE
        )


_NOT_FOR_SET_ASIDE = _NotForSetAside()


def _quiet_deliberate_discards() -> None:
    logging.getLogger("psycopg.pool").addFilter(_NOT_FOR_SET_ASIDE)  # addFilter skips a repeat


def _set_aside(conn: Any, why: str, level: int = logging.INFO) -> None:
    _SET_ASIDE.add(conn)
    conn.close()
    log.log(level, "a connection given back by app.transaction() is closed, not lent again: %s", why)


def _settle_caller(conn: Any, pooled: bool) -> None:
    """A caller's connection given back, set back as it was lent: its transaction ended, the
    driver's per-connection options as opened, and (on a session of ours alone) the server
    session's settings, role, cursors, LISTENs, advisory locks, temporary tables and sequence
    state discarded (:data:`CALLER_RESET`), then ``CALLER_SESSIONS`` set again, and the
    notifications a LISTEN of the block received dropped. A connection that cannot be set back,
    or holds a statement the caller PREPAREd by hand, is closed: the pool replaces it. Behind a
    transaction pooler the session is not ours to discard, nor kept between blocks."""
    try:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.rollback()
        conn.row_factory = tuple_row
        conn.isolation_level = conn.read_only = conn.deferrable = None
        if not pooled:
            conn.autocommit = True
            cur = conn.execute(CALLER_RESET)
            if cur.fetchone()[0]:
                _set_aside(conn, "it holds a statement the block PREPAREd")
                return
            for _ in conn.notifies(timeout=0):  # what a LISTEN of the block received meanwhile
                pass
        conn.autocommit = False
    except psycopg.Error as e:
        # A fault, not a choice: the block may have committed and raised nothing.
        _set_aside(conn, f"it could not be set back ({_first_line(e)})", logging.WARNING)


def _configure(conn: Any, session: tuple[tuple[str, str], ...]) -> None:
    """A session's settings (``OUR_SESSIONS``, ``CALLER_SESSIONS``), once per connection that is
    ours alone."""
    for name, value in session:
        conn.execute(f"SET {name} = '{value}'")
    conn.commit()
