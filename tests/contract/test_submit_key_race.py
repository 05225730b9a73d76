"""A repeated idempotency key whose task is deleted while the submission looks for it (SUB3): the
insert met the key, then the leader's prune removed the task at the end of its retention, before
the look-up of the existing task (on PostgreSQL they are two statements, each seeing what is
committed when it starts). The submission used to end in a bare AssertionError."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import pytest

from stepwarden import StoreError
from stepwarden.clock import FakeClock
from stepwarden.store import Store, Tx, views
from stepwarden.store import transitions as t
from stepwarden.workflow import Workflow, encode_input

SUP = "sup-1:1:ccc"
DAY = 86400.0
KEY = "order-1"
Factory = Callable[..., Workflow]


class LookUpAfter:
    """The submission's transaction, in which ``before_look_up(tx)`` runs once, just before the
    look-up of the task holding the key (``task_by_key``); any other statement goes through."""

    def __init__(self, tx: Tx, before_look_up: Callable[[Tx], Any]) -> None:
        self.tx = tx
        self.before_look_up: Callable[[Tx], Any] | None = before_look_up

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tx, name)

    def one(self, query: str, /, **params: Any) -> Any:
        if query == "task_by_key" and self.before_look_up is not None:
            self.before_look_up(self.tx)
            self.before_look_up = None
        return self.tx.one(query, **params)


def submit(store: Store, wf: Workflow, race: Callable[[Tx], Any] | None = None) -> tuple[int, bool]:
    opts: dict[str, Any] = {"correlation_id": None, "idempotency_key": KEY, "priority": 0, "reply_to": None}
    text = encode_input({"order": 1})
    if race is None:
        return store.transact_sync(t.submit, wf, text, **opts)
    return store.transact_sync(lambda tx: t.submit(cast(Tx, LookUpAfter(tx, race)), wf, text, **opts))


def finished_long_ago(store: Store, clock: FakeClock, task_id: int) -> None:
    store.transact_sync(
        lambda tx: tx.sql(
            "UPDATE tasks SET state = 'processed', finished_at = ? WHERE id = ?",
            (clock.wall() - 2 * DAY, task_id),
        )
    )


def task_ids(store: Store) -> list[int]:
    return [int(r["id"]) for r in store.transact_sync(lambda tx: tx.sql("SELECT id FROM tasks ORDER BY id"))]


def test_a_key_whose_task_is_pruned_during_the_submission_makes_a_new_task(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """The key is free once its task is gone: the submission creates a task under it, whole, as
    it would have a moment later, instead of failing."""
    wf = make_workflow()
    first, _ = submit(store, wf)
    finished_long_ago(store, clock, first)
    got = asyncio.run(store.acquire_lease("supervisor", SUP, 1e9))
    assert got is not None
    term = int(got[0])

    def prune(tx: Tx) -> None:
        assert t.prune(tx, SUP, "supervisor", term, DAY, 100) == 1

    task_id, created = submit(store, wf, race=prune)
    assert created and task_id != first
    assert task_ids(store) == [task_id]
    shown = store.transact_sync(views.show_task, task_id)
    assert shown["state"] == "pending"
    assert [s["name"] for s in shown["steps"]] == ["a", "b", "c"]
    assert submit(store, wf) == (task_id, False), "and the key now returns the new task"


def test_a_key_that_keeps_vanishing_is_a_clear_error_and_writes_nothing(
    store: Store, make_workflow: Factory
) -> None:
    """Met at each insert and gone at each look-up (taken and pruned again in between): after
    the second try, a StoreError that says what happened, not an AssertionError."""
    wf = make_workflow()
    first, _ = submit(store, wf)

    class Vanishing(LookUpAfter):
        def one(self, query: str, /, **params: Any) -> Any:
            return None if query == "task_by_key" else self.tx.one(query, **params)

    text = encode_input({"order": 2})
    with pytest.raises(StoreError, match=f"idempotency key '{KEY}': its task was deleted while this"):
        store.transact_sync(
            lambda tx: t.submit(
                cast(Tx, Vanishing(tx, lambda _: None)),
                wf,
                text,
                correlation_id=None,
                idempotency_key=KEY,
                priority=0,
                reply_to=None,
            )
        )
    assert task_ids(store) == [first]
