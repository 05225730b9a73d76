"""The host's wall clock steps while workers run (an NTP step, a resumed virtual machine), for real.

The workers import ``tests/apps/clockstep.py``, whose ``time.time`` is the real time plus an
offset the test writes to a file; on SQLite the database's clock is the host's wall clock
(``sw_now()``), so every worker's view of the store's clock steps with it. SQLite only: on
PostgreSQL the database's clock is the server's, which a test cannot step without stepping the
machine's (``tests/contract/test_claim_clock_step.py`` covers both stores on the fake clock, and
``tests/unit/test_clock_step_judges.py`` the supervisor's and the lease's judges of heartbeats).
The test's own process is not stepped: it only submits and reads.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from clockstep import OFFSET_ENV
from harness import Cluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, f"sqlite:///{tmp_path / 'store.db'}")
    c.env[OFFSET_ENV] = str(tmp_path / "clock-offset")
    step_clock(c, 0.0)
    try:
        yield c
    finally:
        c.close()


def step_clock(c: Cluster, offset: float) -> None:
    """Every stepped worker's wall clock is now ``offset`` seconds off the real one (written whole:
    a worker reading the file as it is written must not see half a number)."""
    path = Path(c.env[OFFSET_ENV])
    part = path.with_suffix(".part")
    part.write_text(repr(offset))
    os.replace(part, path)


def agent_beat(c: Cluster) -> float:
    return float(c.one("SELECT heartbeat_at FROM workers WHERE id LIKE 'agent:%'")["heartbeat_at"])


def test_steps_of_the_clock_forward_do_not_make_live_workers_look_dead(cluster: Cluster) -> None:
    """Three steps forward of 3.5 s (more than dead_after, 3 s, less than what is left of the
    supervisor's lease) while steps of 10 s run: every heartbeat looks 4-4.5 s old until the
    next beat, and a supervisor sweeping in between presumed the live worker dead and had its
    steps run a second time beside the first (2 and 6 of 10 in two runs). Each step still runs
    once, and nobody is presumed dead."""
    # The supervisor judges the agent, another process: its own worker's steps it never judges.
    workers = [
        cluster.start("boss", "scheduler,supervisor", app="clockstep:app"),
        cluster.start("agent", "agent", app="clockstep:app"),
    ]
    # The supervisor judges heartbeats once its term has run HEARTBEATS_SETTLE (5 s).
    lease = cluster.wait(
        lambda: cluster.sql("SELECT acquired_at FROM leases WHERE name = 'supervisor'"), 20, "a leader"
    )
    cluster.wait(lambda: time.time() - lease[0]["acquired_at"] > 6.0, 20, "the leader's term to settle")
    ids = [cluster.submit("long", {"sleep": {"1": 10}}) for _ in range(6)]
    cluster.wait(lambda: len(cluster.executions("kind = 'do'")) >= 6, 20, "every step to be running")
    for n in (1, 2, 3):
        # Right after the agent's beat: the supervisor, sweeping every second, sweeps before the
        # agent's next beat (stepped at any moment, the two loops' phases decided whether it did).
        last = agent_beat(cluster)

        def beaten(b: float = last) -> bool:
            return agent_beat(cluster) != b

        cluster.wait(beaten, 10, "the agent's next heartbeat")
        offset = 3.5 * n
        step_clock(cluster, offset)
        stepped = time.time() + offset

        def beaten_since(at: float = stepped) -> bool:
            beats = cluster.sql("SELECT heartbeat_at FROM workers WHERE stopped_at IS NULL")
            return len(beats) == 2 and all(b["heartbeat_at"] >= at - 0.05 for b in beats)

        cluster.wait(beaten_since, 10, f"both workers to beat on the clock stepped {offset:g} s")
    cluster.wait(lambda: all(cluster.final_state(t) for t in ids), 60, "every task to finish")
    assert {cluster.final_state(t) for t in ids} == {"processed"}
    runs = Counter(e["task_id"] for e in cluster.executions("kind = 'do'"))
    assert runs == Counter({t: 1 for t in ids}), f"steps ran twice after a clock step: {runs}"
    for w in workers:
        assert "presumed dead" not in w.log_text(), w.log_text()


def test_tasks_ready_before_the_clock_steps_back_are_taken_at_once(cluster: Cluster) -> None:
    """Tasks submitted before a step back of ten minutes: their run_at lay ten minutes ahead of the
    stepped clock, and the scheduler's claim left them for those ten minutes."""
    ids = [cluster.submit("one", {"n": i}) for i in range(10)]
    step_clock(cluster, -600.0)
    cluster.start("w", app="clockstep:app")
    cluster.wait(lambda: all(cluster.final_state(t) for t in ids), 20, "the tasks submitted before the step")
    assert {cluster.final_state(t) for t in ids} == {"processed"}
