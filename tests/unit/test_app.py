"""The application surface: the curated public API, submission from plain and async code, and
submission inside the caller's own transaction (SUB2)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

import stepwarden
from stepwarden import App, InputError, PayloadTooLarge, Step, UnknownWorkflow
from stepwarden.store import views


def make_app(tmp_path: Path) -> App:
    app = App(f"sqlite:///{tmp_path / 'app.db'}", max_input_bytes=1024)
    ag = app.agent("inv")

    @ag.operation
    def reserve(req: stepwarden.Request) -> dict[str, int]:
        return {"ok": 1}

    app.workflow("order", [Step("reserve", "inv.reserve", complete_by=5)])
    return app


def count(app: App, table: str) -> int:
    return int(app.store.transact_sync(lambda tx: tx.sql(f"SELECT COUNT(*) AS n FROM {table}"))[0]["n"])


def test_public_api_is_curated_and_importable() -> None:
    for name in stepwarden.__all__:
        assert hasattr(stepwarden, name), name
    assert not [n for n in stepwarden.__all__ if n.startswith("_") and n != "__version__"]
    assert {"App", "Step", "Retry", "Permanent", "Transient", "run_while_leader"} <= set(stepwarden.__all__)


def test_submit_writes_task_and_steps_and_repeats_by_key(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    a = app.submit(
        "order", {"n": 1}, correlation_id="o-1", idempotency_key="k-1", priority=5, reply_to="web-1"
    )
    b = app.submit("order", {"n": 1}, correlation_id="o-1", idempotency_key="k-1")
    assert a == b
    view = app.task(a)
    assert view["state"] == "pending" and view["priority"] == 5 and view["correlation_id"] == "o-1"
    assert [s["name"] for s in view["steps"]] == ["reserve"]
    assert count(app, "tasks") == 1 and count(app, "steps") == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"workflow": "nope"}, UnknownWorkflow),
        ({"workflow": "bad name!"}, InputError),
        ({"input": {"x": object()}}, InputError),
        ({"input": {"x": float("nan")}}, InputError),
        ({"input": {"x": "y" * 2000}}, PayloadTooLarge),
        ({"correlation_id": ""}, InputError),
        ({"idempotency_key": "k" * 256}, InputError),
        ({"idempotency_key": "bad\nkey"}, InputError),
        ({"reply_to": "q; DROP TABLE tasks"}, InputError),
        ({"priority": 2**40}, InputError),
    ],
)
def test_bad_submissions_raise_and_write_nothing(
    tmp_path: Path, kwargs: dict[str, object], error: type
) -> None:
    app = make_app(tmp_path)
    args: dict[str, object] = {"workflow": "order", "input": {"n": 1}}
    args.update(kwargs)
    workflow = args.pop("workflow")
    data = args.pop("input")
    with pytest.raises(error):
        app.submit(workflow, data, **args)  # type: ignore[arg-type]
    assert count(app, "tasks") == 0 and count(app, "events") == 0


def test_transaction_commits_business_row_and_task_together(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    with app.transaction() as tx:
        tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY, total INTEGER)")
        tx.execute("INSERT INTO orders VALUES (?, ?)", ("o-1", 100))
        task_id = tx.submit("order", {"order": "o-1"}, correlation_id="o-1")
    conn = sqlite3.connect(tmp_path / "app.db")
    assert conn.execute("SELECT total FROM orders WHERE id = 'o-1'").fetchone() == (100,)
    assert app.task(task_id)["correlation_id"] == "o-1"


def test_transaction_rolls_back_both_on_error(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    with app.transaction() as tx:
        tx.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
    with pytest.raises(RuntimeError), app.transaction() as tx:
        tx.execute("INSERT INTO orders VALUES ('o-2')")
        tx.submit("order", {"order": "o-2"}, correlation_id="o-2")
        raise RuntimeError("the web handler failed after submitting")
    conn = sqlite3.connect(tmp_path / "app.db")
    assert conn.execute("SELECT COUNT(*) FROM orders").fetchone() == (0,)
    assert count(app, "tasks") == 0 and count(app, "steps") == 0


def test_transaction_submit_of_workflow_known_only_to_the_store(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    from stepwarden.store.core import _register

    app.store.transact_sync(_register, list(app.workflows.values()), "test")
    other = App(app.url)  # an application that does not define the workflow itself
    with other.transaction() as tx:
        task_id = tx.submit("order", {"n": 2})
    assert other.task(task_id)["workflow"] == "order"
    with pytest.raises(UnknownWorkflow), other.transaction() as tx:
        tx.submit("missing", {})


def test_submit_async_and_wait_timeout(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    task_id = asyncio.run(app.submit_async("order", {"n": 3}, correlation_id="o-3"))
    assert app.store.transact_sync(views.task_state, task_id) == "pending"
    with pytest.raises(TimeoutError):
        app.wait(task_id, timeout=0.2, poll=0.05)  # no worker runs: it stays pending
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        app.wait(task_id, timeout=0.2, poll=30)  # a poll longer than the timeout: slept 30 s before
    assert time.monotonic() - began < 5
    with pytest.raises(TimeoutError):
        app.wait(task_id, timeout=0.1, poll=1e308)  # was an OverflowError from time.sleep


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda app, t: app.wait(2**70), "task id"),
        (lambda app, t: app.wait(True), "task id"),
        (lambda app, t: app.wait("1"), "task id"),
        (lambda app, t: app.task(0), "task id"),
        (lambda app, t: app.wait(t, timeout="5"), "timeout"),
        (lambda app, t: app.wait(t, timeout=float("nan")), "timeout"),
        (lambda app, t: app.wait(t, timeout=-1), "timeout"),
        (lambda app, t: app.wait(t, timeout=1, poll=0), "poll"),
        (lambda app, t: app.wait(t, timeout=1, poll=-1), "poll"),
        (lambda app, t: app.wait_for_result(t, timeout=float("inf")), "timeout"),
        (lambda app, t: asyncio.run(app.wait_for_result_async(t, timeout=None)), "timeout"),
    ],
)
def test_waiting_with_arguments_that_cannot_work_is_bad_input(tmp_path: Path, call: Any, says: str) -> None:
    """Not an OverflowError from the driver, a TypeError from time arithmetic, or a wait that a
    nan timeout would never end: one InputError naming the argument."""
    app = make_app(tmp_path)
    task_id = app.submit("order", {"n": 1})
    with pytest.raises(InputError, match=says):
        call(app, task_id)
