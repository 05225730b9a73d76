"""The state of the PostgreSQL server sessions the store uses: the settings each kind of session
of ours gets, and how a session lent to a caller's own transaction (``app.transaction()``) is set
back before it is lent again, or closed when it cannot be. Kept apart from the store because a
session outlives every transaction on it: what is set here is what the next one finds.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from .pg_options import _first_line

try:
    import psycopg
    from psycopg.rows import tuple_row
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

log = logging.getLogger("stepwarden.postgres")

# Our transactions never wait on the network, so a session idle inside one belongs to a paused or
# partitioned process: the server ends it, releasing its row locks (a paused ex-leader's FOR SHARE
# on its lease must not block the successor's acquire). Set once per connection when it is ours
# alone, else at the start of every transaction (SET LOCAL), so it never outlives it on a session
# that a pooler hands to someone else.
LOCK_TIMEOUT = ("lock_timeout", "10s")
SESSION_LIMITS = (("idle_in_transaction_session_timeout", "5s"), LOCK_TIMEOUT)
# A caller's block may wait on the network (a web handler calling a payment service between its
# INSERT and the commit): 5 s ended such blocks, with psycopg's bare "the connection is lost".
# It holds no lock a role of ours waits for (its task rows are new; only a submission of the
# same idempotency key, or a successor's acquire after a ``tx.fence``, waits for it), so its
# session gets a minute before the server ends it, not forever: a paused process's block still
# lets go (the error then names this limit: ``PostgresStore.block_error``).
CALLER_IDLE_LIMIT = 60
# Every statement of ours reaches its rows through an index, but a store starts empty, and on an
# empty table (never analysed: the planner assumes 10 pages) a sequential scan is the cheaper plan
# for `= ANY (ARRAY(...))` of the ids of a batch. A prepared statement keeps its generic plan until
# an ANALYZE invalidates it, so a worker started on a new store scanned the whole of `steps` and
# `requests` in every batch while they grew, until autovacuum's first ANALYZE (a minute or more):
# 1,996 rows read for 8 after 2,000 tasks. With sequential scans priced out, the plan made while a
# table is empty is the one that stays right once it is large (a query with no index still scans).
# JIT compilation goes with it: a plan that must scan all the same carries enable_seqscan's penalty
# (10^10) in its estimated cost, far past jit_above_cost, and a server built with LLVM (Debian's,
# most hosted ones; jit is on by default) compiled such a statement at every execution, 50-200 ms
# each (found on Debian's PostgreSQL 15). The store's statements are short: JIT never pays there.
PLANNER_SETTINGS = (("enable_seqscan", "off"), ("jit", "off"))
# Every transition is a conditional write that relies on READ COMMITTED: an UPDATE that meets a
# row another transaction changed waits for it and re-checks its condition on the new row. A
# database or role whose DBA set ``default_transaction_isolation`` to serializable or repeatable
# read made those writes fail with serialization errors under load instead (145 warnings in 30 s
# from two workers, a submission refused; found by review), so our sessions set it back. Behind a
# transaction-mode pooler a session setting would reach one server session only: there the
# connection's own isolation level has psycopg begin each transaction with it (_pin_isolation).
# A caller's block keeps the level the caller's database gives it: its SQL is the caller's.
READ_COMMITTED = ("default_transaction_isolation", "read committed")
# What each kind of session of ours gets: the pool's run only the store's statements; the one
# opened for a caller's own transaction (``App.transaction()``) runs the caller's SQL too, planned
# as usual; a caller's own connection (``tx_on``) gets nothing.
OUR_SESSIONS = SESSION_LIMITS + PLANNER_SETTINGS + (READ_COMMITTED,)
CALLER_SESSIONS = (("idle_in_transaction_session_timeout", f"{CALLER_IDLE_LIMIT}s"), LOCK_TIMEOUT)


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


# The pool's warnings that repeat for as long as the server is down: one per reconnection try
# and per dead connection found, about 60 lines a minute per worker in a 60 s outage (the
# roles, the lease keeper and the LISTEN loop log an outage once, at its start and end).
_REPEATING = (
    "error connecting in %r: %s",
    "reconnection attempt in pool %r failed after %s sec",
    "discarding broken connection: %s",
    "discarding closed connection: %s",
)
REPEAT_EVERY = 60.0  # seconds between two of them of one kind (and one pool)


class _OnceAMinute(logging.Filter):
    """Lets each of the store's pools' repeating warnings (:data:`_REPEATING`) through once per
    :data:`REPEAT_EVERY` seconds per pool and error, and drops the repeats; every other record
    passes, the application's own pools' included (the logger is the process's). An error other
    than the last one of its kind (a refusal, then a failed password) passes at once."""

    def __init__(self) -> None:
        super().__init__()
        self.last: dict[tuple[str, str, str], float] = {}
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg not in _REPEATING:
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg in _REPEATING[:2]:  # (pool name, ...)
            pool = str(args[0]) if args else ""
        else:  # (connection,): the pool that holds it, which psycopg_pool records on it
            pool = str(getattr(getattr(args[0], "_pool", None), "name", "")) if args else ""
        if not pool.startswith("stepwarden"):
            return True
        error = str(args[1]).split("\n", 1)[0] if record.msg == _REPEATING[0] and len(args) > 1 else ""
        key = (str(record.msg), pool, error)
        with self.lock:
            if record.created - self.last.get(key, float("-inf")) < REPEAT_EVERY:
                return False
            self.last[key] = record.created
        return True


_ONCE_A_MINUTE = _OnceAMinute()


def _quiet_repeats() -> None:
    logging.getLogger("psycopg.pool").addFilter(_ONCE_A_MINUTE)  # addFilter skips a repeat


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


def _pin_isolation(conn: Any) -> None:
    """A pooled connection of ours (``?pooler=transaction``): psycopg begins each of its
    transactions with ``BEGIN ISOLATION LEVEL READ COMMITTED`` (see :data:`READ_COMMITTED`)."""
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED


# A transaction that may not write: the server is a hot standby, or a DBA set
# default_transaction_read_only for the database or the role (a maintenance window, say). Either
# may end (a promotion, the window's end), so a worker waits it out as an outage; said in words
# that name both, where the driver's text ("cannot execute SELECT in a read-only transaction",
# for a submission's insert inside a SELECT) named neither.
READ_ONLY = "25006"
# A role without the rights a transition needs (a read-only role given to a worker).
INSUFFICIENT_PRIVILEGE = "42501"


def read_only_text(where: str, e: BaseException) -> str:
    return (
        f"{where} accepts no writes ({_first_line(e)}): the server is a hot standby,"
        " or default_transaction_read_only is on for this database or role; nothing was written."
        " Point the URL at the primary, or turn the setting off"
    )


# A transaction-mode pooler hands each transaction whichever server session is free, while psycopg
# names the statements it prepares per client connection (``_pg3_0``, ``_pg3_1``, ...): two
# clients on one server session collide (42P05, "already exists"), and a client whose next
# transaction lands on another session finds its statement gone (26000, "does not exist"). A
# direct connection, or a session-mode pooler, keeps one server session per client and never
# says either about a statement of psycopg's naming, so together they are the pooler's signature.
POOLER_SIGNS = frozenset({"42P05", "26000"})


def pooler_in_between(e: BaseException) -> bool:
    """Whether ``e`` is a prepared statement of psycopg's found taken or gone on the server session,
    as only a transaction-mode pooler in front of the server causes."""
    return getattr(e, "sqlstate", None) in POOLER_SIGNS and '"_pg3_' in str(e)


def pooler_text(where: str, e: BaseException) -> str:
    """The one line for :func:`pooler_in_between`: what was met, what it means, what to change."""
    return (
        f"PostgreSQL at {where} is reached through a transaction-mode pooler (such as PgBouncer"
        " with pool_mode = transaction), which shares server sessions between clients: a prepared"
        f" statement was found taken or gone ({_first_line(e)}), and the transaction was rolled back."
        " Add ?pooler=transaction to the URL (deploying.md, connection pooling); until then every"
        " transaction of this process is refused"
    )
