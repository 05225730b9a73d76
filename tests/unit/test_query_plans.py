"""The hot queries must walk their partial indexes, so their cost follows the rows they touch
(claimable tasks, queued requests, expired attempts), not the size of the tables."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stepwarden.store import SQLiteStore

PARAMS = {"me": "w:1:a", "limit": 10, "agent": "inventory", "own": "[]", "retention": 3600.0, "ids": "[1]"}


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
        ("claim_tasks", "tasks_claimable"),
        ("claim_requests", "requests_queued"),
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
