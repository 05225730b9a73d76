"""Steps that keep failing: the task ends in error with an alert, or is undone in reverse (SCH7, CMP2)."""

from __future__ import annotations

import json

import pytest
from harness import Cluster

pytestmark = pytest.mark.timeout(60)

FINAL = ("processed", "error", "compensated", "cancelled")


def finish(cluster: Cluster, task: int, timeout: float = 30) -> str:
    def final() -> str | None:
        state = cluster.task_state(task)
        return state if state in FINAL else None

    return cluster.wait(final, timeout, f"task {task} to finish")


def test_step_failing_every_attempt_ends_in_error_with_an_alert(cluster: Cluster) -> None:
    cluster.start("w1")
    task = cluster.submit("doomed", {"n": 1}, correlation_id="order-doomed")
    assert finish(cluster, task) == "error"

    # What an operator sees, through the CLI.
    [shown] = [t for t in cluster.cli("tasks", "--json") if t["id"] == task]
    assert (shown["state"], shown["failure_count"]) == ("error", 3)
    [step] = shown["steps"]
    assert (step["name"], step["state"], step["attempt"], step["failure_count"]) == ("doomed", "failed", 3, 3)
    alerts = [a for a in cluster.cli("alerts", "--json") if a["task_id"] == task]
    assert [(a["kind"], a["step"]) for a in alerts] == [("task_error", "doomed")]
    assert "doomed" in alerts[0]["message"]
    detail = cluster.cli("task", "show", str(task), "--json")
    assert "transient" in (detail["last_error"] or "")
    assert [(a["attempt"], a["outcome"]) for a in detail["steps"][0]["attempts"]] == [
        (1, "retry"),
        (2, "retry"),
        (3, "retry"),
    ]

    # Each failed attempt counted once; after the third, no retry but an error.
    kinds = [e["kind"] for e in cluster.events(task) if e["kind"] in ("retry_scheduled", "error")]
    assert kinds == ["retry_scheduled", "retry_scheduled", "error"]
    # The app's log: three attempts of two tries each (the in-attempt retries), nothing after.
    runs = cluster.executions("task_id = ?", task)
    assert [(r["attempt"], r["outcome"]) for r in runs] == [(a, "transient") for a in (1, 1, 2, 2, 3, 3)]


def test_permanent_failure_errors_at_once_without_retrying(cluster: Cluster) -> None:
    cluster.start("w1")
    task = cluster.submit("refused", {"n": 1})
    assert finish(cluster, task) == "error"
    view = cluster.show(task)
    assert view["failure_count"] == 1
    first, refused = view["steps"]
    assert (first["state"], refused["state"], refused["attempt"], refused["failure_count"]) == (
        "completed",
        "failed",
        1,
        1,
    )
    runs = cluster.executions("task_id = ?", task)
    assert [(r["step"], r["outcome"]) for r in runs] == [("first", "ok"), ("refused", "permanent")]
    alerts = [a for a in cluster.cli("alerts", "--json") if a["task_id"] == task]
    assert [(a["kind"], a["step"]) for a in alerts] == [("task_error", "refused")]
    assert not cluster.events(task, "retry_scheduled")


def test_step_failing_every_attempt_compensates_earlier_steps_in_reverse(cluster: Cluster) -> None:
    cluster.start("w1")
    task = cluster.submit("undone", {"n": 1})
    assert finish(cluster, task) == "compensated"

    view = cluster.show(task)
    states = [(s["name"], s["state"]) for s in view["steps"]]
    assert states == [("first", "compensated"), ("second", "compensated"), ("third", "failed")]
    assert view["steps"][2]["failure_count"] == 3

    # From the app's log: both steps ran once, then were undone newest first, each undo once,
    # and each undo was handed the result of the step it undid.
    runs = cluster.executions("task_id = ?", task)
    done = {r["step"]: r for r in runs if r["kind"] == "do" and r["outcome"] == "ok"}
    undos = [r for r in runs if r["kind"] == "undo"]
    assert [(r["step"], r["outcome"]) for r in undos] == [("second", "ok"), ("first", "ok")]
    assert undos[0]["ended_at"] <= undos[1]["started_at"]
    assert done["second"]["ended_at"] <= undos[0]["started_at"]
    for u in undos:
        assert u["detail"]["undone"] == done[u["step"]]["detail"]
        assert u["key"] == f"{task}:{u['step']}", "an undo carries the key of the effect it undoes"
    assert [r["step"] for r in runs if r["kind"] == "do"].count("third") == 6  # 3 attempts x 2 tries

    # From the store's events: compensated second, then first, after the escalation.
    kinds = [(e["kind"], e["step_idx"]) for e in cluster.events(task)]
    tail = [k for k in kinds if k[0] in ("escalated", "compensating", "step_compensated", "compensated")]
    assert tail == [
        ("escalated", 2),
        ("compensating", None),
        ("step_compensated", 1),
        ("step_compensated", 0),
        ("compensated", None),
    ]

    # Each compensation was an attempt of its own: a request of kind undo, numbered after the do.
    reqs = cluster.sql(
        "SELECT step_idx, attempt, kind, outcome FROM requests WHERE task_id = ? ORDER BY id", task
    )
    assert [(r["step_idx"], r["attempt"], r["kind"], r["outcome"]) for r in reqs] == [
        (0, 1, "do", "ok"),
        (1, 1, "do", "ok"),
        (2, 1, "do", "retry"),
        (2, 2, "do", "retry"),
        (2, 3, "do", "retry"),
        (1, 2, "undo", "ok"),
        (0, 2, "undo", "ok"),
    ]
    results = {
        r["idx"]: json.loads(r["result"]) if r["result"] else None
        for r in cluster.sql("SELECT idx, result FROM steps WHERE task_id = ?", task)
    }
    assert results[0] == done["first"]["detail"] and results[1] == done["second"]["detail"]
