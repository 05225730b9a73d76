"""The caller's own transaction (SUB2): ``with app.transaction() as tx`` runs their SQL and
submits tasks so that all commit or none, and finds out when the block's code ended the
transaction itself (a COMMIT or ROLLBACK), which would otherwise commit part of it silently."""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .errors import InputError, StoreError, UnknownWorkflow
from .leader import Leadership
from .policies import show
from .store import transitions
from .store.base import Tx, read_only
from .store.sqlite import SQLiteStore
from .store.supervision import fence
from .workflow import Workflow

if TYPE_CHECKING:
    from .app import App

# The savepoint that marks the block's transaction on the caller's own sqlite3 connection.
SQLITE_MARK = "stepwarden_block"


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
        # A mark of the block's own transaction, looked for when the block ends. A transaction
        # ended on the connection (COMMIT, ROLLBACK) and followed by more SQL looks open again:
        # psycopg begins a new one with the next statement, as sqlite3 does before the next
        # write in its default mode. The mark was the transaction id of the first submission,
        # so an end before it split the block unnoticed: the caller's row committed apart from
        # the tasks, or rolled back under them. PostgreSQL: a transaction-local setting, set
        # when the block begins; the caller's own sqlite3 connection: a savepoint, set as soon as
        # a transaction is open (at the start, or after the block's first write through tx: not
        # a BEGIN of ours, which would make a first read take a snapshot, and a fence that
        # failed keep the write lock). A lent SQLite connection is in autocommit mode, where an
        # end is found as the transaction being closed.
        self._mark: str | None = None
        self._ended_block = False  # set when the with block ends: the handle is no use after it
        if not lent:
            self._check_same_database()
        self._mark_block()

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        """Your SQL in this transaction, with the driver's placeholders (``?`` sqlite3, ``%s`` psycopg).
        A statement that ends the transaction (``COMMIT``, ``ROLLBACK``) raises :class:`StoreError`.

        On PostgreSQL it is never prepared on the server: a lent session outlives the block, and
        a statement psycopg had prepared on it would fail ("cached plan must not change result
        type") once your schema changed under it."""
        self._check_in_block()
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
            self._mark_sqlite()
        elif was_open:  # this statement ended it: stopped here, what follows would run outside it
            raise self._ended_error()
        return out

    def fence(self, lead: Leadership) -> None:
        """Raise :class:`~stepwarden.errors.LostOwnership` unless ``lead``'s term still holds
        its lease on the database clock, so that the block's writes commit only under a current
        term (LEAD4 for an application's own leader work, LEAD7). Call it first in the block.

        The check holds until the block's transaction ends: no successor can be granted the
        lease in between (and neither can this process's own renewal: keep a fenced block well
        under the lease's ``ttl - margin``). On PostgreSQL the lease row stays share-locked, and
        a successor's acquire waits for it; so the block's session may sit idle in its
        transaction only for what is left of the term's trust window, which ends ``margin``
        before the lease expires (``idle_in_transaction_session_timeout``, set for the
        transaction, never raised), after which the server ends it and the block commits
        nothing: a leader paused inside the block (SIGSTOP, a partition) kept its
        successors out for the 60 s a block's session otherwise has. On SQLite the block's
        transaction holds the write lock from the check on, and an acquire is a write: on your
        own ``sqlite3`` connection the fence takes it (``BEGIN IMMEDIATE`` when no transaction
        is open, as in ``sqlite3``'s default mode before the first write; else a statement that
        writes nothing), so the block's later writes cannot land in a transaction begun after a
        successor took over. A transaction that read before another connection's last write
        cannot take the lock: :class:`~stepwarden.errors.StoreError`, as for a lock that stays
        taken. A failed check rolls back the transaction the fence began, holding nothing."""
        self._check_in_block()
        if not isinstance(lead, Leadership):
            raise InputError(f"fence takes the Leadership your leader work was given, not {show(lead)}")
        if self._opened and not self._open_now():
            raise self._ended_error()
        store = self.app.store
        # A lent connection holds the lock since its BEGIN IMMEDIATE.
        began = isinstance(store, SQLiteStore) and not self._lent and store.hold_write_lock(self.connection)
        try:
            fence(self._tx, lead.holder, lead.name, lead.term)
            limit = _idle_limit(lead)
            if self._tx.dialect == "postgres" and limit is not None:
                # The lease row stays share-locked until the block ends (no renewal either): a
                # leader paused inside it must not keep its successors out past its lease.
                self._tx.run("fence_idle_limit", ms=limit)
        except BaseException:
            if began:  # only the check was in it: nothing of the caller's is undone
                store.rollback(self.connection)
            raise
        self._opened = self._opened or self._open_now()
        self._mark_sqlite()

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
        self._check_in_block()
        text, kw = self.app._prepare(workflow, input, correlation_id, idempotency_key, priority, reply_to)
        if self._opened and not self._open_now():
            raise self._ended_error()  # ended on the connection itself: nothing written after it
        wf = self.app.own_workflow(workflow)
        if wf is None:  # look it up inside this transaction: another connection would wait on our lock
            row = self._tx.one("get_workflow", name=workflow)
            if row is None:
                raise UnknownWorkflow(f"unknown workflow {workflow!r}")
            wf = Workflow.from_dict(json.loads(row["definition"]))
        try:
            task_id, created = transitions.submit(self._tx, wf, text, **kw)
            # The task's received event and message written now, not kept for the commit: a
            # COMMIT the caller's code sends on the connection commits whole tasks, and nothing
            # of ours is left to write once the transaction has ended.
            self._tx.flush()
        except sqlite3.OperationalError as e:
            if getattr(e, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY_SNAPSHOT:
                raise
            # The driver says "database is locked", which reads as "wait and try again"; inside
            # this transaction no wait helps.
            raise StoreError(
                "tx.submit: the block's transaction read the SQLite store before another"
                " connection's last write, so it cannot write (SQLite writes only from the newest"
                " state) and nothing was submitted; roll it back and run the block again, or begin"
                " it with BEGIN IMMEDIATE"
            ) from e
        self._opened = self._opened or self._open_now()
        self._mark_sqlite()
        if created:
            self._submitted.append(task_id)
        return task_id

    def _check_in_block(self) -> None:
        """Refuse a use of the handle after its ``with`` block: its connection may be lent to
        another block by then (another request's, in a web server), whose transaction the task
        would join, commit with or be rolled back with."""
        if self._ended_block:
            raise InputError(
                "this app.transaction() block has ended: use its handle inside the with block only"
            )

    def _check_same_database(self) -> None:
        """The caller's own connection must be to the app's store: a task written in another
        database (another store, or one with no stepwarden schema) would never be seen by this
        app's workers, nor by the app itself. On SQLite, the connection's main file, which
        ``PRAGMA database_list`` names without reading the database (a read would take a snapshot
        in the caller's transaction); on PostgreSQL the store's identity row, read as the block
        marks its transaction (see ``_mark_block``)."""
        store = self.app.store
        if store.dialect == "postgres":
            return
        conn = self.connection
        cur = conn.cursor()
        cur.row_factory = None  # the caller's factory may not give tuples
        # The file name as bytes, whatever the caller's text_factory makes of text (a SELECT of
        # pragma_database_list, which could cast it, would take the snapshot). The main
        # database is seq 0.
        factory, conn.text_factory = conn.text_factory, bytes
        try:
            files = [row[2] for row in cur.execute("PRAGMA database_list") if row[0] == 0]
        finally:
            conn.text_factory = factory
        theirs = os.fsdecode(files[0]) if files and files[0] else ""
        try:
            same = bool(theirs) and os.path.samefile(theirs, getattr(store, "path", ""))
        except OSError:
            same = False
        if not same:
            where = show(theirs) if theirs else "a database in memory"
            raise InputError(
                f"app.transaction(connection): the connection is to {where}, not to this app's"
                f" store {show(getattr(store, 'path', store.url))}; nothing was written"
            )

    def _mark_block(self) -> None:
        """Mark the transaction the block begins in (see ``_mark``), before its first statement;
        on the caller's own PostgreSQL connection, then check that it is the app's store."""
        if self.app.store.dialect == "postgres":
            self._mark = secrets.token_hex(8)
            if self._lent:
                self._tx.sql("SELECT set_config('stepwarden.block', ?, true)", (self._mark,))
            else:
                self._mark_own_postgres()
            self._opened = True
        else:
            self._mark_sqlite()

    def _mark_own_postgres(self) -> None:
        """The mark, and whether the database holds a stepwarden store the caller may read the
        identity of, in one statement that fails on no database (no table is named in it: a
        missing one would abort the caller's transaction); then the identity, compared with
        the app's. A role that may write the tables but not read ``store_identity`` is not
        checked: the submission itself never reads that table."""
        # ``readable`` is NULL when no relation store_identity with a column id is visible (no
        # store, or a table of someone else's by that name: naming the column would abort the
        # caller's transaction), else whether this role may read that column.
        rows = self._tx.sql(
            "SELECT set_config('stepwarden.block', ?, true) AS mark,"
            " (SELECT has_column_privilege(a.attrelid, a.attnum, 'SELECT') FROM pg_attribute a"
            "  WHERE a.attrelid = to_regclass('store_identity') AND a.attname = 'id'"
            "  AND NOT a.attisdropped) AS readable",
            (self._mark,),
        )
        if rows[0]["readable"] is None:
            raise InputError(
                "app.transaction(connection): the connection's database has no stepwarden store"
                " (no table store_identity with a column id); pass a connection to this app's"
                " database; nothing was written"
            )
        if not rows[0]["readable"]:
            return
        ours = self.app.store.identity_sync()
        found = self._tx.sql("SELECT id FROM store_identity")
        theirs = found[0]["id"] if found else None
        if theirs != ours:
            raise InputError(
                f"app.transaction(connection): the connection is to another stepwarden store"
                f" (store id {theirs}), not this app's ({ours}); nothing was written"
            )

    def _mark_sqlite(self) -> None:
        """The caller's own sqlite3 connection: a savepoint in its transaction, once one is open
        (a savepoint outside one would begin it, and its release commit it)."""
        if self._mark is None and not self._lent and self.app.store.dialect == "sqlite" and self._open_now():
            self.connection.execute(f"SAVEPOINT {SQLITE_MARK}")
            self._mark = SQLITE_MARK

    def _still_marked(self) -> bool:
        """The block's transaction is the one it began in; on SQLite its savepoint is released."""
        if self._mark is None:
            return True
        if self.app.store.dialect == "postgres":
            row = self._tx.sql("SELECT current_setting('stepwarden.block', true) AS mark")[0]
            return bool(row["mark"] == self._mark)
        try:
            self.connection.execute(f"RELEASE {SQLITE_MARK}")
        except sqlite3.OperationalError as e:
            if "no such savepoint" not in str(e):
                raise
            return False
        return True

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
        marked = self._still_marked()
        if self.app.store.dialect == "postgres":
            if not marked:
                raise self._restarted_error()
            return
        if self._submitted and not self._lent:
            self._check_sqlite_split()
        if not marked:  # ended before the block's first submission: its tasks are all in the new one
            raise self._split_error([], sorted(set(self._submitted)))

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


def _idle_limit(lead: Leadership) -> int | None:
    """Milliseconds a fenced block's session may sit idle in its transaction on PostgreSQL: what
    is left of the term's trust window (it ends ``margin`` before the lease expires, and no
    renewal can extend it while the block holds the lease row), else the whole window for a
    Leadership made by hand; None if neither is known. Within PostgreSQL's int range (a lease
    of 40 days asked for more, and the fence failed the caller's transaction)."""
    seconds = lead.trust_left()
    if seconds is None:
        seconds = lead.trust
    if seconds is None:
        return None
    return min(2_147_483_647, max(1, int(seconds * 1000)))
