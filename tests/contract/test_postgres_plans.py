"""The plans a worker's statements keep. A store starts empty, its statements are prepared on first
use, and PostgreSQL keeps a prepared statement's generic plan until an ANALYZE invalidates it:
a plan made on empty tables must still reach rows through an index once the tables are large.
Read from the server's own count of sequential scans per table."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
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
        "received_tail": None,
    }  # fmt: skip

    def explain(tx: Any) -> str:
        rows = tx.conn.execute("EXPLAIN " + one_connection_store.queries["submit_task"], params).fetchall()
        return "\n".join(str(r["QUERY PLAN"]) for r in rows)

    plan = one_connection_store.transact_sync(explain)
    assert "tasks_claimable" in plan, plan
    assert "Sort" not in plan, plan


def test_a_lookup_by_correlation_id_searches_the_index_of_tasks_that_have_one(
    one_connection_store: PostgresStore, pg_url: str
) -> None:
    """``tasks_correlation`` holds only tasks with a correlation id (migration 9); an exact match
    implies one, so the planner still searches it, among 5,000 tasks of which 50 have one."""
    from stepwarden.store.views import task_filter, where_clause

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO tasks (workflow, workflow_version, input, state, run_at, created_at, updated_at,"
            " correlation_id) SELECT 'backlog', 1, '{}', 'processed', 0, 0, 0,"
            " CASE WHEN i % 100 = 0 THEN 'order-' || i END FROM generate_series(1, 5000) AS i"
        )
        conn.execute("ANALYZE tasks")
    where, params = task_filter(None, None, "order-1700")
    sql_text = "SELECT id FROM tasks" + where_clause(where)

    def explain(tx: Any) -> str:
        return "\n".join(str(next(iter(r.values()))) for r in tx.sql("EXPLAIN " + sql_text, tuple(params)))

    plan = one_connection_store.transact_sync(explain)
    assert "tasks_correlation" in plan, plan
    assert "Seq Scan" not in plan, plan
    found = one_connection_store.transact_sync(lambda tx: tx.sql(sql_text, tuple(params)))
    assert len(found) == 1


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


# The supervisor's anti-joins: an attempt with a reply waiting to be applied is not expired. They
# must look for that reply by its attempt (one probe of replies_attempt per step), whatever the
# planner believes about how many replies wait: it read all of replies_new for every expired step,
# expired x waiting replies (200 x 20,000: 4,000,000 rows filtered, half a second a sweep), just
# when the schedulers have fallen behind.
ANTI_JOINS: dict[str, dict[str, Any]] = {
    "expired_steps": {"limit": 200},
    "still_expired": {"task_id": 1, "idx": 0, "attempt": 1},
    "orphaned_steps": {"worker": "w", "limit": 200},
    "still_orphaned": {"task_id": 1, "idx": 0, "attempt": 1, "worker": "w"},
}


def _grow_a_backlog_of_replies(conn: Any, *, analyze: bool) -> None:
    """300 attempts long expired, taken by worker ``w``, and 20,000 running ones each with a reply
    waiting to be applied (the schedulers are down). With ``analyze``, the statistics are taken
    while those replies were still applied (the normal state), before the backlog built up."""
    conn.execute(
        "INSERT INTO tasks (workflow, workflow_version, input, state, run_at, created_at, updated_at)"
        " SELECT 'w', 1, '{}', 'processing', 0, 0, 0 FROM generate_series(1, 20300)"
    )
    conn.execute(
        "INSERT INTO steps (task_id, idx, name, agent, operation, budget, policy, on_error, state, attempt,"
        " complete_by) SELECT id, 0, 'a', 'svc', 'op', 30, '{}', 'error', 'running', 1,"
        " CASE WHEN id <= 300 THEN 1.0 ELSE 9e12 END FROM tasks"
    )
    conn.execute(
        "INSERT INTO requests (task_id, step_idx, attempt, kind, agent, operation, payload, policy,"
        " idempotency_key, priority, complete_by, state, taken_by, dispatched_by, dispatched_at)"
        " SELECT id, 0, 1, 'do', 'svc', 'op', '{}', '{}', 'k' || id, 0, 1.0, 'taken', 'w', 'x', 0"
        " FROM tasks WHERE id <= 300"
    )
    conn.execute(
        "INSERT INTO replies (request_id, task_id, step_idx, attempt, kind, outcome, received_at, sent_by,"
        " status) SELECT id, id, 0, 1, 'do', 'ok', 0, 'x', 'accepted' FROM tasks WHERE id > 300"
    )
    if analyze:
        conn.execute("ANALYZE")
    conn.execute("UPDATE replies SET status = 'new'")


def _assert_probes_by_attempt(plans: dict[str, str]) -> None:
    """Each plan reaches replies through replies_attempt, never reads replies_new, and filters no
    join rows (the sign of every waiting reply read per expired step)."""
    probes = {
        name: "replies_attempt" in plan and "replies_new" not in plan and "Removed by Join Filter" not in plan
        for name, plan in plans.items()
    }
    assert probes == dict.fromkeys(ANTI_JOINS, True), "\n\n".join(f"{n}:\n{p}" for n, p in plans.items())


def _positional(text: str, order: list[str]) -> str:
    """A query's ``%(name)s`` parameters as ``$1, $2...`` in ``order``, for PREPARE."""
    return re.sub(r"%\((\w+)\)s", lambda m: f"${order.index(m.group(1)) + 1}", text)


def test_the_supervisor_s_anti_joins_probe_replies_by_attempt_when_replies_pile_up(
    one_connection_store: PostgresStore, pg_url: str
) -> None:
    """Statistics taken while few replies wait (the normal state); then 20,000 pile up."""
    store = one_connection_store
    with psycopg.connect(pg_url, autocommit=True) as conn:
        _grow_a_backlog_of_replies(conn, analyze=True)

    def explain(tx: Any) -> dict[str, str]:
        out = {}
        for name, params in ANTI_JOINS.items():
            rows = tx.conn.execute("EXPLAIN (ANALYZE, COSTS off) " + store.queries[name], params).fetchall()
            out[name] = "\n".join(str(r["QUERY PLAN"]) for r in rows)
        return out

    _assert_probes_by_attempt(store.transact_sync(explain))


def test_the_supervisor_s_anti_joins_planned_on_an_empty_store_probe_replies_by_attempt(
    one_connection_store: PostgresStore, pg_url: str
) -> None:
    """A worker's statements are prepared on their first uses, on a store that may be empty, and
    a generic plan is kept (forced here) until an ANALYZE: it must still probe by attempt once
    20,000 replies wait."""
    store = one_connection_store

    def execute(name: str) -> sql.Composed:
        args = sql.SQL(", ").join(sql.Literal(v) for v in ANTI_JOINS[name].values())
        return sql.SQL("EXECUTE {} ({})").format(sql.Identifier(name), args)

    def prepare(tx: Any) -> None:
        tx.conn.execute("SET plan_cache_mode = force_generic_plan")  # for the session: kept
        for name, params in ANTI_JOINS.items():
            tx.conn.execute(f"PREPARE {name} AS {_positional(store.queries[name], list(params))}")
            tx.conn.execute(execute(name))  # its generic plan, made on the empty store

    def explain(tx: Any) -> dict[str, str]:
        out = {}
        for name in ANTI_JOINS:
            rows = tx.conn.execute(sql.SQL("EXPLAIN (ANALYZE, COSTS off) ") + execute(name)).fetchall()
            out[name] = "\n".join(str(r["QUERY PLAN"]) for r in rows)
        return out

    store.transact_sync(prepare)
    with psycopg.connect(pg_url, autocommit=True) as conn:
        _grow_a_backlog_of_replies(conn, analyze=False)
    _assert_probes_by_attempt(store.transact_sync(explain))
