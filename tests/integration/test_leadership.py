"""The supervisor lease across real processes: a paused leader is fenced, a stopped one resigns (LEAD1-5)."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from harness import Cluster, WorkerProc

from stepwarden import LeaseSettings

pytestmark = pytest.mark.timeout(90)

TTL = LeaseSettings().ttl
FLAKY_TASKS = 6


def lease(cluster: Cluster) -> dict[str, Any] | None:
    rows = cluster.sql("SELECT * FROM leases WHERE name = 'supervisor'")
    return rows[0] if rows else None


def current_leader(cluster: Cluster, *candidates: WorkerProc) -> tuple[WorkerProc, dict[str, Any]]:
    def held() -> dict[str, Any] | None:
        row = lease(cluster)
        return row if row and row["expires_at"] > time.time() else None

    row = cluster.wait(held, 15, "a supervisor to hold the lease")
    by_identity = {w.identity: w for w in candidates}
    assert row["holder"] in by_identity, row
    return by_identity[row["holder"]], row


def test_paused_leader_is_fenced_and_does_not_come_back(cluster: Cluster) -> None:
    sups = [cluster.start("sup1", "supervisor"), cluster.start("sup2", "supervisor")]
    cluster.start("work", "scheduler,agent")
    old, first = current_leader(cluster, *sups)
    new = next(s for s in sups if s is not old)
    old_term = first["term"]

    cluster.pause(old)
    paused = time.monotonic()
    frozen = lease(cluster)  # the paused leader can renew no more: this is its lease's last word
    assert frozen is not None and (frozen["holder"], frozen["term"]) == (old.identity, old_term)

    def taken_over() -> dict[str, Any] | None:
        row = lease(cluster)
        return row if row and row["holder"] == new.identity and row["term"] > old_term else None

    took = cluster.wait(taken_over, TTL + 10, f"{new.name} to take the lease from the paused {old.name}")
    new_term = took["term"]
    # Taken once the paused leader had been silent for dead_after (3 s): from a holder presumed
    # dead the supervisor's lease is taken before it expires; its writes are fenced by the term.
    beat = cluster.one("SELECT heartbeat_at FROM workers WHERE id = ?", old.identity)["heartbeat_at"]
    assert took["acquired_at"] >= beat + 3.0 or took["acquired_at"] >= frozen["expires_at"]
    (acquired,) = [e for e in cluster.events(kind="lease_acquired") if e["detail"]["term"] == took["term"]]
    assert acquired["detail"].get("taken_from") in (None, old.identity)
    assert old.stopped()

    # Work that expires around the moment the ex-leader wakes up: each task's first two attempts
    # block past their 1 s complete-by, so the supervisor must rescue each twice.
    tasks = [cluster.submit("flaky", {"sleep": {"1": 30, "2": 30}}) for _ in range(FLAKY_TASKS)]
    cluster.wait(
        lambda: len(cluster.executions("attempt = 1")) == FLAKY_TASKS, 15, "every first attempt to start"
    )
    # Keep it stopped for longer than the TTL in all (a deliberate pause length, not a wait).
    time.sleep(max(0.0, TTL + 1 - (time.monotonic() - paused)))
    old.signal(signal.SIGCONT)
    resumed = time.time()

    seen: set[tuple[str, int]] = set()

    def all_processed() -> bool:
        row = lease(cluster)
        assert row is not None
        seen.add((row["holder"], row["term"]))
        states = [cluster.task_state(t) for t in tasks]
        return all(s == "processed" for s in states)

    cluster.wait(all_processed, 40, "every flaky task to be processed")

    # Every rescue since the takeover was made by the new leader under the new term.
    rescued = [e for e in cluster.events(kind="rescued") if e["at"] >= took["acquired_at"]]
    assert sorted((e["task_id"], e["attempt"]) for e in rescued) == sorted(
        (t, a) for t in tasks for a in (1, 2)
    )
    assert {(e["actor"], e["detail"]["term"]) for e in rescued} == {(new.identity, new_term)}
    assert not [e for e in cluster.events(kind="rescued") if e["detail"]["term"] == old_term]

    # The ex-leader wrote nothing at all once the new term began, though it ran on.
    late = cluster.sql(
        "SELECT kind, at FROM events WHERE actor = ? AND at >= ?", old.identity, took["acquired_at"]
    )
    assert late == []
    terms = cluster.sql("SELECT * FROM lease_terms WHERE name = 'supervisor' ORDER BY term")
    assert [(t["term"], t["holder"]) for t in terms][-2:] == [
        (old_term, old.identity),
        (new_term, new.identity),
    ]
    assert new_term == old_term + 1
    old_row, new_row = terms[-2], terms[-1]
    assert old_row["ended_at"] is not None and old_row["ended_at"] <= new_row["acquired_at"] + 0.001
    assert new_row["ended_at"] is None

    # It did not regain the lease while the new leader kept renewing it: the new leader renews
    # after the ex-leader woke (waited for: the work may all be done within one renewal period).
    assert seen == {(new.identity, new_term)}

    def renewed_after_resume() -> dict[str, Any] | None:
        row = lease(cluster)
        return row if row is not None and row["renewed_at"] > resumed else None

    now = cluster.wait(renewed_after_resume, TTL, "the new leader to renew after the ex-leader woke")
    assert (now["holder"], now["term"]) == (new.identity, new_term)
    assert now["expires_at"] > time.time()

    # And it is alive and well: its heartbeat moves on after it was continued.
    def beat_after_resume() -> bool:
        row = cluster.one("SELECT heartbeat_at FROM workers WHERE id = ?", old.identity)
        beat: float = row["heartbeat_at"]
        return beat > resumed

    cluster.wait(beat_after_resume, 10, f"{old.name} to beat again after SIGCONT")
    assert old.alive() and new.alive()
    assert f"stops leading term {old_term}" in old.log_text()
    last = lease(cluster)
    assert last is not None and last["holder"] == new.identity


def test_sigterm_resigns_the_lease_and_a_successor_takes_over_at_once(cluster: Cluster) -> None:
    sups = [cluster.start("sup1"), cluster.start("sup2")]
    leader, before = current_leader(cluster, *sups)
    other = next(s for s in sups if s is not leader)
    old_term = before["term"]

    sent = time.monotonic()
    leader.signal(signal.SIGTERM)
    assert leader.popen.wait(timeout=10) == 0
    exited = time.monotonic() - sent
    assert exited < 5, f"the leader took {exited:.1f}s to shut down"

    def taken() -> dict[str, Any] | None:
        row = lease(cluster)
        return row if row and row["holder"] == other.identity and row["term"] > old_term else None

    took = cluster.wait(taken, 5, f"{other.name} to take the lease")
    assert took["term"] == old_term + 1
    # On the store's clock: the successor took over within a retry period of the resignation,
    # long before the old lease would have run out by itself.
    terms = {t["term"]: t for t in cluster.sql("SELECT * FROM lease_terms WHERE name = 'supervisor'")}
    gap = terms[old_term + 1]["acquired_at"] - terms[old_term]["ended_at"]
    assert 0 <= gap <= 2.0, f"{gap:.2f}s between resignation and takeover"
    assert took["acquired_at"] < before["expires_at"], "the successor waited for the TTL: no resignation"
    resigned = cluster.events(kind="lease_resigned")
    assert [(e["actor"], e["detail"]["term"]) for e in resigned] == [(leader.identity, old_term)]
    assert (
        cluster.one("SELECT stopped_at FROM workers WHERE id = ?", leader.identity)["stopped_at"] is not None
    )
    assert other.alive()
