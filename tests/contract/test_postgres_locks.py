"""PostgreSQL-only failure modes of the fenced supervisor: a task row held by another session must
not stall the sweep (and with it the leader's own renewal), and a migration interrupted by a lost
connection is retried instead of failing a worker's start."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
import pytest

from stepwarden.clock import FakeClock
from stepwarden.store import open_store
from stepwarden.store import transitions as t
from stepwarden.store.postgres import PostgresStore


def test_a_locked_task_is_skipped_by_the_sweep_and_renewal_is_not_blocked(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    store = open_store(pg_url, clock=clock)
    try:
        ids = [
            store.transact_sync(
                t.submit,
                make_workflow("a", budget=5),
                "{}",
                correlation_id=None,
                idempotency_key=None,
                priority=0,
                reply_to=None,
            )[0]
            for _ in range(2)
        ]
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 2
        term, _ = asyncio.run(store.acquire_lease("supervisor", "sup", 10)) or (0, 0.0)
        clock.advance(6)  # both attempts are past complete-by
        with psycopg.connect(pg_url) as other:  # a paused session holding the first task's row
            other.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", (ids[0],))
            started = time.monotonic()
            result = asyncio.run(store.sweep_expired("sup", "supervisor", term, 10))
            assert time.monotonic() - started < 3, "the sweep waited for the locked row"
            assert result.rescued == 1  # the other task
            renewed: list[bool] = []
            th = threading.Thread(
                target=lambda: renewed.append(asyncio.run(store.renew_lease("supervisor", "sup", term, 10)))
            )
            th.start()
            th.join(timeout=3)
            assert renewed == [True], "the renewal did not wait on the held task"
            other.rollback()
        again = asyncio.run(store.sweep_expired("sup", "supervisor", term, 10))
        assert again.rescued == 1, "the skipped task is rescued by the next sweep"
    finally:
        store.close()


def test_a_migration_interrupted_by_a_lost_connection_is_retried(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(pg_url)
    assert isinstance(store, PostgresStore)
    real = store._migrate_once
    calls: list[int] = []

    def flaky(target: int | None) -> int:
        calls.append(1)
        if len(calls) == 1:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return real(target)

    monkeypatch.setattr(store, "_migrate_once", flaky)
    monkeypatch.setattr("stepwarden.store.postgres.time.sleep", lambda s: None)  # no real back-off wait
    try:
        assert store.migrate() == 0
        assert len(calls) == 2
    finally:
        store.close()


def test_prune_skips_a_task_another_session_holds_and_does_not_wait(
    pg_url: str, clock: FakeClock, make_workflow: Any
) -> None:
    """An operator retrying an old cancelled task holds its row: the prune must neither delete
    its rows under it nor wait for it (the prune is fenced by the lease it must keep renewing)."""
    store = open_store(pg_url, clock=clock)
    try:
        wf = make_workflow("a", budget=5)
        ids = [
            store.transact_sync(
                t.submit, wf, "{}", correlation_id=None, idempotency_key=None, priority=0, reply_to=None
            )[0]
            for _ in range(2)
        ]
        for task_id in ids:
            store.transact_sync(t.cancel_task, task_id, "operator")
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 2  # both end cancelled
        term, _ = asyncio.run(store.acquire_lease("supervisor", "sup", 1e6)) or (0, 0.0)
        clock.advance(100)
        with psycopg.connect(pg_url) as other:
            other.execute("SELECT id FROM tasks WHERE id = %s FOR UPDATE", (ids[0],))
            started = time.monotonic()
            assert store.transact_sync(t.prune, "sup", "supervisor", term, 10.0, 100) == 1
            assert time.monotonic() - started < 3, "the prune waited for the locked row"
            other.rollback()
        left = store.transact_sync(lambda tx: tx.sql("SELECT id FROM tasks ORDER BY id"))
        assert [r["id"] for r in left] == [ids[0]]
        assert store.transact_sync(
            lambda tx: tx.sql("SELECT count(*) AS n FROM steps WHERE task_id = ?", (ids[0],))
        )[0]["n"] == len(wf.steps)
        assert store.transact_sync(t.prune, "sup", "supervisor", term, 10.0, 100) == 1  # next round
    finally:
        store.close()
