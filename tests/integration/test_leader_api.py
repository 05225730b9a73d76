"""The leader API for applications (LEAD7): two processes run one coroutine under a named lease.

``tests/apps/leaderapp.py`` runs its coroutine through ``App.run_while_leader``; each process logs
when its coroutine starts and beats. Only the lease holder's coroutine runs; when it is SIGKILLed,
the other process's coroutine starts once the lease has expired, within TTL + retry period of the
kill, measured on the store's own records (``lease_terms``, the database clock).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from harness import APPS, Cluster

pytestmark = pytest.mark.timeout(120)

LEASE = "nightly-report"
TTL, RENEW, RETRY = 2.0, 0.5, 0.5
SLACK = 0.5  # scheduling and transaction latency on a busy test machine


class LeaderProc:
    def __init__(self, cluster: Cluster, name: str) -> None:
        self.name = name
        self.out = cluster.tmp / f"{name}.jsonl"
        self.out.touch()
        env = dict(cluster.env, LEADER_TTL=str(TTL), LEADER_RENEW=str(RENEW), LEADER_RETRY=str(RETRY))
        self.popen = subprocess.Popen(
            [sys.executable, str(APPS / "leaderapp.py"), name, str(self.out)],
            env=env,
            cwd=cluster.tmp,
            stdout=subprocess.PIPE,
            stderr=open(cluster.tmp / f"{name}.log", "ab"),  # noqa: SIM115 - the child owns it
        )
        assert self.popen.stdout is not None
        self.holder = self.popen.stdout.readline().decode().strip()  # NAME:PID:RANDOM
        assert self.holder.startswith(f"{name}:{self.popen.pid}:"), self.holder

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        rows = [json.loads(ln) for ln in self.out.read_text().splitlines()]
        return [r for r in rows if kind is None or r["event"] == kind]

    def end(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)


def test_one_process_runs_the_coroutine_and_the_other_takes_over_after_a_kill(cluster: Cluster) -> None:
    procs = [LeaderProc(cluster, "report-a"), LeaderProc(cluster, "report-b")]
    try:

        def lease() -> dict[str, Any] | None:
            rows = cluster.sql("SELECT * FROM leases WHERE name = ?", LEASE)
            return rows[0] if rows and rows[0]["expires_at"] > time.time() else None

        first = cluster.wait(lease, 20, "a process to take the lease")
        leader = next(p for p in procs if p.holder == first["holder"])
        other = next(p for p in procs if p is not leader)
        cluster.wait(lambda: len(leader.events("beat")) >= 10, 10, "the leader's coroutine to beat")
        time.sleep(2 * TTL)  # several renewals: the follower keeps campaigning and must not run
        assert [e["term"] for e in leader.events("start")] == [first["term"]]
        assert other.events() == [], "the follower ran the coroutine while the leader held the lease"

        frozen = cluster.one("SELECT * FROM leases WHERE name = ?", LEASE)
        leader.popen.send_signal(signal.SIGKILL)
        killed = time.time()
        leader.popen.wait(timeout=10)
        # the last renewal that reached the store before the kill may be later than `frozen`
        last = cluster.one("SELECT * FROM leases WHERE name = ?", LEASE)
        assert (last["holder"], last["term"]) == (frozen["holder"], frozen["term"])

        def taken() -> dict[str, Any] | None:
            rows = cluster.sql("SELECT * FROM lease_terms WHERE name = ? AND term > ?", LEASE, first["term"])
            return rows[0] if rows else None

        term = cluster.wait(taken, TTL + RETRY + 10, "the other process to take the lease")
        cluster.wait(lambda: other.events("start"), 5, "the other process's coroutine to start")
        started = other.events("start")[0]
    finally:
        for p in procs:
            p.end()

    took = term["acquired_at"] - killed
    assert term["holder"] == other.holder and term["term"] == first["term"] + 1
    # never before the dead leader's lease ran out (database clock) ...
    assert term["acquired_at"] >= last["expires_at"]
    # ... and within TTL + retry period of the kill
    assert took <= TTL + RETRY + SLACK, f"took over {took:.2f}s after the kill"
    assert started["term"] == term["term"] and started["at"] >= term["acquired_at"] - 0.05
    # the two coroutines never ran at the same time
    assert max(e["at"] for e in leader.events()) < started["at"]
    assert [e["term"] for e in other.events("start")] == [term["term"]]
    print(f"takeover {took:.2f}s after SIGKILL (TTL {TTL}s + retry {RETRY}s)")
