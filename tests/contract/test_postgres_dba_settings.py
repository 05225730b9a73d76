"""Settings a DBA gives a PostgreSQL database or role (``ALTER DATABASE d SET ...``), which every
session of the store inherits: each either changes nothing the store relies on, or is said in one
line that names it (found by a review that tried each on a real server).

Harmless, and not tested here: TimeZone, DateStyle and IntervalStyle (every time is an epoch
double, no date is formatted or parsed as text), lock_timeout and
idle_in_transaction_session_timeout (the store sets its own), synchronous_commit,
client_min_messages, application_name.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest

from stepwarden import App
from stepwarden.errors import MigrationError, StoreError
from stepwarden.store import StoreMissing, open_existing, open_store
from stepwarden.store import transitions as t
from stepwarden.workflow import Step, Workflow, encode_input

WF = Workflow.of("wf", [Step("s", "svc.do_s", complete_by=10.0)])


def _admin(url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql)
        return list(cur.fetchall()) if cur.description else []


def _db(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


@pytest.fixture
def dba(pg_url: str) -> Iterator[Callable[[str], None]]:
    """``dba("default_transaction_isolation = 'serializable'")``: set for the test's database, as
    a DBA would; new sessions get it."""

    def set_(setting: str) -> None:
        _admin(pg_url, f'ALTER DATABASE "{_db(pg_url)}" SET {setting}')

    yield set_


def _submit(store: Any) -> int:
    opts: dict[str, Any] = {"correlation_id": None, "idempotency_key": None, "priority": 0, "reply_to": None}
    return int(store.transact_sync(t.submit, WF, encode_input({"n": 1}), **opts)[0])


@pytest.mark.parametrize("query", ["", "?pooler=transaction"])
@pytest.mark.parametrize("level", ["serializable", "repeatable read"])
def test_the_stores_transactions_run_read_committed_whatever_the_databases_default(
    pg_url: str, dba: Callable[[str], None], level: str, query: str
) -> None:
    """Every transition is a conditional write relying on READ COMMITTED: an UPDATE that waited for
    another transaction's row re-checks its condition on the committed row. Under the DBA's
    serializable or repeatable read it failed instead ("could not serialize access due to
    concurrent update"): two workers logged 145 warnings in 30 s and a submission was refused.
    Here: a transaction that waits for another's row lock goes through once that one commits,
    directly and behind a transaction-mode pooler's settings."""
    dba(f"default_transaction_isolation = '{level}'")
    with psycopg.connect(pg_url) as probe:  # a new session does get the DBA's default
        row = probe.execute("SHOW transaction_isolation").fetchone()
        assert row is not None and row[0] == level
    store = open_store(pg_url + query)
    try:
        shown = store.transact_sync(lambda tx: tx.sql("SHOW transaction_isolation"))
        assert shown[0]["transaction_isolation"] == "read committed"
        task = _submit(store)
        holding, release = threading.Event(), threading.Event()

        def first(tx: Any) -> None:
            tx.sql("UPDATE tasks SET priority = priority + 1 WHERE id = ?", (task,))
            holding.set()
            assert release.wait(10)

        a = threading.Thread(target=store.transact_sync, args=(first,))
        a.start()
        try:
            assert holding.wait(10)
            got: list[Any] = []

            def second() -> None:
                try:
                    got.append(
                        store.transact_sync(
                            lambda tx: tx.sql(
                                "UPDATE tasks SET priority = priority + 1 WHERE id = ? RETURNING priority",
                                (task,),
                            )
                        )
                    )
                except Exception as e:
                    got.append(e)

            b = threading.Thread(target=second)
            b.start()
            deadline = time.monotonic() + 10
            while not _admin(
                pg_url,
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                f" AND datname = '{_db(pg_url)}'",
            ):
                assert time.monotonic() < deadline, "the second transaction never waited for the row"
                time.sleep(0.01)
        finally:
            release.set()
            a.join(10)
        b.join(10)
        assert got and not isinstance(got[0], Exception), got
        assert got[0][0]["priority"] == 2  # both increments, the second on the first's row
    finally:
        store.close()


def test_a_read_only_database_is_said_in_words_and_nothing_is_written(
    pg_url: str, dba: Callable[[str], None]
) -> None:
    """default_transaction_read_only (a maintenance window, or a hot standby): a submission raised
    psycopg's own ReadOnlySqlTransaction ("cannot execute SELECT in a read-only transaction"), not
    StoreError, naming neither. A worker waits it out as an outage, now with the same words."""
    dba("default_transaction_read_only = on")
    app = App(pg_url)
    app.workflows[WF.name] = WF
    try:
        with pytest.raises(StoreError, match=r"accepts no writes.*default_transaction_read_only") as met:
            app.submit("wf", {"n": 1})
        assert isinstance(met.value.__cause__, psycopg.errors.ReadOnlySqlTransaction)
        assert "nothing was written" in str(met.value)
        assert app.store.transact_sync(lambda tx: tx.sql("SELECT count(*) AS n FROM tasks"))[0]["n"] == 0
    finally:
        app.close()


def test_a_read_only_database_at_init_is_said_in_words(make_pg_db: Callable[..., str]) -> None:
    url = make_pg_db(empty=True)
    _admin(url, f'ALTER DATABASE "{_db(url)}" SET default_transaction_read_only = on')
    with pytest.raises(MigrationError, match=r"accepts no writes.*nothing was written"):
        open_store(url)


def _tables_in(url: str, schema: str) -> int:
    return int(_admin(url, f"SELECT count(*) FROM pg_tables WHERE schemaname = '{schema}'")[0][0])


def test_a_search_path_moved_off_the_store_is_refused_not_given_a_second_empty_store(
    pg_url: str, dba: Callable[[str], None]
) -> None:
    """The store is in public; a DBA's search_path now points at another schema. The next worker
    created an empty store there and ran on it, the tasks in public left pending, and read
    commands said "run init". A worker or an application now refuses, naming both schemas, and
    creates nothing; read commands say the same; ``init`` creates a second store on purpose."""
    store = open_store(pg_url)
    task = _submit(store)
    store.close()
    _admin(pg_url, "CREATE SCHEMA other")
    dba("search_path = other")
    with pytest.raises(MigrationError, match=r"search_path \(other\) reaches no stepwarden store.*public"):
        open_store(pg_url)  # as a worker opens it
    assert _tables_in(pg_url, "other") == 0, "nothing created where the search_path points"
    with pytest.raises(StoreMissing, match=r"schema public of this database holds one.*search_path"):
        open_existing(pg_url)  # as `stepwarden tasks` opens it
    # The task is where it was, and the URL's own search_path reaches it.
    reached = open_existing(pg_url + "?options=-csearch_path%3Dpublic")
    try:
        assert reached.transact_sync(lambda tx: tx.sql("SELECT id FROM tasks"))[0]["id"] == task
    finally:
        reached.close()
    open_store(pg_url, beside=True).close()  # `stepwarden init`: a second store, on purpose
    assert _tables_in(pg_url, "other") > 5
    open_store(pg_url).close()  # which workers now open as it is


def test_a_search_path_naming_no_schema_is_said_as_such(make_pg_db: Callable[..., str]) -> None:
    url = make_pg_db(empty=True)
    _admin(url, f'ALTER DATABASE "{_db(url)}" SET search_path = nosuch')
    with pytest.raises(MigrationError, match=r"search_path \(nosuch\) names no schema that exists"):
        open_store(url)


def test_a_migration_is_not_cut_short_by_the_databases_statement_timeout(
    make_pg_db: Callable[..., str],
) -> None:
    """A DBA's statement_timeout is for the applications' queries. A migration under one was
    cancelled, retried four times as "connection lost", and failed."""
    url = make_pg_db(empty=True)
    _admin(url, f"ALTER DATABASE \"{_db(url)}\" SET statement_timeout = '1ms'")
    store = open_store(url, migrate=False)
    try:
        assert store.migrate() > 0
        assert (
            store.transact_sync(lambda tx: tx.sql("SELECT count(*) AS n FROM schema_migrations"))[0]["n"] > 0
        )
    finally:
        store.close()


def test_a_worker_on_a_read_only_database_waits_saying_why(
    pg_url: str, dba: Callable[[str], None], noop_app: Callable[..., App], caplog: pytest.LogCaptureFixture
) -> None:
    """A maintenance window ends and a standby may be promoted: the worker waits, as for an outage,
    and its warning names both causes (the driver's text said "read-only transaction" only)."""
    import asyncio
    import logging

    caplog.set_level(logging.WARNING, logger="stepwarden")
    dba("default_transaction_read_only = on")
    app = noop_app(pg_url)

    async def body() -> bool:
        stop = asyncio.Event()
        run = asyncio.create_task(app.worker(name="ro").run(stop))
        deadline = time.monotonic() + 20
        while "accepts no writes" not in caplog.text:
            assert not run.done(), "the worker ended instead of waiting"
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.05)
        stop.set()
        return await asyncio.wait_for(run, 20)

    try:
        assert asyncio.run(body()) is False  # stopped before it could start: it took no work
    finally:
        app.close()
    assert "default_transaction_read_only" in caplog.text


def test_a_role_whose_right_to_write_is_revoked_while_the_store_runs_is_no_outage(pg_url: str) -> None:
    """A write refused for want of rights (42501) heals with no wait: it is StoreMisconfigured,
    which a worker's roles end it with (Outage.failed), at start as after a grant was revoked
    mid-run (before, only a worker's start said so; later it warned every round for ever)."""
    import uuid

    from stepwarden.errors import StoreMisconfigured

    role = f"sw_rw_{uuid.uuid4().hex[:8]}"
    _admin(pg_url, f"CREATE ROLE {role} LOGIN")
    _admin(pg_url, f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
    _admin(pg_url, f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}")
    parts = urlsplit(pg_url)
    store = open_store(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}").geturl())
    try:
        _submit(store)  # it writes
        _admin(pg_url, f"REVOKE INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public FROM {role}")
        with pytest.raises(StoreMisconfigured, match=r"may not write \(permission denied.*least privilege"):
            _submit(store)
        assert store.transact_sync(lambda tx: tx.sql("SELECT count(*) AS n FROM tasks"))[0]["n"] == 1
    finally:
        store.close()
        _admin(pg_url, f"DROP OWNED BY {role}")
        _admin(pg_url, f"DROP ROLE {role}")
