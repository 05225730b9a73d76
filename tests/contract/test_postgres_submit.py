"""A submission on PostgreSQL is one statement sent on its own (its own transaction: one round
trip, not BEGIN, statement, COMMIT). Its failure modes: a pooled connection that died while idle
is replaced before anything is sent; a connection lost with the statement in flight is reported as
an unknown outcome, never retried blindly into a second task."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from stepwarden import App
from stepwarden.errors import StoreError
from stepwarden.store import open_store
from stepwarden.store.postgres import PgTx, PostgresStore
from stepwarden.workflow import Workflow


@pytest.fixture
def app(pg_url: str, make_workflow: Any) -> Iterator[App]:
    store = open_store(pg_url)  # the system clock: the fast path (a fake clock takes the other)
    assert isinstance(store, PostgresStore) and not store.fake_time
    a = App()
    a.use_store(store)
    wf: Workflow = make_workflow()
    a.workflows[wf.name] = wf
    yield a
    store.close()


def _count(url: str, sql: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(sql).fetchone()
        assert row is not None
        return int(row[0])


def _whole(url: str) -> tuple[int, int, int]:
    return (
        _count(url, "SELECT COUNT(*) FROM tasks"),
        _count(url, "SELECT COUNT(*) FROM steps"),
        _count(url, "SELECT COUNT(*) FROM events WHERE kind = 'received'"),
    )


def test_a_submission_is_its_own_transaction_and_writes_the_task_whole(app: App, pg_url: str) -> None:
    wf = next(iter(app.workflows))
    steps = len(app.workflows[wf].steps)
    sent: list[str] = []
    real = PgTx._exec

    def spy(self: PgTx, query: str, params: dict[str, Any]) -> Any:
        sent.append(f"{query} autocommit={self.conn.autocommit}")
        return real(self, query, params)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(PgTx, "_exec", spy)
        first = app.submit(wf, {"n": 1}, idempotency_key="k-1")
        again = app.submit(wf, {"n": 1}, idempotency_key="k-1")
    assert first == again, "a repeated key returns the first task"
    assert sent == [
        "submit_task autocommit=True",
        "submit_task autocommit=True",
        "task_by_key autocommit=True",
    ]
    assert _whole(pg_url) == (1, steps, 1)
    with app.store.pool.connection() as conn:  # type: ignore[attr-defined]
        assert conn.autocommit is False, "the pooled connection goes back as it came"


def test_a_pooled_connection_killed_while_idle_is_replaced_before_the_submission(
    app: App, pg_url: str
) -> None:
    wf = next(iter(app.workflows))
    app.submit(wf, {"n": 0})
    with psycopg.connect(pg_url, autocommit=True) as admin:
        killed = admin.execute(
            # the timeout makes it wait until each backend has exited, as after a restart (a
            # backend ended while the submission is in flight is the next test's case)
            "SELECT COUNT(pg_terminate_backend(pid, 10000)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    assert killed is not None and killed[0] >= 1, "the store's idle connections were ended"
    ids = [app.submit(wf, {"n": n}) for n in range(1, 4)]  # no error: stale ones are replaced
    assert len(set(ids)) == 3
    assert _whole(pg_url)[0] == 4


def test_a_connection_lost_with_the_submission_in_flight_is_an_unknown_outcome_not_a_retry(
    app: App, pg_url: str
) -> None:
    wf = next(iter(app.workflows))
    real = PgTx._exec

    def commits_then_loses_the_answer(self: PgTx, query: str, params: dict[str, Any]) -> Any:
        real(self, query, params).fetchall()  # the server ran it (and, alone, committed it)
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(PgTx, "_exec", commits_then_loses_the_answer)
        with pytest.raises(StoreError, match="may or may not have been written"):
            app.submit(wf, {"n": 1}, correlation_id="o-1")
    assert _whole(pg_url)[0] == 1, "written once, and not again by a blind retry"
    assert app.submit(wf, {"n": 2}) > 0, "the next submission goes through"


def test_racing_submissions_of_one_key_make_one_task_each(app: App, pg_url: str) -> None:
    """Each submission is its own transaction at READ COMMITTED: the insert itself resolves a
    duplicate key (ON CONFLICT DO NOTHING waits for the other insert, then the look-up sees it)."""
    wf = next(iter(app.workflows))
    keys = [f"key-{k}" for k in range(15)]
    got: dict[str, set[int]] = {k: set() for k in keys}
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def submitter() -> None:
        try:
            start.wait(10)
            for k in keys:
                got[k].add(app.submit(wf, {"k": k}, idempotency_key=k))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=submitter) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(len(ids) == 1 for ids in got.values()), got
    assert _whole(pg_url)[0] == len(keys)


def test_when_every_pooled_connection_looks_dead_the_submission_takes_the_transactional_path(
    app: App, pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    wf = next(iter(app.workflows))
    looked: list[int] = []

    def dead(conn: Any) -> bool:
        looked.append(1)
        return True

    monkeypatch.setattr("stepwarden.store.postgres._stale", dead)
    task_id = app.submit(wf, {"n": 1})
    assert len(looked) == 3, "three connections tried, then the other path"
    assert app.task(task_id)["state"] == "pending"
    assert _whole(pg_url) == (1, len(app.workflows[wf].steps), 1)


def test_a_transition_marked_autocommit_that_writes_more_than_one_statement_is_refused(
    app: App, pg_url: str
) -> None:
    """Writes kept for commit would go out as transactions of their own: refused, not sent."""

    def two_writes(tx: Any) -> None:
        tx.later("insert_event", task_id=None, idx=None, attempt=None, kind="x", actor="t", detail=None)

    two_writes.stepwarden_autocommit = True  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="marked autocommit"):
        app.store.transact_sync(two_writes)
    assert _count(pg_url, "SELECT COUNT(*) FROM events") == 0
