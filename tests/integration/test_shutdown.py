"""An agent stopped gracefully mid-step hands its attempt back at once and exits (DEP4)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import shutapp
from harness import Cluster, WorkerProc, load_tcpproxy

from stepwarden import cli as stepwarden_cli
from stepwarden.agent import AgentSettings

pytestmark = pytest.mark.timeout(90)

GRACE = AgentSettings().shutdown_grace
EXIT_WITHIN = GRACE + 5  # the grace period, then cancelling, releasing and closing down


def sigterm_and_wait_for_exit(leaving: WorkerProc, what: str, sig: signal.Signals = signal.SIGTERM) -> None:
    """SIGTERM (or ``sig``), then its exit code 0 within EXIT_WITHIN."""
    code, took = leaving.stop(sig, EXIT_WITHIN)
    assert code == 0, f"the {what} did not exit within {took:.1f}s of {sig.name}:\n{leaving.log_text()}"


def stop_agent_mid_step(cluster: Cluster, workflow: str) -> WorkerProc:
    cluster.start("boss", "scheduler,supervisor")
    leaving = cluster.start("agent1", "agent")
    # Attempt 1 would run for a minute, inside a 30 s complete-by; attempt 2 is quick.
    task = cluster.submit(workflow, {"sleep": {"1": 60}})
    cluster.wait(lambda: cluster.executions("task_id = ? AND attempt = 1", task), 15, "attempt 1 to start")
    staying = cluster.start("agent2", "agent")

    sigterm_and_wait_for_exit(leaving, "agent")

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
    log = leaving.log_text()  # every stop write made: the plain last line, no warning of one given up
    assert f"worker {leaving.identity} stopped\n" in log and "the store not answering" not in log, log[-3000:]
    return leaving


def test_sigterm_agent_mid_async_step_releases_the_attempt(cluster: Cluster) -> None:
    stop_agent_mid_step(cluster, "long")
    run1 = cluster.executions("attempt = 1")
    assert [r["outcome"] for r in run1] == ["cancelled"]


def test_sigterm_agent_mid_plain_function_step_still_exits(cluster: Cluster) -> None:
    leaving = stop_agent_mid_step(cluster, "long-sync")
    # The call's thread runs on (a daemon thread of the agent's pool): the exit says so, and
    # counts that one call, not the store's or any other thread.
    log = leaving.log_text()
    stuck = r"exiting with 1 operation or alert-sink thread\(s\) still running"
    assert re.search(stuck, log), log[-3000:]


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


def test_sigterm_with_postgres_unreachable_exits_in_seconds_its_step_rescued(pg_cluster: Cluster) -> None:
    """DEP4 and REL3 with the database gone: every write of the stop (the release of the running
    attempt, the instances' stop, the hand-back, the stop record) is bounded, and once one has
    found the server unreachable the rest are brief tries, so the stop takes seconds: 33.5 s were
    measured when each waited out its own 5 s bound, past Kubernetes' default 30 s grace. What
    it could not write is what a dead worker leaves: the next worker rescues the step."""
    from urllib.parse import urlsplit

    tcpproxy = load_tcpproxy()
    direct = urlsplit(pg_cluster.url)
    if direct.hostname not in ("127.0.0.1", "localhost", "::1"):  # the proxy stays on loopback
        pytest.skip(f"the test server is not reached over loopback TCP ({direct.hostname!r})")
    proxy = tcpproxy.ProxyThread(direct.hostname, direct.port or 5432)
    try:
        user = direct.netloc.rpartition("@")[0]  # with its password, if it has one
        proxied = direct._replace(
            netloc=f"{user}@127.0.0.1:{proxy.port}" if user else f"127.0.0.1:{proxy.port}"
        )
        proxied_url = proxied.geturl()
        task = pg_cluster.submit("long", {"sleep": {"1": 120}})  # complete-by 30 s
        leaving = pg_cluster.start("cut-off", db=proxied_url)
        started = lambda: pg_cluster.executions("task_id = ? AND attempt = 1", task)  # noqa: E731
        pg_cluster.wait(started, 20, "step 1 to start")
        pg_cluster.wait(lambda: lease_holder(pg_cluster) == leaving.identity, 20, "the worker to lead")
        proxy.close()  # connections reset, new ones refused: the server is gone for this worker
        pg_cluster.wait(lambda: "LISTEN connection lost" in leaving.log_text(), 10, "the worker to notice")
        code, took = leaving.stop(signal.SIGTERM, 60)
    finally:
        proxy.close()
    log = leaving.log_text()
    assert code == 0, f"exit {code} after {took:.1f}s:\n{log[-4000:]}"
    # At most: a round in flight waiting for a connection (the pool's 5 s), the grace period
    # (the call is cancelled at its end, within 1 s), then five brief tries of 1 s (the release,
    # the instances' stop, the hand-back, the heartbeat in flight, the stop record) and the close:
    # about 17 s on a loaded machine. With each write waiting its full 5 s: 30 s and more.
    assert took < GRACE + 17, f"took {took:.1f}s to stop:\n{log[-4000:]}"
    assert "could not release them (they will expire)" in log
    assert "could not record its stop" in log
    # The last line says what the warnings add up to: which writes were given up, and what next.
    last = re.search(
        rf"worker {re.escape(leaving.identity)} stopped, the store not answering: (\d+) of its", log
    )
    assert last is not None and int(last.group(1)) >= 3, log[-3000:]
    # Nothing of the stop reached the store: the worker looks alive until its heartbeat is old.
    row = pg_cluster.one("SELECT stopped_at FROM workers WHERE id = ?", leaving.identity)
    assert row["stopped_at"] is None
    assert step_attempt(pg_cluster, task) == 1
    pg_cluster.start("next")
    assert pg_cluster.wait(lambda: pg_cluster.final_state(task), 30, "the task to end") == "processed"
    rescued = pg_cluster.events(task, "rescued")
    assert len(rescued) == 1 and "presumed dead" in rescued[0]["detail"]["reason"]


def step_attempt(cluster: Cluster, task: int) -> int:
    return int(cluster.one("SELECT attempt FROM steps WHERE task_id = ? AND idx = 0", task)["attempt"])


# -- a lone worker running every role, stopped mid-step ------------------------------------------
# No other worker runs: nothing but the stopping worker itself can take what it dispatches, and
# what it leaves locked waits for the next worker. DEP4: it must leave nothing held by its
# identity, so that the next worker, started at once or after any pause, runs the task with no
# failure counted and without waiting for a complete-by.


def start_lone_worker_mid_step(cluster: Cluster, workflow: str, seconds: float) -> tuple[int, WorkerProc]:
    """Submit a two-step task whose step 1 runs ``seconds``, and start the only worker: returned
    once step 1 runs, and the worker leads the supervisors (its lease, resigned as it stops)."""
    app = shutapp.make_app(cluster.url)
    try:
        task = app.submit(workflow, {"sleep": {"1": seconds}})
    finally:
        app.close()
    leaving = cluster.start("lone", app="shutapp:app")
    cluster.wait(lambda: cluster.executions("task_id = ? AND step = 'first'", task), 20, "step 1 to start")
    cluster.wait(lambda: lease_holder(cluster) == leaving.identity, 20, "the worker to lead")
    return task, leaving


def assert_nothing_held(cluster: Cluster, task: int, leaving: WorkerProc) -> None:
    """Gone, the worker left nothing held by its identity: no step ``running``, no task or step
    locked by it, no request queued that only it would have taken; its lease resigned."""
    steps = cluster.sql("SELECT name, state, locked_by FROM steps WHERE task_id = ? ORDER BY idx", task)
    assert [s["name"] for s in steps if s["state"] == "running"] == [], steps
    assert cluster.sql("SELECT task_id, idx FROM steps WHERE locked_by = ?", leaving.identity) == []
    assert cluster.sql("SELECT id FROM tasks WHERE locked_by = ?", leaving.identity) == []
    assert cluster.sql("SELECT id FROM requests WHERE state IN ('queued', 'taken')") == []
    assert cluster.task_state(task) == "pending"  # claimable at once
    assert resigned_by(cluster, leaving.identity)
    # On the machine's clock, as both stores' (see the restart test below): free for the next.
    lease = cluster.one("SELECT holder, expires_at FROM leases WHERE name = 'supervisor'")
    assert lease["expires_at"] <= time.time(), lease


def lease_holder(cluster: Cluster) -> str | None:
    rows = cluster.sql("SELECT holder FROM leases WHERE name = 'supervisor'")
    return str(rows[0]["holder"]) if rows and rows[0]["holder"] else None


def resigned_by(cluster: Cluster, identity: str) -> bool:
    """Whether ``identity`` resigned the supervisor lease (recorded with the resignation)."""
    return any(
        e["actor"] == identity and e["detail"].get("lease") == "supervisor"
        for e in cluster.events(kind="lease_resigned")
    )


def assert_released_uncounted(cluster: Cluster, task: int, released: tuple[int, int]) -> None:
    """The attempt ``released`` (step index, attempt) was handed back, not failed: no failure
    counted, no rescue, no retry scheduled."""
    assert [(e["step_idx"], e["attempt"]) for e in cluster.events(task, "released")] == [released]
    view = cluster.show(task)
    assert view["failure_count"] == 0
    assert [(s["name"], s["failure_count"]) for s in view["steps"]] == [("first", 0), ("second", 0)]
    assert not cluster.events(task, "rescued")
    assert not cluster.events(task, "retry_scheduled")


def stop_lone_worker_mid_step(
    cluster: Cluster, workflow: str, seconds: float, sig: signal.Signals = signal.SIGTERM
) -> tuple[int, WorkerProc]:
    """Submit a two-step task whose step 1 runs ``seconds``, SIGTERM (or ``sig``) the only worker
    while step 1 runs, and check that it exits 0 leaving nothing held by its identity."""
    task, leaving = start_lone_worker_mid_step(cluster, workflow, seconds)
    sigterm_and_wait_for_exit(leaving, "worker", sig)
    assert_nothing_held(cluster, task, leaving)
    return task, leaving


def assert_processed_without_failure(cluster: Cluster, task: int, released: tuple[int, int]) -> None:
    """The task ended ``processed``, with no failure counted anywhere and no rescue, and exactly
    one attempt was handed back: ``released`` as (step index, attempt)."""
    assert cluster.task_state(task) == "processed"
    view = cluster.show(task)
    assert view["failure_count"] == 0
    assert [(s["name"], s["failure_count"]) for s in view["steps"]] == [("first", 0), ("second", 0)]
    assert not cluster.events(task, "rescued")
    assert not cluster.events(task, "retry_scheduled")
    assert [(e["step_idx"], e["attempt"]) for e in cluster.events(task, "released")] == [released]


def next_worker_finishes(cluster: Cluster, task: int, released: tuple[int, int]) -> WorkerProc:
    """A fresh worker, started after the lone one stopped, ends the task (waited for until it is
    final, so an ``error`` fails at once): processed, with no failure counted."""
    staying = cluster.start("next", app="shutapp:app")
    cluster.wait(lambda: cluster.task_state(task) in ("processed", "error"), 20, "the task to end")
    assert_processed_without_failure(cluster, task, released=released)
    return staying


def test_sigterm_lone_worker_hands_back_the_step_it_dispatched_while_stopping(cluster: Cluster) -> None:
    """Step 1 ends inside the grace period; its reply is applied (its result is durable) and
    dispatches step 2, which the stopping worker's agents no longer take. The worker hands that
    attempt back on its way out, so the next worker runs it at once: long before its complete-by
    (60 s, past this test's deadlines), where a rescue would have counted a failure."""
    task, leaving = stop_lone_worker_mid_step(cluster, "two-long", 1.5)  # well inside the 5 s grace
    first = cluster.one("SELECT state, result FROM steps WHERE task_id = ? AND idx = 0", task)
    assert first["state"] == "completed" and first["result"]  # the case under test: step 1 finished

    staying = next_worker_finishes(cluster, task, released=(1, 1))
    second = cluster.show(task)["steps"][1]
    attempts = [(a["attempt"], a["outcome"], a["dispatched_by"]) for a in second["attempts"]]
    assert attempts == [(1, "released", leaving.identity), (2, "ok", staying.identity)]
    runs = cluster.executions("task_id = ? AND outcome = 'ok'", task)
    assert [(r["step"], r["attempt"], r["pid"]) for r in runs] == [
        ("first", 1, leaving.pid),
        ("second", 2, staying.pid),
    ]


def test_sigterm_lone_worker_restarted_after_the_steps_budget_counts_no_failure(cluster: Cluster) -> None:
    """The same stop, and the next worker starts only once step 2's first attempt would have
    passed its complete-by (a restart that takes a while). Left dispatched, that attempt would be
    rescued as failed, and with ``max_failures=1`` the task would end in ``error`` with an alert;
    handed back, it is simply dispatched again."""
    task, _ = stop_lone_worker_mid_step(cluster, "two-short", 1.5)
    budget = cluster.one("SELECT budget FROM steps WHERE task_id = ? AND idx = 1", task)["budget"]
    assert budget == shutapp.SHORT_BUDGET
    # Both stores read this machine's clock: wait until step 2's first attempt has expired.
    expiry = cluster.one(
        "SELECT complete_by FROM requests WHERE task_id = ? AND step_idx = 1 AND attempt = 1", task
    )["complete_by"]
    cluster.wait(lambda: time.time() > expiry + 0.5, budget + 5, "step 2's first attempt to expire")

    next_worker_finishes(cluster, task, released=(1, 1))
    assert not cluster.sql("SELECT id FROM alerts WHERE task_id = ?", task)


def test_sigterm_lone_worker_mid_step_past_the_grace_releases_it_at_once(cluster: Cluster) -> None:
    """Step 1 outlasts the grace period: the call is cancelled and its attempt released, and,
    since no scheduler of this worker runs any more, the release is applied in the same
    transaction: the step is ``pending`` when the worker has gone, not ``running`` and locked by
    it until the next scheduler applies the release."""
    task, leaving = stop_lone_worker_mid_step(cluster, "two-long", 60)
    assert [r["outcome"] for r in cluster.executions("task_id = ?", task)] == ["cancelled"]

    staying = next_worker_finishes(cluster, task, released=(0, 1))
    first = cluster.show(task)["steps"][0]
    attempts = [(a["attempt"], a["outcome"], a["taken_by"]) for a in first["attempts"]]
    assert attempts == [(1, "released", leaving.identity), (2, "ok", staying.identity)]


def test_sigint_lone_worker_mid_step_past_the_grace_releases_it_at_once(cluster: Cluster) -> None:
    """SIGINT (Ctrl-C where the worker runs in a terminal) stops it as SIGTERM does: the call
    past the grace period cancelled, its attempt released uncounted and applied, the task
    pending and unlocked, the supervisor lease resigned; the next worker runs it at once."""
    task, leaving = stop_lone_worker_mid_step(cluster, "two-long", 60, sig=signal.SIGINT)
    assert [r["outcome"] for r in cluster.executions("task_id = ?", task)] == ["cancelled"]
    assert_released_uncounted(cluster, task, released=(0, 1))
    assert "SIGINT: stopping gracefully" in leaving.log_text()

    next_worker_finishes(cluster, task, released=(0, 1))


# A second signal of the same kind within this of the first is that one delivered twice (see
# stepwarden.cli.REPEAT_WINDOW; older code has none).
AFTER_FIRST = getattr(stepwarden_cli, "REPEAT_WINDOW", 0.0) + 0.05


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_skips_the_rest_of_the_grace_period(cluster: Cluster, second: signal.Signals) -> None:
    """SIGTERM, and while the worker gives its running call the grace period, a second signal:
    the rest of the grace is skipped. The call -- a plain function, which cannot be interrupted,
    due to run two minutes -- is abandoned at once, its attempt released uncounted and applied,
    the hand-back and the stop record as usual; the worker says so in one line and exits 0 long
    before the grace period would have ended (it used to wait all of it, 5 s)."""
    task, leaving = start_lone_worker_mid_step(cluster, "two-long-sync", 120)
    first = time.monotonic()
    leaving.signal(signal.SIGTERM)
    # Stopping: the supervisor lease is resigned at once, while the agent gives its call the grace.
    cluster.wait(lambda: resigned_by(cluster, leaving.identity), 10, "the worker to resign its lease")
    cluster.wait(lambda: time.monotonic() - first >= AFTER_FIRST, 5, "the first signal to be past")
    assert leaving.alive(), leaving.log_text()

    code, took = leaving.stop(second, EXIT_WITHIN)
    log = leaving.log_text()
    assert (code, took < GRACE / 2) == (0, True), f"exit {code} {took:.1f}s after the second signal:\n{log}"
    said = [line for line in log.splitlines() if "stop signal again" in line]
    assert len(said) == 1 and "skipping the rest of the grace period" in said[0], log
    assert "cancelling 1 running call(s) now" in said[0], log

    assert_nothing_held(cluster, task, leaving)
    assert_released_uncounted(cluster, task, released=(0, 1))
    assert cluster.one("SELECT stopped_at FROM workers WHERE id = ?", leaving.identity)["stopped_at"]
    # The call ran on in its thread until the process exited: it never answered.
    runs = cluster.executions("task_id = ?", task)
    assert [(r["step"], r["attempt"], r["outcome"]) for r in runs] == [("first", 1, None)]

    next_worker_finishes(cluster, task, released=(0, 1))


def test_sigterm_with_an_async_call_blocked_in_to_thread_exits_within_the_bound(cluster: Cluster) -> None:
    """An async operation awaiting ``asyncio.to_thread``: the worker stopped after the grace
    period, then ``asyncio.run`` waited, with no bound, for the loop's default executor, and the
    process exited only when the blocking call returned (never, for one that hangs). Its thread
    is now left to the exit, as a plain function's is."""
    task, leaving = start_lone_worker_mid_step(cluster, "two-long-thread", 60)
    sigterm_and_wait_for_exit(leaving, "worker")
    assert "exiting with" in leaving.log_text() and "still running" in leaving.log_text()
    assert_nothing_held(cluster, task, leaving)


def test_stop_signals_that_keep_coming_until_the_exit_do_not_change_its_code(cluster: Cluster) -> None:
    """SIGTERM, then SIGTERM and SIGINT every 20 ms until the process is gone: once the loop had
    closed, a signal fell on the default handlers and the stop, completed, exited 143 or 130."""
    for run in range(2):
        w = cluster.start(f"signalled{run}", "supervisor")
        wait_to_lead(cluster, w)
        w.expect_alive = False
        w.signal(signal.SIGTERM)
        end = time.monotonic() + EXIT_WITHIN
        n = 0
        while w.popen.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
            w.signal(signal.SIGINT if n % 2 else signal.SIGTERM)
            n += 1
        assert w.popen.wait(timeout=5) == 0, f"exit code after {n} more signals:\n{w.log_text()}"


def wait_to_lead(cluster: Cluster, w: WorkerProc) -> None:
    cluster.wait(lambda: lease_holder(cluster) == w.identity, 20, f"worker {w.name} to lead")
