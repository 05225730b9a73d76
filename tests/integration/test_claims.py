"""Many schedulers and agents on one store: every task is claimed, dispatched and run exactly once (SCH1)."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
from harness import Cluster

pytestmark = pytest.mark.timeout(90)

TASKS = 200
BURSTS = 10


def test_three_workers_claim_dispatch_and_run_each_step_exactly_once(cluster: Cluster) -> None:
    workers = [cluster.start(f"w{i}") for i in (1, 2, 3)]
    identities = {w.identity for w in workers}

    # In bursts, each one transaction, a little apart: a busy scheduler keeps claiming as long as it
    # finds work, so tasks trickling in one by one would all go to whichever scheduler got there first.
    ids: list[int] = []
    rng = random.Random(TASKS)
    for burst in range(BURSTS):
        with cluster.app.transaction() as tx:
            for n in range(burst * TASKS // BURSTS, (burst + 1) * TASKS // BURSTS):
                ids.append(tx.submit("one", {"n": n}, correlation_id=f"order-{n}"))
        time.sleep(rng.uniform(0.05, 0.35))  # pacing the submissions, not waiting for an outcome

    def all_processed() -> bool:
        n: int = cluster.one("SELECT COUNT(*) AS n FROM tasks WHERE state = 'processed'")["n"]
        return n == TASKS

    cluster.wait(all_processed, 60, f"all {TASKS} tasks to be processed")
    states = Counter(r["state"] for r in cluster.sql("SELECT state FROM tasks"))
    assert states == {"processed": TASKS}

    # The requests table: one row per attempt, every task's one step dispatched once, as attempt 1,
    # taken by exactly one agent of ours, answered ok.
    requests = cluster.sql("SELECT * FROM requests ORDER BY id")
    per_attempt = Counter((r["task_id"], r["step_idx"], r["attempt"]) for r in requests)
    assert sorted(per_attempt) == [(t, 0, 1) for t in ids]
    assert set(per_attempt.values()) == {1}
    for r in requests:
        assert r["kind"] == "do"
        assert r["dispatched_by"] in identities, r
        assert r["taken_by"] in identities, r
        assert (r["state"], r["outcome"]) == ("replied", "ok"), r

    # Each task claimed once, by the scheduler that dispatched its step; one accepted reply each.
    claimed = cluster.events(kind="claimed")
    assert Counter(e["task_id"] for e in claimed) == dict.fromkeys(ids, 1)
    dispatcher = {r["task_id"]: r["dispatched_by"] for r in requests}
    assert all(e["actor"] == dispatcher[e["task_id"]] for e in claimed)
    dispatched = Counter(
        (e["task_id"], e["step_idx"], e["attempt"]) for e in cluster.events(kind="dispatched")
    )
    assert dispatched == per_attempt
    replies = cluster.sql("SELECT request_id, status FROM replies")
    assert Counter(r["request_id"] for r in replies) == {r["id"]: 1 for r in requests}
    assert {r["status"] for r in replies} == {"accepted"}
    assert Counter(e["task_id"] for e in cluster.events(kind="step_completed")) == dict.fromkeys(ids, 1)
    assert not cluster.events(kind="rescued"), "no failure was injected, yet the supervisor rescued steps"

    # The application's own log: each task's step ran exactly once, in the process whose agent took it.
    runs = cluster.executions()
    assert Counter(r["task_id"] for r in runs) == dict.fromkeys(ids, 1)
    taker = {r["task_id"]: cluster.pid_of(r["taken_by"]) for r in requests}
    for run in runs:
        assert (run["step"], run["attempt"], run["kind"], run["outcome"]) == ("only", 1, "do", "ok"), run
        assert run["pid"] == taker[run["task_id"]], run
        assert run["key"] == f"{run['task_id']}:only"

    # The work really was shared: more than one scheduler dispatched and more than one agent ran steps.
    assert len({r["dispatched_by"] for r in requests}) > 1, Counter(r["dispatched_by"] for r in requests)
    assert len({r["taken_by"] for r in requests}) > 1, Counter(r["taken_by"] for r in requests)
