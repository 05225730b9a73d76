"""The hot queries must walk their partial indexes, so their cost follows the rows they touch
(claimable tasks, queued requests, expired attempts), not the size of the tables."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stepwarden.store import SQLiteStore

PARAMS = {
    "me": "w:1:a",
    "limit": 10,
    "agent": "inventory",
    "own": "[]",
    "retention": 3600.0,
    "ids": "[1]",
    "ops": '["do_a"]',
}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    s = SQLiteStore(str(tmp_path / "plans.db"))
    yield s
    s.close()


def plan(store: SQLiteStore, query: str) -> str:
    rows = store.transact_sync(lambda tx: tx.sql("EXPLAIN QUERY PLAN " + store.queries[query], PARAMS))
    return "\n".join(r["detail"] for r in rows)


@pytest.mark.parametrize(
    ("query", "index"),
    [
        ("claim_agent_requests", "requests_queued"),  # pulls, and the takes of reservations
        ("expired_steps", "steps_inflight"),
        ("new_replies_with_tasks", "replies_new"),
        ("steps_of_new_replies", "replies_new"),
        ("prunable_tasks", "tasks_finished"),  # the leader's prune: oldest finished first
        ("prune_taskless_events", "events_taskless"),  # and of the records that outlive tasks
        ("prunable_alerts", "alerts_created"),
        ("prune_alert_deliveries", "alert_deliveries_alert"),
    ],
)
def test_hot_queries_use_their_partial_index_without_sorting(
    store: SQLiteStore, query: str, index: str
) -> None:
    p = plan(store, query)
    assert f"INDEX {index}" in p, p
    assert "TEMP B-TREE" not in p, (
        f"{query} sorts its candidates instead of reading them in index order:\n{p}"
    )
    assert "SCAN tasks\n" not in p + "\n" and "SCAN steps\n" not in p + "\n", p


def test_the_claim_reads_ready_tasks_in_index_order_and_only_the_due_end_of_the_waiting_ones(
    store: SQLiteStore,
) -> None:
    """Two arms, one per index: the ready tasks walked in priority order (no sort: the walk stops
    at the limit), the waiting ones searched by when they are due (those not yet due are not
    read), sorted by priority (only the due ones), and the two limits merged."""
    rows = store.transact_sync(
        lambda tx: tx.sql("EXPLAIN QUERY PLAN " + store.queries["claim_tasks"], PARAMS)
    )
    details = [r["detail"] for r in rows]
    ready = next(r for r in rows if r["detail"] == "SCAN tasks USING INDEX tasks_claimable")
    assert "SEARCH tasks USING INDEX tasks_waiting (run_at<?)" in details, details
    sorts = [r for r in rows if "TEMP B-TREE" in r["detail"]]
    assert all(r["parent"] != ready["parent"] for r in sorts), f"the ready tasks are sorted: {details}"
    assert "SCAN tasks" not in details, details


def test_a_lookup_by_correlation_id_searches_the_index_of_tasks_that_have_one(store: SQLiteStore) -> None:
    """``tasks_correlation`` holds only tasks with a correlation id (migration 9): an exact match
    implies one, so ``tasks --correlation-id`` still searches it instead of reading every task."""
    from stepwarden.store.views import task_filter, where_clause

    where, params = task_filter(None, None, "order-17")
    sql = "EXPLAIN QUERY PLAN SELECT id FROM tasks" + where_clause(where)
    details = [r["detail"] for r in store.transact_sync(lambda tx: tx.sql(sql, tuple(params)))]
    assert len(details) == 1 and details[0].startswith("SEARCH tasks USING"), details
    assert "INDEX tasks_correlation (correlation_id=?)" in details[0], details
    index = store.transact_sync(
        lambda tx: tx.sql("SELECT sql FROM sqlite_master WHERE name = 'tasks_correlation'")
    )[0]["sql"]
    assert "WHERE correlation_id IS NOT NULL" in index
