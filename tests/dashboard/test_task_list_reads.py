"""The dashboard's task list reads the steps of the tasks it shows, not of every task between
them (OPS5: a page of a large store stays as fast as the unfiltered list)."""

from __future__ import annotations

from typing import Any

from stepwarden.dashboard import data

from .conftest import Scene


def test_the_error_tasks_far_apart_read_only_their_own_steps(scene: Scene) -> None:
    """Found by review: `/tasks?state=error` read every step between the page's lowest and
    highest task id (0.6 s a poll for 3 error tasks among 112,000), on every poll of every tab."""
    first = scene.errored("o-first")
    for i in range(200):
        scene.submit(f"o-{i}")
    # processed (as far as the list is concerned), so the next claim leaves them alone
    scene.store.transact_sync(
        lambda tx: tx.sql("UPDATE tasks SET state = 'processed' WHERE state = 'pending'")
    )
    last = scene.errored("o-last")
    read: list[int] = []

    def listed(tx: Any) -> dict[str, Any]:
        real = tx.sql

        def counting(sql: str, params: Any = ()) -> Any:
            rows = real(sql, params)
            if "FROM steps" in sql:
                read.append(len(rows))
            return rows

        tx.sql = counting
        return data.task_list(tx, "error", None, None)

    page = scene.store.transact_sync(listed)
    assert [t["id"] for t in page["tasks"]] == [last, first]
    steps_per_task = len(page["tasks"][0]["steps"])
    assert sum(read) == 2 * steps_per_task, read
