"""Attempts that die or answer late: the supervisor rescues them; stale replies change nothing (SCH4)."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest
from harness import Cluster

pytestmark = pytest.mark.timeout(90)


def final_state(cluster: Cluster, task: int) -> str | None:
    return cluster.final_state(task)


def step_row(cluster: Cluster, task: int, idx: int = 0) -> dict[str, Any]:
    row = cluster.one("SELECT * FROM steps WHERE task_id = ? AND idx = ?", task, idx)
    row["result"] = json.loads(row["result"]) if row["result"] else None
    return row


def test_agent_killed_mid_step_is_rescued_and_the_step_completes_once(cluster: Cluster) -> None:
    boss = cluster.start("boss", "scheduler,supervisor")
    doomed = cluster.start("agent1", "agent")
    # Attempt 1 blocks far past its 2 s complete-by; attempt 2 is quick.
    task = cluster.submit("blocking", {"sleep": {"1": 60}})

    started = cluster.wait(
        lambda: cluster.executions("task_id = ? AND attempt = 1", task), 15, "attempt 1 to start in agent1"
    )
    assert started[0]["pid"] == doomed.pid
    doomed.signal(signal.SIGKILL)
    assert doomed.popen.wait(timeout=10) == -signal.SIGKILL
    fresh = cluster.start("agent2", "agent")

    assert cluster.wait(lambda: final_state(cluster, task), 30, "the task to finish") == "processed"

    view = cluster.show(task)
    step = view["steps"][0]
    assert (step["state"], step["attempt"], step["failure_count"]) == ("completed", 2, 1)
    assert view["failure_count"] == 1
    # One request per attempt: the killed agent's expired, the fresh agent's answered.
    attempts = [(a["attempt"], a["kind"], a["outcome"], a["taken_by"]) for a in step["attempts"]]
    assert attempts == [(1, "do", "expired", doomed.identity), (2, "do", "ok", fresh.identity)]

    term = cluster.one("SELECT term FROM leases WHERE name = 'supervisor'")["term"]
    rescued = cluster.events(task, "rescued")
    assert [(e["attempt"], e["actor"], e["detail"]["term"]) for e in rescued] == [(1, boss.identity, term)]
    # Rescued as soon as the supervisor saw agent1's process gone, before complete-by passed.
    assert "presumed dead: process" in rescued[0]["detail"]["reason"]
    assert rescued[0]["detail"]["late_by"] < 0
    completed = cluster.events(task, "step_completed")
    assert [(e["step_idx"], e["attempt"]) for e in completed] == [(0, 2)]
    assert [r["attempt"] for r in cluster.sql("SELECT attempt FROM replies WHERE task_id = ?", task)] == [2]

    # The application's log: attempt 1 started in the killed process and never ended; the effect
    # was produced exactly once, by attempt 2 in the fresh agent, and that is the step's result.
    runs = cluster.executions("task_id = ?", task)
    assert [(r["attempt"], r["pid"], r["outcome"]) for r in runs] == [
        (1, doomed.pid, None),
        (2, fresh.pid, "ok"),
    ]
    assert runs[0]["ended_at"] is None
    assert step_row(cluster, task)["result"] == runs[1]["detail"]
    assert boss.alive() and fresh.alive()


def test_a_dead_workers_step_is_rescued_in_seconds_not_at_complete_by(cluster: Cluster) -> None:
    """SIGKILL: the supervisor, on the same machine, sees the process gone at its next sweep."""
    cluster.start("boss", "scheduler,supervisor")
    doomed = cluster.start("agent1", "agent")
    task = cluster.submit("long", {"sleep": {"1": 120}})  # complete-by 30 s
    cluster.wait(lambda: cluster.executions("task_id = ? AND attempt = 1", task), 15, "attempt 1 to start")
    doomed.signal(signal.SIGKILL)
    killed = time.time()
    cluster.start("agent2", "agent")
    assert cluster.wait(lambda: final_state(cluster, task), 20, "the task to finish") == "processed"
    rescued = cluster.events(task, "rescued")
    assert len(rescued) == 1 and "process" in rescued[0]["detail"]["reason"]
    assert rescued[0]["at"] - killed < 3.0  # a sweep interval (1 s) and a round trip, not 30 s
    assert [r["attempt"] for r in cluster.sql("SELECT attempt FROM replies WHERE task_id = ?", task)] == [2]


def test_a_silent_worker_is_presumed_dead_after_its_heartbeat_stops(cluster: Cluster) -> None:
    """SIGSTOP: the process still exists, but it no longer beats; after dead_after (3 s) its step
    is rescued, and when it wakes its old attempt's reply is stale."""
    cluster.start("boss", "scheduler,supervisor")
    frozen = cluster.start("agent1", "agent")
    task = cluster.submit("long", {"sleep": {"1": 4}})  # complete-by 30 s; attempt 1 runs 4 s
    cluster.wait(lambda: cluster.executions("task_id = ? AND attempt = 1", task), 15, "attempt 1 to start")
    frozen.signal(signal.SIGSTOP)
    frozen.expect_alive = True
    stopped = time.time()
    try:
        cluster.start("agent2", "agent")
        assert cluster.wait(lambda: final_state(cluster, task), 20, "the task to finish") == "processed"
        rescued = cluster.events(task, "rescued")
        assert len(rescued) == 1 and "no heartbeat" in rescued[0]["detail"]["reason"]
        assert 2.0 < rescued[0]["at"] - stopped < 8.0
    finally:
        frozen.signal(signal.SIGCONT)
    # Woken, attempt 1 finishes and replies: stale, and the step keeps attempt 2's result.
    late = cluster.wait(
        lambda: cluster.sql(
            "SELECT status FROM replies WHERE task_id = ? AND attempt = 1 AND status != 'new'", task
        ),
        20,
        "the woken agent's late reply to be judged",
    )
    assert late[0]["status"] == "stale"
    assert step_row(cluster, task)["attempt"] == 2 and cluster.task_state(task) == "processed"
    assert frozen.alive()


def test_late_reply_from_an_old_attempt_is_stale_and_changes_nothing(cluster: Cluster) -> None:
    cluster.start("w1")
    # A plain function: attempt 1 runs 4.5 s, past its 3 s complete-by, and cannot be interrupted;
    # attempt 2 takes 1.5 s, the window in which an old attempt's reply turns up.
    task = cluster.submit("blocking-sync", {"sleep": {"1": 4.5, "2": 1.5}})

    cluster.wait(lambda: cluster.executions("task_id = ? AND attempt = 2", task), 20, "attempt 2 to start")
    first = cluster.one("SELECT * FROM requests WHERE task_id = ? AND attempt = 1", task)
    assert (first["state"], first["outcome"]) == ("expired", "expired")
    # The old attempt's reply arrives now, while attempt 2 is the current one.
    cluster.send_reply("late-agent", first["id"], "ok", {"late": True, "attempt": 1}, None)
    judged = cluster.wait(
        lambda: cluster.sql("SELECT * FROM replies WHERE request_id = ? AND status != 'new'", first["id"]),
        10,
        "the scheduler to judge the late reply",
    )
    assert judged[0]["status"] == "stale"

    assert cluster.wait(lambda: final_state(cluster, task), 20, "the task to finish") == "processed"
    # The agent never sent attempt 1's late result (AGT4), though its thread did finish the call.
    cluster.wait(
        lambda: cluster.executions("task_id = ? AND attempt = 1 AND ended_at IS NOT NULL", task),
        10,
        "attempt 1's thread to return",
    )
    replies = cluster.sql("SELECT attempt, sent_by, status FROM replies WHERE task_id = ? ORDER BY id", task)
    assert [(r["attempt"], r["status"]) for r in replies] == [(1, "stale"), (2, "accepted")]
    assert replies[0]["sent_by"] == "late-agent"

    stale = cluster.events(task, "stale_reply")
    assert [(e["attempt"], e["detail"]["current_attempt"], e["detail"]["outcome"]) for e in stale] == [
        (1, 2, "ok")
    ]
    completed = cluster.events(task, "step_completed")
    assert [e["attempt"] for e in completed] == [2]
    assert stale[0]["id"] < completed[0]["id"], "the stale reply was judged while attempt 2 ran"

    # Nothing of the stale reply stuck: the result, attempt, failure count and request outcomes
    # are those of the attempts themselves.
    step = step_row(cluster, task)
    run2 = cluster.executions("task_id = ? AND attempt = 2", task)[0]
    assert step["result"] == run2["detail"] and step["result"]["attempt"] == 2
    assert (step["state"], step["attempt"], step["failure_count"]) == ("completed", 2, 1)
    outcomes = cluster.sql("SELECT attempt, outcome FROM requests WHERE task_id = ? ORDER BY attempt", task)
    assert [(r["attempt"], r["outcome"]) for r in outcomes] == [(1, "expired"), (2, "ok")]
    assert len(cluster.events(task, "rescued")) == 1


def test_reply_after_complete_by_is_stale_even_for_the_current_attempt(cluster: Cluster) -> None:
    # No supervisor yet: the expired attempt stays current until we start one.
    cluster.start("w1", "scheduler,agent")
    task = cluster.submit("blocking", {"sleep": {"1": 30}})
    cluster.wait(lambda: cluster.executions("task_id = ? AND attempt = 1", task), 15, "attempt 1 to start")
    complete_by = cluster.one("SELECT complete_by FROM steps WHERE task_id = ?", task)["complete_by"]

    # An async handler is cancelled at complete-by, and the agent sends nothing (AGT4).
    cancelled = cluster.wait(
        lambda: cluster.executions("task_id = ? AND attempt = 1 AND outcome = 'cancelled'", task),
        10,
        "the agent to cancel attempt 1 at complete-by",
    )
    # The agent counts the deadline from just before it sent the transaction that took the
    # request (its wait for a connection or the write lock included), so it may stop that long
    # before the store's complete-by, and never later than a moment after it.
    assert complete_by - 0.5 <= cancelled[0]["ended_at"] <= complete_by + 1
    assert not cluster.sql("SELECT id FROM replies WHERE task_id = ?", task)
    # The late reply must arrive after complete-by by the store's clock (the same host's).
    cluster.wait(lambda: time.time() > complete_by + 0.05, 5, "complete-by to pass")

    request = cluster.one("SELECT * FROM requests WHERE task_id = ? AND attempt = 1", task)
    cluster.send_reply("late-agent", request["id"], "ok", {"late": True}, None)
    judged = cluster.wait(
        lambda: cluster.sql("SELECT * FROM replies WHERE request_id = ? AND status != 'new'", request["id"]),
        10,
        "the scheduler to judge the late reply",
    )
    assert judged[0]["status"] == "stale"
    assert judged[0]["received_at"] > complete_by
    step = step_row(cluster, task)
    assert (step["state"], step["attempt"], step["result"]) == ("running", 1, None)
    assert cluster.task_state(task) == "processing"

    # A supervisor now rescues the expired attempt and attempt 2 completes normally.
    cluster.start("sup", "supervisor")
    assert cluster.wait(lambda: final_state(cluster, task), 20, "the task to finish") == "processed"
    step = step_row(cluster, task)
    assert (step["state"], step["attempt"], step["failure_count"]) == ("completed", 2, 1)
    assert step["result"]["attempt"] == 2
    stale = cluster.events(task, "stale_reply")
    assert [(e["attempt"], e["detail"]["current_attempt"]) for e in stale] == [(1, 1)]
