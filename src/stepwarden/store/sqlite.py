"""The embedded SQLite store (DEP1): WAL, busy timeout, ``BEGIN IMMEDIATE``, automatic migrations.

Any number of processes share one file. Writers serialise on SQLite's lock; ``BEGIN IMMEDIATE``
takes it at the start of each transaction, so a read-then-write inside a transaction can never be
overtaken by another process (no lost updates, no upgrade deadlocks), and ``busy_timeout`` turns
contention into waiting instead of errors. The database clock is ``sw_now()``, a function we
register on every connection that reads the store's :class:`~stepwarden.clock.Clock` (the host's
wall clock, the same one SQLite's ``julianday('now')`` reads), so tests can move time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar
from urllib.parse import urlencode

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import InputError, MigrationError, StoreError, StoreMisconfigured
from .base import timed
from .core import Store
from .sql import load_queries, pending_migrations, schema_version
from .sqlite_files import (
    can_write,
    damaged_text,
    disk_full,
    primary_code,
    refuse_foreign_read,
    shown,
    sqlite_why,
)
from .sqlite_lent import CALLER_IDLE_MAX, caller_pragmas, current_task, open_blocks
from .sqlite_tx import SqliteTx, dict_row
from .sqlite_watch import watch_data_version

log = logging.getLogger("stepwarden.sqlite")
P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=sqlite3.Connection)

DEFAULT_BUSY_TIMEOUT = 30.0  # seconds a writer waits for the write lock (``?busy_timeout=``)
# Seconds the event loop waits for the write lock, blocked, before a hot transaction polls it
# between the loop's other work instead (SQLiteStore.transact): longer than another process's usual
# transaction (a submission holds the lock ~0.4 ms), short enough for the loop's other work.
INLINE_SPIN = 0.002


# Past this much waiting for the write lock, a waiter looks whether anyone committed since its
# last try (``PRAGMA data_version``). If not, the lock has one long holder (a backup, a `sqlite3`
# shell, a migration), and the tries grow apart to LOCK_POLL_SLOW, so that waiting costs next
# to no CPU: at 2 ms apart, every waiting transaction of every worker tried ~500 times a second
# (16 % of a core for one idle worker while a shell held the lock). If so, writers are taking
# turns, and it keeps trying every 2 ms at most: slowed by time alone, the waiter that had waited
# longest kept losing the lock to newer ones (six processes of 1 ms transactions: waits of up
# to 1.6 s, against 0.3 s).
LOCK_WAIT_LONG = 0.1
LOCK_POLL_SLOW = 0.05


class _LockWaits:
    """Seconds between tries for the write lock: 0.1 ms growing to 2 ms, and past
    :data:`LOCK_WAIT_LONG` of waiting on to :data:`LOCK_POLL_SLOW` while nobody commits. SQLite's
    own busy handler sleeps 1, 2, 5, 10, 15, 20, 25... ms, so under contention a writer idled
    for milliseconds after the lock was freed (see :meth:`SQLiteStore.begin`)."""

    def __init__(self) -> None:
        self.delay = 0.0001
        self.long_after = time.monotonic() + LOCK_WAIT_LONG
        self.version: int | None = None
        self.unread = False  # the last look could not read the version

    def next(self, conn: sqlite3.Connection) -> float:
        """The wait before the next try on ``conn``, whose try just failed."""
        out = self.delay
        cap = 0.002
        if time.monotonic() >= self.long_after:
            version = _data_version(conn)
            if version is None:
                # Out of WAL mode an EXCLUSIVE (or PENDING) holder keeps readers out: a commit
                # holds it for a millisecond or so, so two looks in a row that cannot read are
                # one long holder (a shell's BEGIN EXCLUSIVE, a VACUUM, a large migration).
                quiet = self.unread
                self.unread = True
            else:
                quiet = version == self.version  # no commit since the last look: one long holder
                self.unread = False
                self.version = version
            if quiet:
                cap = LOCK_POLL_SLOW
        self.delay = min(self.delay * 1.5, cap)
        return out


def _data_version(conn: sqlite3.Connection) -> int | None:
    """SQLite's count of commits by other connections, as this one sees it (None if unreadable:
    out of WAL mode, while another connection holds the file's EXCLUSIVE lock)."""
    try:
        cur = conn.cursor()
        cur.row_factory = None  # the store's connections make dicts
        row = cur.execute("PRAGMA data_version").fetchone()
    except sqlite3.Error:
        return None
    return int(row[0]) if row else None


def _file_id(path: str) -> tuple[int, int] | None:
    """The file at ``path`` as the file system knows it (device, inode), or None if there is
    none (or it cannot be looked at, or the store is in memory)."""
    if path in ("", ":memory:") or path.startswith("file:"):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _busy(e: sqlite3.OperationalError) -> bool:
    """Another connection holds the lock ("database is locked", or a table's lock)."""
    return primary_code(e) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


class _StoreConnection(sqlite3.Connection):
    """A connection of ours, with what it knows of its own settings: whether the store is in WAL
    mode, and whether SQLite's busy handler is off now (:meth:`SQLiteStore._own_write_lock`)."""

    wal = False
    busy_off = False


# A write from the code inside an app.transaction() block on the same file (app.submit in the
# block's thread, app.submit_async in its task) would wait for the block's own write lock.
WRITE_IN_BLOCK = (
    "a write to the SQLite store inside an app.transaction() block on it, in the same {where},"
    " would wait for the block's own write lock: use the block's tx.submit"
)


class SQLiteStore(Store):
    dialect = "sqlite"

    def __init__(
        self,
        path: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        synchronous: str = "FULL",
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
        watch_interval: float = 0.005,
        migrate: bool = True,
        inline: bool = True,
    ) -> None:
        super().__init__()
        if synchronous.upper() not in ("FULL", "NORMAL", "EXTRA"):
            raise ValueError("synchronous must be FULL, NORMAL or EXTRA")
        self.path = path
        # The options that are not the defaults, so that workers started from this URL get them too.
        options = {"synchronous": synchronous.upper()} if synchronous.upper() != "FULL" else {}
        if busy_timeout != DEFAULT_BUSY_TIMEOUT:
            options["busy_timeout"] = f"{busy_timeout:g}"
        self.url = f"sqlite:///{path}" + (f"?{urlencode(options)}" if options else "")
        self.clock = clock
        self.synchronous = synchronous.upper()
        self.busy_timeout = busy_timeout
        self.watch_interval = watch_interval
        self.inline = inline  # hot transactions on the event loop's thread: see transact()
        self.queries = load_queries("sqlite", "sw_now()")
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._idle: list[sqlite3.Connection] = []  # kept for callers' transactions (lend)
        self._pristine: tuple[Any, ...] | None = None  # CALLER_PRAGMAS of a new connection
        # The file as lend() knows it in open_blocks() (one file may have several stores, one per App).
        self._file = None if path in ("", ":memory:") else os.path.realpath(path)
        self._closed = False
        self._lock = threading.Lock()
        self._inline_busy = 0  # hot transactions using their connection now (see _inline_use)
        self._inline_idle = threading.Condition(self._lock)
        # limit_lock_waits(): how long any one wait for the write lock may last, and since when
        # (a wait already in progress counts from then).
        self._wait_cap = math.inf
        self._wait_cap_since = 0.0
        # Its -wal and -shm as this process's first connection in WAL mode found them (beside the
        # real file, as SQLite puts them): while a connection of ours is open no other process
        # removes or replaces them, so one gone or another is a deletion under it (see replaced).
        self._side_ids: dict[str, tuple[int, int]] | None = None
        self._file_id: tuple[int, int] | None = None  # set once migrated (see replaced)
        refuse_foreign_read(path)  # before any connection: one would create files it must not
        if migrate:
            self.migrate()
        # The file opened, to tell one put in its place (see replaced); by its absolute path, as
        # a process that changes its working folder still has the same file open.
        self._abs_path = os.path.abspath(path) if path not in ("", ":memory:") else path
        self._file_id = _file_id(self._abs_path)

    def replaced(self) -> str | None:
        """Why the file at the store's path is no longer the one this store opened, or None.

        A store file deleted, or replaced (a backup restored, a file moved over it) under a
        running process leaves its connections on the old file: it went on claiming and writing
        where no other process looks, silently, while tasks in the new file waited for good.
        A worker checks this every heartbeat and stops (see ``worker._watch_store_file``)."""
        if self._file_id is None:
            return None
        now = _file_id(self._abs_path)
        if now != self._file_id:
            gone = now is None and not os.path.lexists(self._abs_path)
            what = "deleted" if gone else "replaced by another file"
            return f"the SQLite store {shown(self.path)} was {what} after this process opened it"
        sides, real = self._side_ids, self._file
        if sides is None or real is None or not self._all:
            # Only while a connection of ours that stays open (a thread's) holds the log: the last
            # connection to close removes the -wal, and a lent one may be the last.
            return None
        for suffix in ("-wal", "-shm"):
            now_side = _file_id(f"{real}{suffix}")
            known = sides.setdefault(suffix, now_side) if now_side is not None else sides.get(suffix)
            if known is not None and now_side != known:
                return (
                    f"the SQLite store {shown(self.path)}'s {suffix} file was deleted or replaced"
                    " while this process had the store open: processes that open it now use"
                    " another one, and the store may be damaged; stop every process that uses it,"
                    f" then check it with `sqlite3 {shown(self.path)} 'PRAGMA integrity_check'`"
                )
        return None

    def _refuse_if_replaced(self) -> None:
        """:class:`StoreError` before a write (a transaction, an ``app.transaction()`` block) into
        a file :meth:`replaced` says is not the one at the path: an application's submissions into
        a deleted or replaced file were acknowledged where no worker would ever look (found by
        review). A worker's hot transactions skip this (a stat or three) and rely on its watch of
        the file, every heartbeat."""
        why = self.replaced()
        if why is not None:
            raise StoreError(f"{why}; nothing was written: start this process again to open the store")

    def connect(self) -> _StoreConnection:
        """A new connection with our pragmas and clock; the caller owns it. Once the store is
        open, read-write and never create, as the watch's: a thread's first connection after the
        file was deleted under the process made an empty database at the path, which the other
        processes then took for the store ("no such table"), and the deletion for a replacement."""
        target, uri = self.path, False
        if self._file_id is not None:
            target, uri = Path(self._abs_path).as_uri() + "?mode=rw", True
        conn = sqlite3.connect(
            target,
            uri=uri,
            timeout=self.busy_timeout,
            isolation_level=None,
            check_same_thread=False,
            factory=_StoreConnection,
        )
        conn.row_factory = dict_row
        conn.create_function("sw_now", 0, self.clock.wall)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()
        conn.wal = str(next(iter(mode.values()))).lower() == "wal"
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        conn.execute("PRAGMA foreign_keys=ON")
        # The claim merges two short index walks with a sort of at most 2 x its limit rows: with
        # temporary b-trees in a file, each execution opened one (~0.13 ms, 7x the statement).
        conn.execute("PRAGMA temp_store=MEMORY")
        if self._side_ids is None and conn.wal:
            self._side_ids = {}  # each recorded when first seen (SQLite makes them at first use)
        return conn

    @contextmanager
    def lend(self) -> Iterator[sqlite3.Connection]:
        """A connection for a caller's transaction from a few kept for it, not a new one per
        block: opening one and setting its pragmas cost about as much as the submission itself
        (docs/performance.md, "A caller's transaction"). They are apart from the store's own, and
        one comes back into use only as :meth:`connect` made it: anything the caller's block left
        on it that we do not set back (an open transaction, a temporary table, an attached
        database, a setting of :data:`CALLER_PRAGMAS` unlike a new connection's, a closed
        connection) closes it instead.

        A block inside another block on the same file in the same thread is refused at once:
        it would wait for the outer block's write lock, which its own thread holds, until
        ``busy_timeout``, and then fail with "database is locked"."""
        if self._in_block():
            raise InputError(
                "app.transaction() inside another app.transaction() block on the same SQLite"
                " database, in the same thread: it would wait for the write lock the outer block"
                " holds; use the outer block's tx inside it, or open this block after it"
            )
        self._refuse_if_replaced()
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self.connect()
            if self._pristine is None:
                self._pristine = caller_pragmas(conn)
        file, blocks = self._file, open_blocks()
        if file is not None:
            blocks[file] = current_task()
        try:
            yield conn
        finally:
            if file is not None:
                blocks.pop(file, None)
            if not self._keep(conn):
                with contextlib.suppress(sqlite3.Error):
                    conn.close()

    def _keep(self, conn: sqlite3.Connection) -> bool:
        """Set ``conn`` back as it was lent and keep it for the next caller, if it can be."""
        try:
            if conn.in_transaction:  # first: setting isolation_level would COMMIT it
                return False
            conn.row_factory = dict_row
            conn.text_factory = str
            if conn.isolation_level is not None:
                conn.isolation_level = None
            conn.set_authorizer(None)
            conn.set_progress_handler(None, 0)
            conn.set_trace_callback(None)
            if (
                conn.execute("SELECT 1 FROM temp.sqlite_master LIMIT 1").fetchone()
                or [r for r in conn.execute("PRAGMA database_list") if r["name"] not in ("main", "temp")]
                or caller_pragmas(conn) != self._pristine  # our synchronous and foreign_keys among them
            ):
                return False
        except sqlite3.Error:  # closed by the caller, or broken: not lent again
            return False
        with self._lock:
            if self._closed or len(self._idle) >= CALLER_IDLE_MAX:
                return False
            self._idle.append(conn)
        return True

    def _conn(self) -> _StoreConnection:
        return self._thread_conn("conn")

    def _thread_conn(self, name: str) -> _StoreConnection:
        """This thread's connection ``name`` (``conn``: transactions on the calling thread;
        ``inline``: hot transactions on its event loop), made at first use, closed by close()."""
        conn: _StoreConnection | None = getattr(self._local, name, None)
        if conn is None:
            conn = self.connect()
            setattr(self._local, name, conn)
            with self._lock:
                self._all.append(conn)
        return conn

    def transact_sync(self, fn: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        if not getattr(fn, "stepwarden_read_only", False):
            self._refuse_if_replaced()  # before this thread's first connection, which would fail
        with self._explaining():
            return self._transact_on(self._conn(), fn, *args, **kwargs)

    def transact_on(
        self,
        conn: sqlite3.Connection,
        fn: Callable[Concatenate[Any, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """One ``BEGIN IMMEDIATE`` transaction on ``conn``: commit on return, roll back on error.
        A function marked :func:`~stepwarden.store.base.read_only` runs in a deferred one instead:
        under WAL it reads a snapshot and never waits for, nor holds, the write lock.

        Two failures are raised as :class:`StoreError` naming the store and the cause (chained from
        sqlite3's error), since sqlite3's text names neither: the write lock still held by another
        connection when the busy timeout ran out, and a store this user cannot write. Every other
        error goes on as it came."""
        if not getattr(fn, "stepwarden_read_only", False):
            self._refuse_if_replaced()
        with self._explaining():
            return self._transact_on(conn, fn, *args, **kwargs)

    @contextmanager
    def _explaining(self) -> Iterator[None]:
        """Raise :meth:`_explained`'s :class:`StoreError` (chained) in place of the sqlite3 error
        it explains, with how long the block waited; any other error goes on as it came."""
        started = time.monotonic()
        try:
            yield
        except sqlite3.DatabaseError as e:  # OperationalError is one; so is a damaged file's
            explained = self._explained(e, time.monotonic() - started)
            if explained is None:
                raise
            raise explained from e

    def _explained(self, e: sqlite3.DatabaseError, waited: float) -> StoreError | None:
        """:class:`StoreError` for the lock that stayed taken, the store that cannot be written and
        the file that is damaged; ``None`` for any other error (a caller's own SQL in
        ``app.transaction()`` gets sqlite3's errors as they came)."""
        code = primary_code(e)
        if code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
            return StoreError(damaged_text(shown(self.path), e))
        if code == sqlite3.SQLITE_BUSY:
            return StoreError(
                f"the SQLite store {shown(self.path)} stayed locked by another writer for"
                f" {waited:.1f} s (busy timeout {self.busy_timeout:g} s), so nothing was written: {e}"
            )
        if code == sqlite3.SQLITE_READONLY:
            if self._file is not None and can_write(self._file):
                # SQLite opened the file read-only while it could not be written, and keeps it so
                # for every connection of this process to it: no wait heals that, and a worker
                # warned every 10 s for ever after the permissions were mended (found by review).
                return StoreMisconfigured(
                    f"cannot write to the SQLite store {shown(self.path)} ({e}): this process opened"
                    " it while it could not be written, and SQLite keeps it read-only for as long as"
                    " the process has it open; it can be written now: start the process again"
                )
            why = sqlite_why(self.path, e)
            return StoreError(f"cannot write to the SQLite store {shown(self.path)}: {why}")
        if code == sqlite3.SQLITE_FULL or (code == sqlite3.SQLITE_IOERR and disk_full(self.path)):
            return StoreError(
                f"the disk holding the SQLite store {shown(self.path)} is full ({e}), so nothing was"
                " written: free space, then try again (with the same idempotency key, a submission"
                " returns its task if it was written)"
            )
        return None

    def _transact_on(
        self,
        conn: sqlite3.Connection,
        fn: Callable[Concatenate[Any, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        if getattr(fn, "stepwarden_read_only", False):
            self._busy_handler_on(conn)  # a reader in WAL mode may meet a recovery, and waits it out
            conn.execute("BEGIN")
        else:
            if self._in_block():
                # app.submit (or any write) inside app.transaction() on this file, same thread:
                # it would wait busy_timeout for the write lock its own thread's block holds.
                raise InputError(WRITE_IN_BLOCK.format(where="thread"))
            if isinstance(conn, _StoreConnection):
                self._take_write_lock(conn, self._own_write_lock)
            else:  # a plain connection handed to transact_on: as a caller's
                self.begin(conn)
        return self._run(conn, fn, *args, **kwargs)

    def _run(
        self,
        conn: sqlite3.Connection,
        fn: Callable[Concatenate[Any, P], R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """``fn`` in the transaction begun on ``conn``: commit on return, roll back on error."""
        try:
            tx = SqliteTx(conn, self.queries)
            out = fn(tx, *args, **kwargs)
            tx.flush()
            conn.execute("COMMIT")
        except BaseException:
            # A COMMIT that fails (a deferred constraint, a full disk) may leave the transaction
            # open, and one SQLite already ended (SQLITE_FULL) cannot be rolled back: either way
            # the connection leaves without a transaction, and with the error that ended it.
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise
        return out

    async def transact(self, fn: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """A transaction of the hot path (:func:`~stepwarden.store.base.hot`) runs here, on the
        event loop's own thread; any other on the store's thread (:meth:`Store.transact`).

        Why: on the store's thread each statement gives Python's interpreter lock back while
        SQLite works and must take it again from the loop, which is often running the roles
        meanwhile, and SQLite's write lock, shared by every process on the file, stayed held
        through those waits (a ``PRAGMA`` that takes 10 µs took 170-330 µs there). Here the
        statements and the commit run back to back, with no ``await`` between ``BEGIN`` and
        ``COMMIT``: the loop is blocked for the transaction (a batch: about a millisecond, the
        commit's fsync included) and for at most ``INLINE_SPIN`` of waiting for the lock before
        it; a longer wait polls the lock between the loop's other work (every millisecond, and
        past ``LOCK_WAIT_LONG`` of waiting with nobody committing, slower, up to
        ``LOCK_POLL_SLOW`` apart), up to
        ``busy_timeout`` (or the bound a stopping worker sets) as :meth:`begin` does. Inside an
        ``app.transaction()`` block open in this thread it goes to the store's thread, which
        waits for the block's lock instead of refusing; a write from the task that opened the
        block (``submit_async`` inside it) is refused at once (:class:`InputError`): it would
        wait for the lock its own task holds. One awaited from inside the block through another
        task (``asyncio.gather``, ``wait_for``), which cannot be told from an unrelated task,
        waits until ``busy_timeout``, and its :class:`StoreError` says that the block held the lock."""
        if self._in_block():
            writes = not getattr(fn, "stepwarden_read_only", False)
            owner = open_blocks().get(self._file or "")  # the task that opened the block, or None
            if writes and owner is not None and owner is current_task():
                # submit_async inside the block, from the block's own task: its store thread
                # would wait busy_timeout for the lock this task holds, then blame "another writer".
                raise InputError(WRITE_IN_BLOCK.format(where="task"))
            try:
                return await super().transact(fn, *args, **kwargs)
            except StoreError as e:
                cause = e.__cause__
                held_by_block = (
                    writes
                    and isinstance(cause, sqlite3.OperationalError)
                    and primary_code(cause) == sqlite3.SQLITE_BUSY
                    and self._in_block()  # still open: not ended before the wait did
                    and open_blocks().get(self._file or "") is owner
                )
                if not held_by_block:
                    raise
                # Not "another writer": a block of this thread held the lock all along. Awaited
                # from inside that block through a task of its own (asyncio.gather, wait_for),
                # this write could never begin before the block ended.
                raise StoreError(
                    f"{e}; an app.transaction() block open on this store in this thread (the event"
                    " loop's) held the lock: a write awaited from inside that block (also through"
                    " asyncio.gather, wait_for or a task it started) waits for the block's own lock;"
                    " submit through the block's tx"
                ) from cause
        if not (self.inline and getattr(fn, "stepwarden_hot", False)):
            return await super().transact(fn, *args, **kwargs)
        started = time.monotonic()
        run = timed(fn, self.clock.monotonic(), self.clock)
        waits = _LockWaits()
        with self._explaining():
            while True:
                with self._inline_use() as conn:  # a new one after close(), as _conn() gives
                    if self._own_write_lock(conn, started):
                        return self._run(conn, run, *args, **kwargs)
                    delay = waits.next(conn)
                if time.monotonic() - started < INLINE_SPIN:
                    time.sleep(delay)
                else:
                    await asyncio.sleep(max(0.001, delay))

    @contextmanager
    def _inline_use(self) -> Iterator[_StoreConnection]:
        """This thread's connection for hot transactions, counted as in use until the block ends,
        so that :meth:`close` waits for it as it waits for the store's threads (closing a
        connection while a statement runs on it can crash the process). The loop's coroutines
        share it safely: each one's transaction runs from ``BEGIN`` to ``COMMIT`` without giving
        the loop back."""
        with self._lock:
            self._inline_busy += 1
        try:
            yield self._thread_conn("inline")
        finally:
            with self._lock:
                self._inline_busy -= 1
                self._inline_idle.notify_all()

    def tx_on(self, conn: Any) -> SqliteTx:
        """A :class:`Tx` over a connection whose transaction the caller manages (SUB2)."""
        if not isinstance(conn, sqlite3.Connection):
            raise InputError(
                "app.transaction(connection): the SQLite store needs a sqlite3.Connection to its"
                f" database file, not a {type(conn).__name__}"
            )
        if not conn.in_transaction and (
            getattr(conn, "autocommit", None) is True or conn.isolation_level is None
        ):
            # sqlite3 would begin no transaction: each of our statements would commit on its own,
            # and stay whatever the block did next (without isolation_level=None, sqlite3 begins
            # one before the first write, and the caller commits it as usual).
            raise InputError(
                "app.transaction(connection): the sqlite3 connection is in autocommit mode"
                " (isolation_level=None) and not inside a transaction, so each statement would"
                " commit on its own; run BEGIN on it first"
            )
        conn.create_function("sw_now", 0, self.clock.wall)
        return SqliteTx(conn, self.queries, caller_managed=True)

    def hold_write_lock(self, conn: sqlite3.Connection) -> bool:
        """Make the caller's transaction on ``conn`` hold SQLite's write lock, for ``tx.fence``
        (LEAD4, LEAD7): checked under it, the term cannot change before the block ends, because
        a successor's acquire is a write and SQLite has one writer. True if this began the
        transaction (``BEGIN IMMEDIATE``), for the fence to roll back if the check fails.

        Without it the fence's check is a read, which holds nothing. ``sqlite3`` in its default
        mode begins a transaction only before the first write, so the check ran on its own and
        the block's writes in a transaction begun after it: a successor could take the lease in
        between and the deposed leader's writes commit under the new term. Out of a transaction,
        then, this begins one that holds the lock; the caller commits it as usual. Inside a
        deferred one (``BEGIN``; or Python 3.12's ``autocommit=False``, which always has one
        open) that has not written yet, a read would hold only a snapshot: a successor could
        take the lease after it, and the block would learn that only from its first write's
        ``SQLITE_BUSY_SNAPSHOT``. :data:`_TAKE_WRITE_LOCK` takes the lock there, writing
        nothing. A transaction that read before another connection's last commit can never take
        it (SQLite writes only from the newest state): :class:`StoreError`, saying to fence
        before reading. A lock another writer keeps for the connection's own busy timeout is a
        :class:`StoreError` too; nothing of the block was written in either case."""
        began = not conn.in_transaction
        started = time.monotonic()
        try:
            conn.execute("BEGIN IMMEDIATE" if began else _TAKE_WRITE_LOCK)
        except sqlite3.OperationalError as e:
            if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY_SNAPSHOT:
                raise StoreError(
                    "tx.fence: the block's transaction read the SQLite store"
                    f" {shown(self.path)} before another connection's last write, so it cannot take"
                    " the write lock the fence holds until the block ends (SQLite writes only from"
                    " the newest state); call tx.fence before the transaction reads anything, or"
                    " begin it with BEGIN IMMEDIATE"
                ) from e
            if _busy(e):
                raise StoreError(
                    f"tx.fence: the SQLite store {shown(self.path)} stayed locked by another writer"
                    f" for {time.monotonic() - started:.1f} s (the connection's busy timeout), so"
                    " the fence could not take the write lock; nothing was checked"
                ) from e
            explained = self._explained(e, time.monotonic() - started)
            if explained is None:
                raise
            raise explained from e
        return began

    def begin(self, conn: Any) -> None:
        """Take the write lock, retrying every fraction of a millisecond while another writer holds it.

        SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25... ms between tries, so under
        contention a writer idles for milliseconds after the lock was freed: with many short
        transactions from several processes that idling, not the work, sets the pace. Here the
        busy handler is off for BEGIN only (set back for every other statement: this is a
        caller's lent connection; the store's own set it only when it changes, see
        :meth:`_own_write_lock`) and the retry sleeps 0.1 ms growing to 2 ms (to 50 ms past 0.1 s
        of waiting), until the same ``busy_timeout`` deadline.

        A lock still taken at the deadline, or a store this user cannot write, is a
        :class:`StoreError` naming the store (chained from sqlite3's error): ``app.transaction()``
        begins its block here, outside :meth:`transact_on`."""
        with self._explaining(), self._busy_handler_off(conn):
            self._take_write_lock(conn, self._try_write_lock)

    def _take_write_lock(self, conn: C, attempt: Callable[[C, float], bool]) -> None:
        """Call ``attempt`` (one try for the lock) until it takes it, sleeping in between."""
        started = time.monotonic()
        waits = _LockWaits()
        while not attempt(conn, started):
            time.sleep(waits.next(conn))

    @contextmanager
    def _busy_handler_off(self, conn: sqlite3.Connection) -> Iterator[None]:
        """SQLite's busy handler off while we try for the write lock ourselves, and back for the
        statements after it: a store that could not enter WAL mode (a file system without shared
        memory) waits at COMMIT for its readers."""
        conn.execute("PRAGMA busy_timeout = 0")
        try:
            yield
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")

    def _own_write_lock(self, conn: _StoreConnection, started: float) -> bool:
        """:meth:`_try_write_lock` on one of the store's own connections, which sets SQLite's
        busy handler only when it has to, not twice per transaction as :meth:`_busy_handler_off`
        does for a caller's: off to try for the lock, and left off after it in WAL mode, where a
        transaction that holds the write lock never waits again (its COMMIT appends to the log
        and checkpoints passively; only a reader may wait, and a read-only transaction sets the
        handler back first). The two ``PRAGMA`` statements cost a submission about 6 % of its
        time, and a worker's transactions held the write lock through the second one."""
        if not conn.busy_off:
            # The mark first: interrupted between the two, a later reader sets the handler on
            # again for nothing, rather than read with it off.
            conn.busy_off = True
            conn.execute("PRAGMA busy_timeout = 0")
        locked = self._try_write_lock(conn, started)
        if locked and not conn.wal:
            self._busy_handler_on(conn)  # out of WAL mode, COMMIT waits for the readers
        return locked

    def _busy_handler_on(self, conn: sqlite3.Connection) -> None:
        """SQLite's busy handler back on one of the store's own connections, if it was off."""
        if isinstance(conn, _StoreConnection) and conn.busy_off:
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            conn.busy_off = False

    def _try_write_lock(self, conn: sqlite3.Connection, started: float) -> bool:
        """One ``BEGIN IMMEDIATE`` (the busy handler off): False if another writer holds the lock;
        ``SQLITE_BUSY`` raised once ``busy_timeout`` has passed since ``started``, or the bound
        of :meth:`limit_lock_waits`, whichever comes first. One of our connections that an
        interrupt left inside a transaction (between its ``BEGIN`` and the ``try`` that ends it)
        is rolled back first: otherwise every later ``BEGIN`` on it would fail."""
        if conn.in_transaction:
            log.warning("a store connection was left inside a transaction; rolled back")
            conn.execute("ROLLBACK")
        try:
            conn.execute("BEGIN IMMEDIATE")
            return True
        except sqlite3.OperationalError as e:
            capped = max(started, self._wait_cap_since) + self._wait_cap
            if not _busy(e) or time.monotonic() >= min(started + self.busy_timeout, capped):
                raise
            return False

    def in_transaction(self, conn: Any) -> bool:
        return bool(conn.in_transaction)

    def _in_block(self) -> bool:
        """This thread has an app.transaction() block open on this store's file (the write lock)."""
        return self._file is not None and self._file in open_blocks()

    def limit_lock_waits(self, seconds: float) -> None:
        # Only BEGIN waits for the write lock (every statement after it holds it), and that wait
        # is this loop, not SQLite's busy handler: a new bound reaches the waits in progress too.
        self._wait_cap_since = time.monotonic()
        self._wait_cap = min(self._wait_cap, seconds)

    def commit(self, conn: Any, tx: Any) -> None:
        tx.flush()
        conn.execute("COMMIT")

    def rollback(self, conn: Any) -> None:
        conn.execute("ROLLBACK")

    def migrate(self, target: int | None = None) -> int:
        """Apply missing migrations under the write lock (safe when many processes start at once)."""
        folder = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(folder):
            raise MigrationError(f"cannot create the SQLite store: directory {folder} does not exist")
        self._refuse_foreign_untouched()
        conn = self._conn()
        self._busy_handler_on(conn)  # SQLite's busy handler waits for another migrating process
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = schema_version(
                "sqlite", lambda q: [tuple(r.values()) for r in conn.execute(q).fetchall()]
            )
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY,"
                " name TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
            todo = pending_migrations("sqlite", version, target)
            for version, name, statements in todo:
                for stmt in statements:
                    conn.execute(stmt)
                conn.execute("INSERT INTO schema_migrations VALUES (?, ?, sw_now())", (version, name))
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return len(todo)

    def _refuse_foreign_untouched(self) -> None:
        """Refuse another application's database (a table named like ours, another tool's
        ``schema_migrations``) before the store's first connection, which switches the file to
        WAL for good: the refusal says nothing was changed, and it was. A database not in WAL
        mode (not a store of ours, or not yet one) is checked through a read-only connection.

        Through SQLite, not by reading the file's header in Python: closing any descriptor of the
        file drops every POSIX lock this process holds on it, those of the connections another
        store of the same file (another App) has open, and their reads then went stale (a worker
        whose app had a store of its own never saw its own heartbeat). SQLite shares one
        descriptor per file between a process's connections."""
        if not os.path.isfile(self.path) or os.path.getsize(self.path) == 0:
            return
        uri = Path(self.path).absolute().as_uri() + "?mode=ro"
        try:
            with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=self.busy_timeout)) as ro:
                mode = ro.execute("PRAGMA journal_mode").fetchone()
                if mode is None or str(mode[0]).lower() == "wal":
                    return
                schema_version("sqlite", lambda q: [tuple(r) for r in ro.execute(q)])
        except sqlite3.Error:
            return  # not a database, locked, unreadable: the store's own connection says which

    async def listen(
        self, wake: Callable[[str], None], stop: asyncio.Event, channels: Sequence[str] | None = None
    ) -> None:
        """SQLite's wake-up hint: ``PRAGMA data_version`` changes whenever another connection
        commits; a thread watches it every ``watch_interval`` seconds and wakes the roles when it
        moves (:func:`~stepwarden.store.sqlite_watch.watch_data_version`)."""
        await watch_data_version(self._watch_connection, self.watch_interval, wake, stop, channels)

    def _watch_connection(self) -> sqlite3.Connection:
        """The watcher's own connection: ``data_version`` moves only for other connections' commits.
        Read-write, never create: a store file removed under a running worker must not come back
        as an empty database because the watch reconnected."""
        if self.path == ":memory:":
            return sqlite3.connect(self.path, check_same_thread=False)
        uri = Path(self.path).absolute().as_uri() + "?mode=rw"
        return sqlite3.connect(uri, uri=True, timeout=self.busy_timeout, check_same_thread=False)

    def close(self) -> None:
        super().close()  # waits for the transactions running on the store's threads
        with self._lock:
            self._inline_idle.wait_for(lambda: self._inline_busy == 0)  # and on event loops
            self._closed = True
            for conn in self._all + self._idle:
                with contextlib.suppress(sqlite3.ProgrammingError):
                    conn.close()
            self._all.clear()
            self._idle.clear()
        self._local = threading.local()


# The write lock inside a deferred transaction, for tx.fence (hold_write_lock): an UPDATE opens
# the write transaction before it looks at a row, and this one matches none, so nothing is written.
_TAKE_WRITE_LOCK = "UPDATE leases SET term = term WHERE 0"
