"""``app.transaction()`` at its edges, on both stores: a block that ends its transaction itself
(COMMIT or ROLLBACK), a caller's connection in autocommit mode, a block inside a block, a
PostgreSQL transaction aborted by a statement the block caught. Each time the user gets one clear
error (or their own exception) and the database holds nothing of the block but what a COMMIT of
theirs committed, and that whole."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from test_transactions import make_app, ph  # the same one-step order app

from stepwarden import App, InputError, StoreError
from stepwarden.store import open_store
from stepwarden.store.base import read_only

TABLES = ("tasks", "steps", "events", "messages", "orders")
NOTHING = dict.fromkeys(TABLES, 0)
ROLLED_BACK = r"the transaction was ended inside the block \(COMMIT or ROLLBACK\); nothing was submitted$"
# A task committed whole: its row, its one step, its received event and reply-queue message.
ONE_WHOLE_TASK = {"tasks": 1, "steps": 1, "events": 1, "messages": 1}


def app_with_orders(url: str) -> Iterator[App]:
    """The one-step order app on ``url``, with the business table ``orders``."""
    a = make_app(url)
    with a.transaction() as tx:
        tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
    yield a
    a.close()


@pytest.fixture
def app(store_url: str) -> Iterator[App]:
    yield from app_with_orders(store_url)


def counts(app: App) -> dict[str, int]:
    """The rows of each table, read by the store on its own connection (committed rows only; a
    read-only transaction, which on SQLite does not wait for a caller's open write)."""

    @read_only
    def read(tx: Any) -> dict[str, int]:
        return {t: int(tx.sql(f"SELECT COUNT(*) AS n FROM {t}")[0]["n"]) for t in TABLES}

    return app.store.transact_sync(read)


def insert_order(tx: Any, order: str) -> None:
    tx.execute(f"INSERT INTO orders (id) VALUES ({ph(tx.app)})", (order,))


def own_connection(store_url: str, *, autocommit: bool) -> Any:
    """The caller's own connection: in autocommit mode, or one whose driver begins a transaction
    before the first write (sqlite3) or statement (psycopg)."""
    if store_url.startswith("sqlite:///"):
        return sqlite3.connect(
            store_url[len("sqlite:///") :], isolation_level=None if autocommit else "DEFERRED"
        )
    return psycopg.connect(store_url, autocommit=autocommit)


def end_on_the_connection(conn: Any, how: str) -> None:
    """COMMIT or ROLLBACK sent on the connection itself, past ``tx.execute``."""
    if isinstance(conn, sqlite3.Connection):
        conn.execute(how)
    else:
        conn.commit() if how == "COMMIT" else conn.rollback()


# -- the block ends its transaction itself ------------------------------------------------------


def test_a_rollback_inside_the_block_is_an_error_and_writes_nothing(app: App) -> None:
    """The caller's ROLLBACK ended the transaction: nothing of ours is written after it (SQLite
    wrote the task's received event and message then, each committing on its own; PostgreSQL went
    on in a new transaction and returned the id of a task that did not exist)."""
    with pytest.raises(StoreError, match=ROLLED_BACK), app.transaction() as tx:
        insert_order(tx, "o-1")
        tx.submit("order", {"order": "o-1"}, correlation_id="o-1", reply_to="web")
        tx.execute("ROLLBACK")
        insert_order(tx, "o-2")  # would commit on its own: the block stops at the ROLLBACK
    assert counts(app) == NOTHING
    with app.transaction() as tx:  # the next block is whole again
        insert_order(tx, "o-3")
        tx.submit("order", {"order": "o-3"}, reply_to="web")
    assert counts(app) == {**ONE_WHOLE_TASK, "orders": 1}


@pytest.mark.parametrize("then", ["ends", "submits again"])
def test_a_rollback_on_the_connection_itself_fails_the_block_and_writes_nothing(app: App, then: str) -> None:
    """Past ``tx.execute`` (``tx.connection``) the end is found at the next submission or when
    the block ends, before anything of ours is written."""
    with pytest.raises(StoreError, match=ROLLED_BACK), app.transaction() as tx:
        insert_order(tx, "o-1")
        tx.submit("order", {"order": "o-1"}, reply_to="web")
        end_on_the_connection(tx.connection, "ROLLBACK")
        if then == "submits again":
            tx.submit("order", {"order": "o-2"}, reply_to="web")  # would commit on its own
    assert counts(app) == NOTHING


def test_a_commit_inside_the_block_stops_it_there_having_committed_whole_tasks(app: App) -> None:
    """What a COMMIT of the caller's committed cannot be taken back: the error says so and names
    the task, which is whole (its step, its received event and message), and nothing after the
    COMMIT runs."""
    with pytest.raises(StoreError, match=r"ended inside the block") as raised, app.transaction() as tx:
        insert_order(tx, "o-1")
        task_id = tx.submit("order", {"order": "o-1"}, reply_to="web")
        tx.execute("COMMIT")
        insert_order(tx, "o-2")
    assert f"committed what the block had written before it, task {task_id} included" in str(raised.value)
    assert counts(app) == {**ONE_WHOLE_TASK, "orders": 1}
    assert app.task(task_id)["state"] == "pending"


def test_the_callers_exception_after_a_commit_inside_the_block_is_the_one_raised(app: App) -> None:
    """The block raised after its own COMMIT: the caller's exception propagates (SQLite raised
    "cannot rollback - no transaction is active" instead), with a note on what the COMMIT did;
    the task it committed is whole (SQLite had kept its received event and message for the end
    of the block, and lost them)."""
    with pytest.raises(RuntimeError, match="the caller's own failure") as raised, app.transaction() as tx:
        task_id = tx.submit("order", {"order": "o-1"}, reply_to="web")
        end_on_the_connection(tx.connection, "COMMIT")
        raise RuntimeError("the caller's own failure")
    notes = getattr(raised.value, "__notes__", [])
    assert any("ended inside the block" in n and f"task {task_id} included" in n for n in notes), notes
    assert counts(app) == {**ONE_WHOLE_TASK, "orders": 0}


# -- the caller's own connection ----------------------------------------------------------------


def test_a_connection_in_autocommit_mode_is_refused_before_anything_is_written(
    app: App, store_url: str
) -> None:
    conn = own_connection(store_url, autocommit=True)
    try:
        with pytest.raises(InputError, match="autocommit mode"), app.transaction(conn) as tx:
            tx.submit("order", {"order": "o-1"}, reply_to="web")
            raise RuntimeError("the block failed after submitting")
        assert counts(app) == NOTHING, "the task stayed, written statement by statement"
        # In a transaction it opened itself, the same connection is welcome.
        conn.execute("BEGIN")
        with app.transaction(conn) as tx:
            tx.submit("order", {"order": "o-2"}, reply_to="web")
        conn.execute("ROLLBACK")
        assert counts(app) == NOTHING
    finally:
        conn.close()
    # One whose driver begins the transaction (at the first write, or the first statement) is
    # welcome too, and the caller commits or rolls back as usual.
    conn = own_connection(store_url, autocommit=False)
    try:
        for end in (conn.rollback, conn.commit):
            with app.transaction(conn) as tx:
                tx.submit("order", {"order": "o-3"}, reply_to="web")
            end()
        assert counts(app) == {**ONE_WHOLE_TASK, "orders": 0}
    finally:
        conn.close()


# -- a connection to another database, a handle used after its block ---------------------------


def _tasks_in(conn: Any) -> int:
    """The tasks a database holds, read on a connection to it (committed and its own)."""
    return int(conn.execute("SELECT COUNT(*) FROM tasks").fetchone()[0])


def test_a_connection_to_another_database_is_refused_before_anything_is_written(
    app: App, store_url: str, tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    """A task written through a connection to another store would be seen by that store's
    workers (which may not run its workflow), never by this app; one to a database with no
    schema failed deep inside the library. Both are refused with one InputError, writing nothing
    in either database."""
    other: Any
    plain: Any
    cases: list[tuple[Any, str]]
    if store_url.startswith("sqlite:///"):
        other_path = tmp_path / "other.db"
        open_store(f"sqlite:///{other_path}").close()  # another store: migrated, its own identity
        other = sqlite3.connect(other_path)
        plain = sqlite3.connect(tmp_path / "plain.db")  # no schema at all
        cases = [(other, "not to this app's store"), (plain, "not to this app's store")]
        cases.append((sqlite3.connect(":memory:"), "to a database in memory"))
    else:
        make = request.getfixturevalue("make_pg_db")
        other_url = make()  # a copy of the same template: given an identity of its own, as a copy must be
        with psycopg.connect(other_url, autocommit=True) as admin:
            admin.execute("UPDATE store_identity SET id = 'another-store'")
        other = psycopg.connect(other_url)
        plain = psycopg.connect(make(empty=True))
        foreign_url = make(empty=True)  # a table of someone else's by the name: no column id
        with psycopg.connect(foreign_url, autocommit=True) as admin:
            admin.execute("CREATE TABLE store_identity (name text)")
        cases = [
            (other, "another stepwarden store"),
            (plain, "has no stepwarden store"),
            (psycopg.connect(foreign_url), "has no stepwarden store"),
        ]
    try:
        for conn, why in cases:
            with pytest.raises(InputError, match=why), app.transaction(conn) as tx:
                tx.submit("order", {"order": "o-1"})
            assert conn.execute("SELECT 1").fetchone()[0] == 1, "the caller's transaction was aborted"
            conn.rollback()
        assert _tasks_in(other) == 0, "the task was written in the other store"
        assert counts(app) == NOTHING
        # The app's own database, through a connection of the caller's, is welcome; on SQLite
        # whatever its text_factory makes of PRAGMA database_list's file name.
        factories: list[Any] = [str]
        if store_url.startswith("sqlite:///"):
            factories += [bytes, bytearray, lambda b: b.decode().upper()]
        for n, factory in enumerate(factories):
            mine = own_connection(store_url, autocommit=False)
            if isinstance(mine, sqlite3.Connection):
                mine.text_factory = factory
            try:
                with app.transaction(mine) as tx:
                    tx.submit("order", {"order": f"o-{n + 2}"})
                mine.commit()
            finally:
                mine.close()
        assert counts(app)["tasks"] == len(factories)
    finally:
        for conn, _ in cases:
            conn.close()


def test_postgres_a_role_that_cannot_read_the_store_identity_still_submits_in_its_transaction(
    pg_app: App, pg_url: str
) -> None:
    """The check of the caller's connection reads ``store_identity``; a role with the rights a
    submission needs, and not that one, was refused with a raw InsufficientPrivilege and its
    transaction aborted. It is not checked, and its tasks are written as before."""
    import uuid

    role = f"sw_dml_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        admin.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}")
        admin.execute(f"REVOKE SELECT ON store_identity FROM {role}")
    try:
        parts = pg_url.split("://", 1)[1].split("@", 1)[1]
        conn = psycopg.connect(f"postgresql://{role}@{parts}")
        try:
            with pg_app.transaction(conn) as tx:
                tx.submit("order", {"order": "o-1"})
            conn.commit()
        finally:
            conn.close()
        assert counts(pg_app)["tasks"] == 1
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE {role}")


def test_a_connection_of_another_driver_is_an_input_error(app: App, store_url: str) -> None:
    wrong: Any = object() if store_url.startswith("sqlite:///") else sqlite3.connect(":memory:")
    with pytest.raises(InputError, match=r"needs a (sqlite3|psycopg)"), app.transaction(wrong):
        pass
    assert counts(app) == NOTHING


@pytest.mark.parametrize("lent", [True, False], ids=["lent", "own"])
def test_the_handle_of_an_ended_block_refuses_to_be_used(app: App, store_url: str, lent: bool) -> None:
    """A handle kept past its block wrote into whichever block was lent the same connection
    next (another request's, in a web server): committed or rolled back with it. Now every use
    of it is an InputError, inside a later block too, and that block is left as it was."""
    conn = None if lent else own_connection(store_url, autocommit=False)
    try:
        with app.transaction(conn) as old:
            old.submit("order", {"order": "o-1"})
        if conn is not None:
            conn.commit()
        for use in (
            lambda: old.submit("order", {"order": "late"}),
            lambda: old.execute("SELECT 1"),
        ):
            with pytest.raises(InputError, match=r"block has ended"):
                use()
            with app.transaction(conn) as tx:  # the next block, perhaps on the same connection
                tx.submit("order", {"order": "o-2"})
                with pytest.raises(InputError, match=r"block has ended"):
                    use()
            if conn is not None:
                conn.commit()
        assert counts(app)["tasks"] == 3, "a late use of the old handle wrote a task"
    finally:
        if conn is not None:
            conn.close()


# -- a block inside a block ---------------------------------------------------------------------


def test_sqlite_a_block_inside_a_block_fails_at_once(tmp_path: Any) -> None:
    """The inner block would wait for the write lock its own thread holds, until busy_timeout
    (30 s), then fail with "database is locked"; the outer block is rolled back with it. So does
    a block of another App on the same file. (On PostgreSQL an inner block is a transaction of
    its own: test_lent_connections.)"""
    path = tmp_path / "store.db"
    app, other = make_app(f"sqlite:///{path}"), make_app(f"sqlite:///{path}")
    try:
        with app.transaction() as tx:
            tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        for inner in (app, other):
            inner.store.busy_timeout = 3.0  # type: ignore[attr-defined]  # the old wait, shorter
            started = time.monotonic()
            with (
                pytest.raises(InputError, match=r"inside another app\.transaction\(\) block"),
                app.transaction() as tx,
            ):
                insert_order(tx, "o-1")
                tx.submit("order", {"order": "o-1"}, reply_to="web")
                with inner.transaction() as nested:
                    nested.submit("order", {"order": "o-2"})
            assert time.monotonic() - started < 1.0, "waited for the lock"
            assert counts(app) == NOTHING
        with app.transaction() as tx:  # one after the other, as ever
            tx.submit("order", {"order": "o-3"}, reply_to="web")
        with other.transaction() as tx:
            tx.submit("order", {"order": "o-4"}, reply_to="web")
        assert counts(app)["tasks"] == 2
    finally:
        app.close()
        other.close()


def test_sqlite_app_submit_inside_a_block_fails_at_once_and_reads_do_not_wait(tmp_path: Any) -> None:
    """app.submit (its own transaction) inside a block would wait for the block's write lock;
    app.task and app.wait only read, so they answer from the last committed state."""
    path = tmp_path / "store.db"
    app = make_app(f"sqlite:///{path}")
    try:
        with app.transaction() as tx:
            tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        first = app.submit("order", {"order": "o-0"})
        app.store.busy_timeout = 3.0  # type: ignore[attr-defined]  # the old wait, shorter
        started = time.monotonic()
        with pytest.raises(InputError, match=r"use the block's tx\.submit"), app.transaction() as tx:
            tx.submit("order", {"order": "o-1"})
            assert app.task(first)["state"] == "pending"
            with pytest.raises(TimeoutError):
                app.wait(first, timeout=0.1)
            with pytest.raises(TimeoutError):  # it only reads too
                app.wait_for_result(first, timeout=0.1)
            app.submit("order", {"order": "o-2"})
        assert time.monotonic() - started < 1.0, "waited for the lock"
        assert counts(app)["tasks"] == 1, "the block and the inner submission were both rolled back"
    finally:
        app.close()


def test_sqlite_submit_async_inside_a_block_fails_at_once_and_another_task_waits_for_the_block(
    tmp_path: Any,
) -> None:
    """In an async handler, ``await app.submit_async`` inside the handler's block went to the
    store's thread and waited busy_timeout (30 s) for the lock its own block holds, then blamed
    "another writer". It is refused at once; another task of the same loop that submits while
    the block awaits (a worker's role, another request) still waits for the block and succeeds."""
    path = tmp_path / "store.db"
    app = make_app(f"sqlite:///{path}")

    async def handler() -> None:
        with app.transaction() as tx:
            tx.submit("order", {"order": "o-1"})
            await app.submit_async("order", {"order": "o-2"})

    async def beside() -> tuple[int, float]:
        block_open = asyncio.Event()
        release = asyncio.Event()

        async def in_block() -> None:
            with app.transaction() as tx:
                tx.submit("order", {"order": "o-3"})
                block_open.set()
                await release.wait()

        holder = asyncio.create_task(in_block())
        await block_open.wait()
        other = asyncio.create_task(app.submit_async("order", {"order": "o-4"}))
        await asyncio.sleep(0.3)
        assert not other.done(), "the other task's submission did not wait for the block"
        release.set()
        await holder
        started = time.monotonic()
        task_id = await asyncio.wait_for(other, 10)
        return task_id, time.monotonic() - started

    try:
        app.store.busy_timeout = 3.0  # type: ignore[attr-defined]  # the old wait, shorter
        started = time.monotonic()
        with pytest.raises(InputError, match=r"in the same task, would wait for the block's own write lock"):
            asyncio.run(handler())
        assert time.monotonic() - started < 1.0, "waited for the lock"
        assert counts_tasks(app) == 0, "the block was not rolled back"

        async def through_gather() -> None:  # another task: it cannot be told from an unrelated one
            with app.transaction() as tx:
                tx.submit("order", {"order": "o-5"})
                await asyncio.gather(app.submit_async("order", {"order": "o-6"}))

        app.store.busy_timeout = 1.0  # type: ignore[attr-defined]
        with pytest.raises(
            StoreError, match=r"block open on this store in this thread \(the event loop's\) held"
        ):
            asyncio.run(through_gather())
        assert counts_tasks(app) == 0
        app.store.busy_timeout = 3.0  # type: ignore[attr-defined]
        task_id, _ = asyncio.run(beside())
        assert counts_tasks(app) == 2 and task_id > 0
    finally:
        app.close()


def counts_tasks(app: App) -> int:
    @read_only
    def read(tx: Any) -> int:
        return int(tx.sql("SELECT COUNT(*) AS n FROM tasks")[0]["n"])

    return app.store.transact_sync(read)


def test_sqlite_a_block_that_cannot_take_the_write_lock_is_a_store_error_naming_the_store(
    tmp_path: Any,
) -> None:
    """Another connection holds the write lock past the URL's ``busy_timeout``: the block does not
    begin, and the caller gets the StoreError a submission gets (naming the store and the wait),
    not sqlite3's bare "database is locked". Once the lock is free, the next block works."""
    path = tmp_path / "store.db"
    app = make_app(f"sqlite:///{path}?busy_timeout=0.3")
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        with app.transaction() as tx:
            tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        holder.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        locked = r"stayed locked by another writer for 0\.\d s \(busy timeout 0\.3 s\)"
        with pytest.raises(StoreError, match=locked), app.transaction():
            raise AssertionError("the block ran without the write lock")
        assert time.monotonic() - started < 2.0
        with pytest.raises(StoreError, match="stayed locked") as raised:
            app.submit("order", {"order": "o-1"})
        assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
        holder.execute("ROLLBACK")
        with app.transaction() as tx:
            insert_order(tx, "o-2")
            tx.submit("order", {"order": "o-2"}, reply_to="web")
        assert counts(app) == {**ONE_WHOLE_TASK, "orders": 1}
    finally:
        holder.close()
        app.close()


# -- PostgreSQL: a transaction aborted by a failed statement ------------------------------------


def test_postgres_a_failed_statement_the_block_caught_fails_the_block(pg_url: str) -> None:
    """PostgreSQL aborts the transaction at a failed statement; its COMMIT then rolls back without
    an error, and the block returned the id of a task that never existed."""
    app = make_app(pg_url)
    try:
        with app.transaction() as tx:
            tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        with pytest.raises(StoreError, match="aborted the transaction"), app.transaction() as tx:
            insert_order(tx, "o-1")
            tx.submit("order", {"order": "o-1"}, reply_to="web")
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                tx.execute("SELECT 1 / 0")
        assert counts(app) == NOTHING
        conn = psycopg.connect(pg_url)
        try:
            with pytest.raises(StoreError, match="aborted the transaction"), app.transaction(conn) as tx:
                tx.submit("order", {"order": "o-2"})
                with contextlib.suppress(psycopg.errors.DivisionByZero):
                    tx.execute("SELECT 1 / 0")
        finally:
            conn.close()
        assert counts(app) == NOTHING
        with app.transaction() as tx:  # a statement that may fail, under a savepoint: as usual
            insert_order(tx, "o-3")
            task_id = tx.submit("order", {"order": "o-3"}, reply_to="web")
            tx.execute("SAVEPOINT maybe")
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                tx.execute("SELECT 1 / 0")
            tx.execute("ROLLBACK TO SAVEPOINT maybe")
        assert counts(app) == {**ONE_WHOLE_TASK, "orders": 1}
        assert app.task(task_id)["state"] == "pending"
    finally:
        app.close()


# -- PostgreSQL: a transaction ended on the connection, then another begun by more SQL ----------


@pytest.fixture
def pg_app(pg_url: str) -> Iterator[App]:
    yield from app_with_orders(pg_url)


def test_postgres_a_commit_on_the_connection_then_more_sql_fails_the_block_and_names_what_it_split(
    pg_app: App,
) -> None:
    """psycopg begins a new transaction with the first statement after a COMMIT, so the block
    looked open again and the lent connection committed the rest as a second transaction: the
    order o-2 and task B without task A's atomicity (SUB2). Now the block's end finds another
    transaction id: the error names task A as committed apart, and the new transaction, with
    task B and order o-2, is rolled back."""
    with pytest.raises(StoreError) as raised, pg_app.transaction() as tx:
        insert_order(tx, "o-1")
        first = tx.submit("order", {"order": "o-1"}, reply_to="web")
        tx.connection.commit()
        tx.connection.execute("INSERT INTO orders (id) VALUES ('o-2')")  # begins a new transaction
        second = tx.submit("order", {"order": "o-2"}, reply_to="web")
    message = str(raised.value)
    assert "ended inside the block" in message and "began a new one" in message, message
    assert f"committed task {first} apart from the rest of the block" in message, message
    assert f"task {second}, written in the new transaction, rolled back with it" in message, message
    assert counts(pg_app) == {**ONE_WHOLE_TASK, "orders": 1}
    assert pg_app.task(first)["state"] == "pending"
    with pg_app.transaction() as tx:  # the next block is whole again
        insert_order(tx, "o-3")
        tx.submit("order", {"order": "o-3"}, reply_to="web")
    assert counts(pg_app) == {"tasks": 2, "steps": 2, "events": 2, "messages": 2, "orders": 2}


def test_postgres_more_sql_after_a_commit_on_the_callers_connection_fails_the_block(
    pg_app: App, pg_url: str
) -> None:
    """On the caller's own connection the new transaction is theirs: the error says the tasks in
    it are left for them to roll back, and names the one the COMMIT committed apart."""
    conn = psycopg.connect(pg_url)
    try:
        with pytest.raises(StoreError) as raised, pg_app.transaction(conn) as tx:
            first = tx.submit("order", {"order": "o-1"}, reply_to="web")
            conn.commit()
            conn.execute("SELECT 1")  # a read begins the new transaction too: no id assigned yet
            second = tx.submit("order", {"order": "o-2"}, reply_to="web")
        message = str(raised.value)
        assert f"committed task {first} apart" in message, message
        assert f"task {second}, written in the new transaction, left in it for you to roll back" in message
        conn.rollback()
    finally:
        conn.close()
    assert counts(pg_app) == {**ONE_WHOLE_TASK, "orders": 0}


def test_a_commit_on_the_callers_own_connection_then_a_write_fails_the_block_on_both_stores(
    app: App, store_url: str
) -> None:
    """sqlite3 in its default mode, like psycopg, begins a new transaction with the next write
    after a COMMIT, so the block looked open at its end. SQLite has no transaction id to compare;
    the block's end reads its tasks on another connection, which sees committed rows only: task A
    is found committed apart, task B left in the caller's new transaction with order o-2."""
    conn = own_connection(store_url, autocommit=False)
    try:
        with pytest.raises(StoreError) as raised, app.transaction(conn) as tx:
            insert_order(tx, "o-1")
            first = tx.submit("order", {"order": "o-1"}, reply_to="web")
            conn.commit()
            conn.execute("INSERT INTO orders (id) VALUES ('o-2')")  # past tx: begins a new transaction
            second = tx.submit("order", {"order": "o-2"}, reply_to="web")
        message = str(raised.value)
        assert "ended inside the block" in message and "began a new one" in message, message
        assert f"committed task {first} apart from the rest of the block" in message, message
        assert f"task {second}, written in the new transaction, left in it for you to roll back" in message
        assert counts(app) == {**ONE_WHOLE_TASK, "orders": 1}, "the new transaction is the caller's"
        conn.rollback()
        # The same connection, used as it should be, raises nothing (the check reads no
        # committed task of a block that has not committed yet).
        with app.transaction(conn) as tx:
            insert_order(tx, "o-3")
            tx.submit("order", {"order": "o-3"}, reply_to="web")
        conn.commit()
    finally:
        conn.close()
    assert counts(app) == {"tasks": 2, "steps": 2, "events": 2, "messages": 2, "orders": 2}


def test_a_rollback_on_the_callers_own_connection_then_a_write_fails_the_block_on_both_stores(
    app: App, store_url: str
) -> None:
    """A ROLLBACK then more SQL splits nothing, but the block's task is gone with its order: the
    end says the first transaction committed none of the block's tasks."""
    conn = own_connection(store_url, autocommit=False)
    try:
        with (
            pytest.raises(StoreError, match="committed none of the block's tasks"),
            app.transaction(conn) as tx,
        ):
            insert_order(tx, "o-1")
            tx.submit("order", {"order": "o-1"}, reply_to="web")
            conn.rollback()
            conn.execute("INSERT INTO orders (id) VALUES ('o-2')")
        conn.rollback()
    finally:
        conn.close()
    assert counts(app) == NOTHING


@pytest.mark.parametrize("how", ["COMMIT", "ROLLBACK"])
def test_an_end_on_the_callers_own_connection_before_the_first_submission_fails_the_block(
    app: App, store_url: str, how: str
) -> None:
    """The block's first statement, then a COMMIT or ROLLBACK on the connection (a helper, an
    ORM), then more SQL, then the submission: the block was marked by the transaction its first
    submission wrote in, so this went unnoticed, the order committed apart from its task (or
    rolled back under it). The block is now marked when it begins."""
    conn = own_connection(store_url, autocommit=False)
    try:
        with pytest.raises(StoreError) as raised, app.transaction(conn) as tx:
            insert_order(tx, "o-1")
            end_on_the_connection(conn, how)
            conn.execute("INSERT INTO orders (id) VALUES ('audit')")  # past tx: begins a new one
            task_id = tx.submit("order", {"order": "o-1"}, reply_to="web")
        message = str(raised.value)
        assert "ended inside the block" in message and "began a new one" in message, message
        assert "the first committed none of the block's tasks" in message, message
        assert f"task {task_id}, written in the new transaction, left in it for you to roll back" in message
        conn.rollback()
    finally:
        conn.close()
    assert counts(app) == {**NOTHING, "orders": 1 if how == "COMMIT" else 0}


@pytest.mark.parametrize("how", ["COMMIT", "ROLLBACK"])
def test_postgres_an_end_on_a_lent_connection_before_the_first_submission_fails_the_block(
    pg_app: App, how: str
) -> None:
    """The same on a lent connection: the new transaction, with the task, is rolled back."""
    with pytest.raises(StoreError, match="committed none of the block's tasks"), pg_app.transaction() as tx:
        insert_order(tx, "o-1")
        tx.connection.commit() if how == "COMMIT" else tx.connection.rollback()
        tx.connection.execute("SELECT 1")
        tx.submit("order", {"order": "o-1"}, reply_to="web")
    assert counts(pg_app) == {**NOTHING, "orders": 1 if how == "COMMIT" else 0}


def test_the_callers_transaction_begun_before_the_block_and_ended_in_it_fails_the_block(
    app: App, store_url: str
) -> None:
    """The caller's own row, written before the block, then a ROLLBACK inside it and more SQL:
    the task would have committed with no order. The block's mark is in the caller's transaction."""
    conn = own_connection(store_url, autocommit=False)
    try:
        conn.execute("INSERT INTO orders (id) VALUES ('o-1')")
        with pytest.raises(StoreError, match="began a new one"), app.transaction(conn) as tx:
            conn.rollback()
            conn.execute("INSERT INTO orders (id) VALUES ('audit')")
            tx.submit("order", {"order": "o-1"}, reply_to="web")
        conn.rollback()
    finally:
        conn.close()
    assert counts(app) == NOTHING


def test_postgres_a_rollback_on_the_connection_then_more_sql_fails_the_block(pg_app: App) -> None:
    """A ROLLBACK then more SQL: the first task is gone with its order, the block's rest would
    have committed alone; the error says the first transaction committed none of the tasks."""
    with pytest.raises(StoreError, match="committed none of the block's tasks"), pg_app.transaction() as tx:
        insert_order(tx, "o-1")
        tx.submit("order", {"order": "o-1"}, reply_to="web")
        tx.connection.rollback()
        tx.connection.execute("INSERT INTO orders (id) VALUES ('o-2')")
    assert counts(pg_app) == NOTHING


def test_postgres_savepoints_inside_the_block_are_one_transaction_not_a_new_one(pg_app: App) -> None:
    """A ROLLBACK TO SAVEPOINT undoes a submission inside the same transaction (its id does not
    change): the block commits the rest and raises nothing."""
    with pg_app.transaction() as tx:
        tx.execute("SAVEPOINT before_first")
        insert_order(tx, "o-1")
        tx.submit("order", {"order": "o-1"}, reply_to="web")
        tx.execute("ROLLBACK TO SAVEPOINT before_first")
        insert_order(tx, "o-2")
        kept = tx.submit("order", {"order": "o-2"}, reply_to="web")
    assert counts(pg_app) == {**ONE_WHOLE_TASK, "orders": 1}
    assert pg_app.task(kept)["state"] == "pending"
