"""Suite-wide fixtures and hooks.

In CI (STEPWARDEN_NO_SKIPS=1) a skipped test fails the run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwarden import App
from stepwarden.clock import FakeClock
from stepwarden.policies import Backoff, Retry
from stepwarden.store import Store
from stepwarden.store import transitions as t
from stepwarden.workflow import Step, Workflow, encode_input


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not os.environ.get("STEPWARDEN_NO_SKIPS"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if skipped:
        if reporter is not None:
            reporter.write_line(f"STEPWARDEN_NO_SKIPS: {skipped} test(s) skipped; failing the run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- PostgreSQL for the tests -------------------------------------------------------------------
# The server named by STEPWARDEN_TEST_POSTGRES (an admin URL, e.g. postgresql://postgres@host/postgres)
# when set, else one this test process starts itself (pgserver's binaries, or initdb/pg_ctl on
# PATH). A migrated template database is made once; each test gets a fresh copy of it, which takes
# milliseconds (CREATE DATABASE ... TEMPLATE).


def _admin_execute(admin_url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql)


def _with_db(admin_url: str, db: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(admin_url)
    return urlunsplit(parts._replace(path="/" + db))


@pytest.fixture(scope="session")
def pg_admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("STEPWARDEN_TEST_POSTGRES")
    if url:
        yield url
        return
    from stepwarden.testing.postgres import LocalPostgres

    # Not under pytest's basetemp: another pytest run on the machine may prune old basetemps
    # while this one still runs, and a server whose data directory vanishes dies.
    home = Path(tempfile.mkdtemp(prefix="stepwarden-test-pg-"))
    pg = LocalPostgres(home / "data").start()
    try:
        yield pg.url("postgres")
    finally:
        pg.stop("immediate")
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_template(pg_admin_url: str) -> str:
    from stepwarden.store import open_store

    name = f"sw_template_{uuid.uuid4().hex[:8]}"
    _admin_execute(pg_admin_url, f'CREATE DATABASE "{name}"')
    open_store(_with_db(pg_admin_url, name)).close()  # runs the migrations
    return name


@pytest.fixture(scope="session")
def make_pg_db(pg_admin_url: str, pg_template: str) -> Iterator[Callable[..., str]]:
    """A factory of fresh, migrated databases for fixtures wider than one test (``make(empty=True)``: a
    database without any table, never migrated); all dropped at the end of the session."""
    made: list[str] = []

    def make(*, empty: bool = False) -> str:
        name = f"sw_test_{uuid.uuid4().hex[:10]}"
        template = "template0" if empty else pg_template
        _admin_execute(pg_admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        made.append(name)
        return _with_db(pg_admin_url, name)

    yield make
    for name in made:
        _admin_execute(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_url(pg_admin_url: str, pg_template: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for one test."""
    name = f"sw_test_{uuid.uuid4().hex[:10]}"
    _admin_execute(pg_admin_url, f'CREATE DATABASE "{name}" TEMPLATE "{pg_template}"')
    try:
        yield _with_db(pg_admin_url, name)
    finally:
        _admin_execute(pg_admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The same test on both stores."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return str(request.getfixturevalue("pg_url"))


# -- small workflows on a fake clock ------------------------------------------------------------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_workflow(
    *names: str,
    name: str = "wf",
    agent: str = "svc",
    budget: float = 10.0,
    retry: Retry | None = None,
    compensate: bool = True,
    on_error: str = "error",
    steps: dict[str, dict[str, Any]] | None = None,
) -> Workflow:
    """A pipeline of steps ``names`` (default a, b, c) calling ``<agent>.do_<step>``, undone by
    ``<agent>.undo_<step>``. The default retry policy has no jitter: back-off is exactly 10 s, 20 s, ...
    ``steps={"b": {"on_error": "compensate"}}`` overrides the arguments of one step."""
    retry = retry or Retry(max_failures=3, backoff=Backoff(initial=10.0, maximum=1000.0, jitter=0.0))
    out = []
    for n in names or ("a", "b", "c"):
        kw: dict[str, Any] = {
            "complete_by": budget,
            "retry": retry,
            "compensate": f"{agent}.undo_{n}" if compensate else None,
            "on_error": on_error,
        }
        kw.update((steps or {}).get(n, {}))
        out.append(Step(n, f"{agent}.do_{n}", **kw))
    return Workflow.of(name, out)


@pytest.fixture(name="make_workflow")
def make_workflow_fixture() -> Callable[..., Workflow]:
    return make_workflow


def dispatch_requests(
    store: Store,
    n: int = 1,
    *,
    budget: float = 5.0,
    tries: int = 1,
    agent: str = "svc",
    backoff: Backoff | None = None,
) -> list[int]:
    """Submit ``n`` one-step tasks calling ``<agent>.do_s`` (input ``{"n": i}``) and dispatch
    them: ``n`` queued requests. Each attempt has ``tries`` tries, ``backoff`` apart (default
    10-20 ms, no jitter). Returns the task ids."""
    retry = Retry(tries=tries, in_attempt=backoff or Backoff(initial=0.01, maximum=0.02, jitter=0.0))
    wf = make_workflow("s", name=f"wf-{agent}", agent=agent, budget=budget, retry=retry, compensate=False)
    ids = [
        store.transact_sync(
            t.submit,
            wf,
            encode_input({"n": i}),
            correlation_id=None,
            idempotency_key=None,
            priority=0,
            reply_to=None,
        )[0]
        for i in range(n)
    ]
    assert store.transact_sync(t.claim_and_dispatch, "sched", 100) == n
    return ids


@pytest.fixture(name="dispatch_requests")
def dispatch_requests_fixture() -> Callable[..., list[int]]:
    return dispatch_requests


def noop_app(url: str | None = None) -> App:
    """An app on ``url`` (default: the app's own default) with agent ``ops``, operation ``noop``
    (returns None) and workflow ``one`` of one step ``a`` calling it. Its store is not opened:
    ``app.store`` opens (and migrates) it when a test first asks."""
    app = App(url)
    ops = app.agent("ops")

    @ops.operation
    async def noop(req: object) -> None:
        return None

    app.workflow("one", [Step("a", "ops.noop", complete_by=5)])
    return app


@pytest.fixture(name="noop_app")
def noop_app_fixture() -> Callable[..., App]:
    return noop_app


def rows(store: Store, sql: str) -> list[dict[str, Any]]:
    """The rows of ``sql``, read in a transaction of its own."""
    return store.transact_sync(lambda tx: tx.sql(sql))


@pytest.fixture(name="rows")
def rows_fixture() -> Callable[[Store, str], list[dict[str, Any]]]:
    return rows
