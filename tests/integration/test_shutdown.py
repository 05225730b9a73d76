"""An agent stopped gracefully mid-step hands its attempt back at once and exits (DEP4)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from stepwarden.agent import AgentSettings

if TYPE_CHECKING:
    from conftest import Cluster

pytestmark = pytest.mark.timeout(90)

GRACE = AgentSettings().shutdown_grace
EXIT_WITHIN = GRACE + 5  # the grace period, then cancelling, releasing and closing down


def stop_agent_mid_step(cluster: Cluster, workflow: str) -> None:
    cluster.start("boss", "scheduler,supervisor")
    leaving = cluster.start("agent1", "agent")
    # Attempt 1 would run for a minute, inside a 30 s complete-by; attempt 2 is quick.
    task = cluster.submit(workflow, {"sleep": {"1": 60}})
    cluster.wait(lambda: cluster.executions("task_id = ? AND attempt = 1", task), 15, "attempt 1 to start")
    staying = cluster.start("agent2", "agent")

    sent = time.monotonic()
    leaving.signal(signal.SIGTERM)
    try:
        code = leaving.popen.wait(timeout=EXIT_WITHIN)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - sent
    if code is None:
        leaving.signal(signal.SIGKILL)  # ours, by pid: do not leave it to the finaliser's deadline
    assert code == 0, f"the agent did not exit within {took:.1f}s of SIGTERM:\n{leaving.log_text()}"

    assert cluster.wait(lambda: cluster.task_state(task) == "processed", 15, "the task to be processed")
    view = cluster.show(task)
    step = view["steps"][0]
    attempts = [(a["attempt"], a["outcome"], a["taken_by"]) for a in step["attempts"]]
    assert attempts == [(1, "released", leaving.identity), (2, "ok", staying.identity)]
    # Handed back, not failed: no failure counted, no rescue, and done long before complete-by.
    assert (step["failure_count"], view["failure_count"]) == (0, 0)
    assert [e["attempt"] for e in cluster.events(task, "released")] == [1]
    assert not cluster.events(task, "rescued")
    deadline = cluster.one("SELECT complete_by FROM requests WHERE task_id = ? AND attempt = 1", task)
    finished = cluster.one("SELECT finished_at FROM tasks WHERE id = ?", task)
    assert finished["finished_at"] < deadline["complete_by"]
    replies = cluster.sql(
        "SELECT attempt, outcome, sent_by, status FROM replies WHERE task_id = ? ORDER BY id", task
    )
    assert [(r["attempt"], r["outcome"], r["sent_by"], r["status"]) for r in replies] == [
        (1, "released", leaving.identity, "accepted"),
        (2, "ok", staying.identity, "accepted"),
    ]
    runs = cluster.executions("task_id = ? AND outcome = 'ok'", task)
    assert [(r["attempt"], r["pid"]) for r in runs] == [(2, staying.pid)]
    assert cluster.one("SELECT stopped_at FROM workers WHERE id = ?", leaving.identity)["stopped_at"]


def test_sigterm_agent_mid_async_step_releases_the_attempt(cluster: Cluster) -> None:
    stop_agent_mid_step(cluster, "long")
    run1 = cluster.executions("attempt = 1")
    assert [r["outcome"] for r in run1] == ["cancelled"]


def test_sigterm_agent_mid_plain_function_step_still_exits(cluster: Cluster) -> None:
    stop_agent_mid_step(cluster, "long-sync")


def test_sigterm_while_another_process_holds_the_sqlite_write_lock_still_exits(tmp_path: Path) -> None:
    """Each of the worker's transactions would wait busy_timeout (30 s) for the lock, one after
    another, and the stop with them (a minute and a half, measured). Stopping bounds every lock
    wait, those in progress too; what the worker could not write is the supervisor's to rescue."""
    import os
    import sqlite3
    import sys

    path = tmp_path / "locked.db"
    url = f"sqlite:///{path}"
    subprocess.run([sys.executable, "-m", "stepwarden", "--db", url, "init"], check=True, capture_output=True)
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "stepwarden", "--db", url, "worker", "--roles", "scheduler,supervisor"],
        stdout=log,
        stderr=log,
        env={k: v for k, v in os.environ.items() if not k.startswith("STEPWARDEN_")},
    )
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        deadline = time.monotonic() + 30
        while not holder.execute("SELECT 1 FROM workers WHERE stopped_at IS NULL").fetchone():
            assert time.monotonic() < deadline and worker.poll() is None, "the worker did not start"
            time.sleep(0.05)
        holder.execute("BEGIN IMMEDIATE")
        time.sleep(1.5)  # the worker's heartbeat and rounds are now waiting for the lock
        sent = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        try:
            code = worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - sent
        assert code == 0, f"exit {code} after {took:.1f}s:\n{(tmp_path / 'worker.log').read_text()[-3000:]}"
        assert took < 20, f"took {took:.1f}s to stop"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        with contextlib.suppress(sqlite3.Error):
            holder.execute("ROLLBACK")
        holder.close()
        log.close()
