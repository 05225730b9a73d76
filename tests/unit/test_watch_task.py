"""`watch ID` prints every event of the task, its last ones too, however its end falls between
the command's reads (OPS1)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stepwarden import App, Request, Step
from stepwarden.cli import cli
from stepwarden.store import Store, open_store
from stepwarden.store.records import event


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(f"sqlite:///{tmp_path / 'watch.db'}")
    yield s
    s.close()


def _finish(tx: Any, task_id: int) -> None:
    """What a reply batch writes as a task ends: its last events and its final state, together."""
    event(tx, "step_completed", task_id, "worker-x", 0, 1, step="a")
    event(tx, "processed", task_id, "worker-x")
    tx.sql("UPDATE tasks SET state = 'processed' WHERE id = ?", (task_id,))


def test_a_task_that_ends_between_the_watchs_reads_has_its_last_events_printed(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch read the task's new events, then its state; a task that became final between the
    two ended the watch (`task N is processed`, exit 0) without its last events. Here the task
    ends right after the watch's first read, whichever read that is."""
    app = App()
    svc = app.agent("svc")

    @svc.operation
    async def run(req: Request) -> None:
        return None

    app.workflow("one", [Step("a", "svc.run", complete_by=30)])
    app.use_store(store)
    asyncio.run(store.register_workflows(list(app.workflows.values()), "test"))
    tid = app.submit("one", {})

    class EndsAfterTheFirstRead:
        """The store, except that the task ends just after the watch's first read returns."""

        def __init__(self) -> None:
            self.reads = 0

        def transact_sync(self, fn: Any, *args: Any, **kw: Any) -> Any:
            out = store.transact_sync(fn, *args, **kw)
            self.reads += 1
            if self.reads == 1:
                store.transact_sync(_finish, tid)
            return out

        def close(self) -> None:
            pass

    monkeypatch.setattr("stepwarden.cli_views.open_for", lambda ctx, **kw: EndsAfterTheFirstRead())
    r = CliRunner().invoke(cli, ["watch", str(tid), "--timeout", "10"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[-1] == f"task {tid} is processed"
    kinds = [ln.split()[1] for ln in lines[:-1]]
    assert kinds[0] == "received" and kinds[-2:] == ["step_completed", "processed"], r.output
