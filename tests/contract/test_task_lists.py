"""Listing tasks (``tasks``, the dashboard's list): each listed task with its own steps, and only
those steps read, however far apart the listed tasks are."""

from __future__ import annotations

from typing import Any

from test_store import Factory, q, submit

from stepwarden.store import Store, views
from stepwarden.store.base import Tx


class CountingTx:
    """A transaction that counts the rows its raw reads return (what a view held in memory)."""

    def __init__(self, tx: Tx) -> None:
        self.tx = tx
        self.rows = 0

    def sql(self, text: str, params: Any = ()) -> list[Any]:
        rows = self.tx.sql(text, params)
        self.rows += len(rows)
        return rows

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tx, name)


def listed(store: Store, **kw: Any) -> tuple[list[dict[str, Any]], int]:
    def read(tx: Tx) -> tuple[list[dict[str, Any]], int]:
        counting = CountingTx(tx)
        tasks = views.list_tasks(counting, **kw)
        return tasks, counting.rows

    return store.transact_sync(read)


def test_a_state_filter_reads_only_the_steps_of_the_tasks_it_lists(
    store: Store, make_workflow: Factory
) -> None:
    wf = make_workflow()  # three steps each
    ids = [submit(store, wf, {"n": i}) for i in range(200)]
    first, last = ids[0], ids[-1]
    q(store, "UPDATE tasks SET state = 'error' WHERE id IN (?, ?)", first, last)

    tasks, rows = listed(store, state="error")

    assert [t["id"] for t in tasks] == [first, last]
    assert [[s["name"] for s in t["steps"]] for t in tasks] == [["a", "b", "c"], ["a", "b", "c"]]
    # the two tasks and their six steps, not the 600 steps between the first and the last
    assert rows == 2 + 6


def test_a_long_list_is_read_whole_in_parts(store: Store, make_workflow: Factory) -> None:
    wf = make_workflow("only")
    ids = [submit(store, wf, {"n": i}) for i in range(1203)]

    tasks, rows = listed(store)

    assert [t["id"] for t in tasks] == ids
    assert all([s["name"] for s in t["steps"]] == ["only"] for t in tasks)
    assert rows == 2 * len(ids)
