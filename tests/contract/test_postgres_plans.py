"""The plans a worker's statements keep. A store starts empty, its statements are prepared on first
use, and PostgreSQL keeps a prepared statement's generic plan until an ANALYZE invalidates it:
a plan made on empty tables must still reach rows through an index once the tables are large.
Read from the server's own count of sequential scans per table."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from test_store import ME, Factory, room, run, submit

from stepwarden.clock import FakeClock
from stepwarden.store import open_store
from stepwarden.store.postgres import PostgresStore


@pytest.fixture
def one_connection_store(pg_url: str, clock: FakeClock) -> Iterator[PostgresStore]:
    """A store whose pool is one connection, so every transaction runs on the session we watch."""
    s = open_store(pg_url + "?pool_size=1", clock=clock)
    assert isinstance(s, PostgresStore)
    yield s
    s.close()


def _grow(pg_url: str, tasks: int) -> None:
    """Finished tasks with their steps, requests and replies, written behind the store's back (no
    ANALYZE: autovacuum would take a minute to come)."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO tasks (workflow, workflow_version, input, state, run_at, created_at, updated_at,"
            " finished_at) SELECT 'old', 1, '{}', 'processed', 0, 0, 0, 0 FROM generate_series(1, %s)",
            (tasks,),
        )
        conn.execute(
            "INSERT INTO steps (task_id, idx, name, agent, operation, budget, policy, on_error, state,"
            " attempt) SELECT id, 0, 'a', 'svc', 'op', 30, '{}', 'compensate', 'completed', 1"
            " FROM tasks WHERE workflow = 'old'"
        )
        conn.execute(
            "INSERT INTO requests (task_id, step_idx, attempt, kind, agent, operation, payload, policy,"
            " idempotency_key, priority, complete_by, state, outcome, dispatched_by, dispatched_at)"
            " SELECT id, 0, 1, 'do', 'svc', 'op', '{}', '{}', 'k' || id, 0, 0, 'replied', 'ok', 'x', 0"
            " FROM tasks WHERE workflow = 'old'"
        )
        conn.execute("SELECT pg_stat_force_next_flush()")  # its own scans counted before we look
        conn.execute("SELECT 1")


TABLES = ("tasks", "steps", "requests", "replies")


def _seq_scans(pg_url: str) -> dict[str, int]:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname, seq_scan FROM pg_stat_user_tables WHERE relname = ANY (%s)", (list(TABLES),)
        ).fetchall()
    return {name: int(n) for name, n in rows}


def _flush_stats(conn: Any) -> None:
    """Make a session's table statistics visible to others now (instead of within seconds): they are
    flushed when its next transaction ends."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.commit()


def test_the_hot_path_plans_made_on_an_empty_store_use_indexes_once_it_is_large(
    one_connection_store: PostgresStore, make_workflow: Factory, pg_url: str
) -> None:
    store = one_connection_store
    wf = make_workflow()

    def round_trip() -> None:
        """Submit, claim and dispatch, take, reply and apply: every statement of a step's life."""
        ids = [submit(store, wf, {"n": n}) for n in range(3)]
        _, claimed, taken = run(store.schedule_and_take(ME, 50, {"svc": room(3)}))
        assert claimed == 3 and len(taken) == 3
        replies = [(m.id, "ok", None, None) for m in taken]
        applied, _ = run(store.send_replies_and_take(ME, replies, {"svc": room(3)}))
        assert applied is not None and applied.accepted == 3
        assert sorted(m.task_id for m in taken) == ids

    for _ in range(8):  # past any threshold after which a generic plan replaces custom ones
        round_trip()
    _grow(pg_url, 20_000)
    with store.pool.connection() as conn:
        _flush_stats(conn)
    before = _seq_scans(pg_url)
    round_trip()
    with store.pool.connection() as conn:
        _flush_stats(conn)
    after = _seq_scans(pg_url)
    assert {t: after[t] - before[t] for t in TABLES} == dict.fromkeys(TABLES, 0)


def test_the_store_s_connections_price_sequential_scans_out(one_connection_store: PostgresStore) -> None:
    with one_connection_store.pool.connection() as conn:
        row: Any = conn.execute("SHOW enable_seqscan").fetchone()
    assert row["enable_seqscan"] == "off"


@pytest.mark.parametrize("pooler", ["", "?pooler=transaction"])
def test_a_caller_s_own_transaction_keeps_the_planner_as_it_is(pg_url: str, pooler: str) -> None:
    """``App.transaction()`` runs the caller's own SQL on the connection the store opens for it:
    the setting is for the store's statements on its pool, not for the caller's."""
    store = open_store(pg_url + pooler)
    try:
        conn = store.connect()
        try:
            store.begin(conn)
            assert conn.execute("SHOW enable_seqscan").fetchone()[0] == "on"
            conn.rollback()
        finally:
            conn.close()
        with store.pool.connection() as pooled:  # type: ignore[attr-defined]
            store._begin(pooled)  # type: ignore[attr-defined]
            assert pooled.execute("SHOW enable_seqscan").fetchone()["enable_seqscan"] == "off"
            pooled.rollback()
    finally:
        store.close()


def test_a_submission_reads_the_first_waiting_tasks_through_the_claimable_index(
    one_connection_store: PostgresStore, pg_url: str
) -> None:
    """The submission's wake-up hint looks at the first 8 claimable tasks. Its condition lacked
    the index's ``waiting = 0`` (schema 6), so the partial index could not serve it and every
    submission sorted all pending tasks: with no worker running, 1,155 submissions/s fell to 289
    after 9,000. The plan must walk tasks_claimable and stop at 8, with no sort."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO tasks (workflow, workflow_version, input, state, run_at, created_at, updated_at)"
            " SELECT 'backlog', 1, '{}', 'pending', 0, 0, 0 FROM generate_series(1, 5000)"
        )
        conn.execute("ANALYZE tasks")
    params = {
        "workflow": "w", "version": 1, "input": "{}", "correlation_id": None, "idempotency_key": None,
        "reply_to": None, "priority": 0, "steps": "[]", "detail": "{}", "may_skip": True,
    }  # fmt: skip

    def explain(tx: Any) -> str:
        rows = tx.conn.execute("EXPLAIN " + one_connection_store.queries["submit_task"], params).fetchall()
        return "\n".join(str(r["QUERY PLAN"]) for r in rows)

    plan = one_connection_store.transact_sync(explain)
    assert "tasks_claimable" in plan, plan
    assert "Sort" not in plan, plan


def test_a_take_for_the_operations_a_worker_has_walks_the_queued_index(
    one_connection_store: PostgresStore, pg_url: str
) -> None:
    """Pulls and the takes of reply batches and scheduler rounds filter by the worker's
    operations (``claim_agent_requests``): the filter must not cost the index walk, whatever
    the size of the table of requests (most of them long answered)."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO requests (task_id, step_idx, attempt, kind, agent, operation, payload, policy,"
            " idempotency_key, priority, complete_by, state, dispatched_by, dispatched_at)"
            " SELECT g, 0, 1, 'do', CASE WHEN g % 10 = 0 THEN 'svc' ELSE 'other' END, 'op' || (g % 7),"
            " '{}', '{}', 'k:' || g, 0, 1e12, CASE WHEN g % 50 = 0 THEN 'queued' ELSE 'replied' END,"
            " 'x', 0 FROM generate_series(1, 50000) g"
        )
        conn.execute("ANALYZE requests")
    params = {"me": ME, "agent": "svc", "limit": 10, "ops": '["op1", "op2"]'}

    def explain(tx: Any) -> str:
        rows = tx.conn.execute("EXPLAIN " + one_connection_store.queries["claim_agent_requests"], params)
        return "\n".join(str(r["QUERY PLAN"]) for r in rows.fetchall())

    plan = one_connection_store.transact_sync(explain)
    assert "requests_queued" in plan, plan
    assert "Seq Scan on requests" not in plan, plan
