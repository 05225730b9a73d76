"""A worker killed with SIGKILL while a task is being undone leaves no effect standing (REL1, REL2, CMP2).

The service is ``tests/apps/ledgerapp.py``: idempotent by key, with its own books of effects and
its calls logged in the tests' execution log, a file apart from the store under test, so the
verdict does not rest on the store's word. Each test kills a real worker process while a call
hangs *after* the service applied its effect (the reply is lost, as a real service's would be),
starts a fresh worker, waits for the task to end, and checks what a user would check: the task's
final state, the calls the service received (which process, which idempotency key), and the
service's books -- every effect applied at most once and, the task being compensated, every
applied effect undone.

Every test runs on SQLite and on PostgreSQL (the ``cluster`` fixture), and every wait is on a
condition with a deadline.
"""

from __future__ import annotations

import signal
import sqlite3
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import ledgerapp
import pytest
from harness import Cluster, WorkerProc, dict_row

from stepwarden import App
from stepwarden.store import FINAL_TASK_STATES

pytestmark = pytest.mark.timeout(120)

HANG = 60.0  # far past every complete-by: only the kill (or the agent's cancel) ends such a call


@dataclass
class Rig:
    """The ``cluster`` of the integration tests with workers running ``ledgerapp:app``, the
    service's books (beside the cluster's execution log, where each call of the service is an
    execution), and an application object to submit with."""

    cluster: Cluster
    app: App
    _books: sqlite3.Connection | None = field(default=None, repr=False)

    def start(self, name: str, roles: str = "scheduler,agent,supervisor") -> WorkerProc:
        return self.cluster.start(name, roles, app="ledgerapp:app")

    def submit(self, workflow: str, hang: dict[str, list[float]]) -> int:
        return self.app.submit(workflow, {"hang": hang})

    def calls(self, task: int, kind: str | None = None, step: str | None = None) -> list[dict[str, Any]]:
        """The service's calls for the task, in order, each with ``nth``: which call of its kind
        under its key it was (a key is the task's and the step's)."""
        seen: Counter[tuple[str, str]] = Counter()
        out = []
        for c in self.cluster.executions("task_id = ?", task):
            seen[c["key"], c["kind"]] += 1
            c["nth"] = seen[c["key"], c["kind"]]
            if kind in (None, c["kind"]) and step in (None, c["step"]):
                out.append(c)
        return out

    def effects(self, task: int) -> dict[str, tuple[int, int, int]]:
        """Key -> (applied, undone, tombstoned) for every key of the task, from the service's books,
        read with an autocommit connection of its own (WAL: never waits)."""
        if self._books is None:
            self._books = ledgerapp.connect_books(str(self.cluster.log_path))
            self._books.row_factory = dict_row
        rows = self._books.execute("SELECT * FROM effects WHERE key LIKE ? ORDER BY key", (f"{task}:%",))
        return {r["key"]: (r["applied"], r["undone"], r["tombstoned"]) for r in rows}

    def hanging(self, task: int, kind: str, step: str, nth: int = 1) -> dict[str, Any] | None:
        """The ``nth`` call of ``kind`` for ``step``, once it is under way and has not returned."""
        rows = [c for c in self.calls(task, kind, step) if c["nth"] == nth and c["ended_at"] is None]
        return rows[0] if rows else None

    def final_state(self, task: int) -> str | None:
        state = self.cluster.task_state(task)
        return state if state in FINAL_TASK_STATES else None

    def close(self) -> None:
        if self._books is not None:
            self._books.close()
        self.app.close()


@pytest.fixture
def rig(cluster: Cluster) -> Iterator[Rig]:
    """The service's books beside the cluster's execution log, and an app of the same definitions
    to submit with. ``Cluster.start`` runs ``itapp`` unless told, whose operations log executions
    but keep no books of effects: ``Rig.start`` runs this app."""
    ledgerapp.connect_books(str(cluster.log_path)).close()  # the books, before any worker writes
    r = Rig(cluster, ledgerapp.make_app(cluster.url))
    try:
        yield r
    finally:
        r.close()


def kill(w: WorkerProc) -> None:
    """SIGKILL, and make sure it was that and not an exit of its own that ended the worker."""
    assert w.stop(signal.SIGKILL, 10)[0] == -signal.SIGKILL


def attempts(rig: Rig, task: int, step: int) -> list[tuple[int, str, str | None, str | None]]:
    """(attempt, kind, outcome, taken_by) of every request of one step, from the store."""
    view = rig.cluster.show(task)
    return [(a["attempt"], a["kind"], a["outcome"], a["taken_by"]) for a in view["steps"][step]["attempts"]]


def assert_nothing_survives(rig: Rig, task: int, keys: dict[str, tuple[int, int, int]]) -> None:
    """The service's books for the task are exactly ``keys``: every effect applied at most once,
    undone at most once, and none left applied (REL2)."""
    books = rig.effects(task)
    assert books == keys
    for key, (applied, undone, _) in books.items():
        assert applied <= 1 and undone <= 1, f"{key} applied {applied}x, undone {undone}x"
        assert applied == undone, f"{key} still applied after the task was compensated"


def test_worker_killed_mid_undo_the_undo_runs_again_under_the_same_key_and_nothing_survives(
    cluster: Cluster, rig: Rig
) -> None:
    """The reviewer's case: the only worker (every role, supervisor leader included) dies while
    undoing step b, after the service undid the effect and before its reply was recorded. A fresh
    worker takes the lease, rescues the undo at once (its worker is gone, no complete-by to wait
    for), runs it again under the same key -- the service answers from its books, undoing nothing
    twice -- then undoes a, and the task ends compensated."""
    doomed = rig.start("w1")
    task = rig.submit("refused", {"undo:b": [HANG]})

    hung = cluster.wait(lambda: rig.hanging(task, "undo", "b"), 30, "the undo of step b to hang")
    assert hung["pid"] == doomed.pid
    # The service undid the effect before it hung: a second undo would be a double undo.
    assert rig.effects(task)[f"{task}:b"] == (1, 1, 0)
    kill(doomed)
    fresh = rig.start("w2")

    assert cluster.wait(lambda: rig.final_state(task), 40, "the task to end") == "compensated"

    # The undo ran again, in the fresh worker, under the key of the effect it undoes.
    forward_key = [c["key"] for c in rig.calls(task, "do", "b")]
    undo_b = rig.calls(task, "undo", "b")
    assert forward_key == [f"{task}:b"]
    assert [(c["key"], c["nth"], c["pid"], c["outcome"]) for c in undo_b] == [
        (f"{task}:b", 1, doomed.pid, None),  # killed in the call: no end
        (f"{task}:b", 2, fresh.pid, "replayed"),  # already undone: nothing undone twice
    ]
    # Nothing forward ran again: a and b applied once each, c refused once; a undone after b.
    assert [(c["step"], c["kind"], c["pid"]) for c in rig.calls(task, "do")] == [
        ("a", "do", doomed.pid),
        ("b", "do", doomed.pid),
        ("c", "do", doomed.pid),
    ]
    assert [c["step"] for c in rig.calls(task, "undo")] == ["c", "b", "b", "a"]
    refused = {f"{task}:a": (1, 1, 0), f"{task}:b": (1, 1, 0), f"{task}:c": (0, 0, 1)}  # c: tombstone
    assert_nothing_survives(rig, task, refused)

    # The store's side: the killed undo attempt expired, rescued because its worker was gone.
    assert attempts(rig, task, 1) == [
        (1, "do", "ok", doomed.identity),
        (2, "undo", "expired", doomed.identity),
        (3, "undo", "ok", fresh.identity),
    ]
    rescued = cluster.events(task, "rescued")
    assert [(e["step_idx"], e["attempt"]) for e in rescued] == [(1, 2)]
    assert "presumed dead" in rescued[0]["detail"]["reason"]
    assert [s["state"] for s in cluster.show(task)["steps"]] == ["compensated"] * 3
    assert fresh.alive()


def test_worker_killed_mid_step_whose_failure_compensates_its_lost_effect_is_undone(
    cluster: Cluster, rig: Rig
) -> None:
    """An agent dies in step c after the service applied c's effect: the reply is lost with it. The
    retry, under the same key, is answered from the service's books (no second effect) but hangs
    past its short complete-by too; two failed attempts give the task up, and the compensation
    undoes c as well -- a step that never completed, whose effect is real -- then b and a."""
    boss = rig.start("boss", "scheduler,supervisor")
    doomed = rig.start("agent1", "agent")
    task = rig.submit("given-up", {"do:c": [HANG, HANG]})

    hung = cluster.wait(lambda: rig.hanging(task, "do", "c"), 30, "step c's first call to hang")
    assert hung["pid"] == doomed.pid
    assert rig.effects(task)[f"{task}:c"] == (1, 0, 0)
    # Running before the kill: started after it, on a loaded machine it came up after the
    # retry's short complete-by (3 s) had all but passed, took it with nothing left and made no
    # call, and the replay under test never happened.
    fresh = rig.start("agent2", "agent")
    kill(doomed)

    assert cluster.wait(lambda: rig.final_state(task), 40, "the task to end") == "compensated"

    do_c = rig.calls(task, "do", "c")
    assert [(c["key"], c["nth"], c["pid"], c["outcome"]) for c in do_c] == [
        (f"{task}:c", 1, doomed.pid, None),  # killed in the call
        (f"{task}:c", 2, fresh.pid, "cancelled"),  # replayed, then cancelled at complete-by (AGT4)
    ]
    undo_c = rig.calls(task, "undo", "c")
    assert [(c["key"], c["pid"], c["outcome"]) for c in undo_c] == [(f"{task}:c", fresh.pid, "undone")]
    assert [c["step"] for c in rig.calls(task, "undo")] == ["c", "b", "a"]
    assert [c["step"] for c in rig.calls(task, "do")] == ["a", "b", "c", "c"]
    assert_nothing_survives(rig, task, {f"{task}:{s}": (1, 1, 0) for s in "abc"})

    # Two failures of c: the killed attempt (its worker gone) and the expired one; then the undo.
    assert attempts(rig, task, 2) == [
        (1, "do", "expired", doomed.identity),
        (2, "do", "expired", fresh.identity),
        (3, "undo", "ok", fresh.identity),
    ]
    rescued = cluster.events(task, "rescued")
    assert [(e["step_idx"], e["attempt"]) for e in rescued] == [(2, 1), (2, 2)]
    escalated = cluster.events(task, "escalated")
    assert [(e["step_idx"], e["detail"]["to"]) for e in escalated] == [(2, "compensate")]
    assert boss.alive() and fresh.alive()


def test_worker_killed_mid_step_before_a_refusal_the_step_applies_once_and_is_undone(
    cluster: Cluster, rig: Rig
) -> None:
    """An agent dies in step b after the service applied b's effect. The fresh agent's retry under
    the same key is answered from the books (one effect, not two), b completes, c is refused for
    good, and the compensation undoes b and a: the effect whose first reply died with the worker
    is undone exactly once."""
    rig.start("boss", "scheduler,supervisor")
    doomed = rig.start("agent1", "agent")
    task = rig.submit("refused", {"do:b": [HANG]})

    cluster.wait(lambda: rig.hanging(task, "do", "b"), 30, "step b's first call to hang")
    kill(doomed)
    fresh = rig.start("agent2", "agent")

    assert cluster.wait(lambda: rig.final_state(task), 40, "the task to end") == "compensated"

    do_b = rig.calls(task, "do", "b")
    assert [(c["key"], c["pid"], c["outcome"]) for c in do_b] == [
        (f"{task}:b", doomed.pid, None),
        (f"{task}:b", fresh.pid, "replayed"),  # no second effect
    ]
    undo_b = rig.calls(task, "undo", "b")
    assert [(c["key"], c["outcome"]) for c in undo_b] == [(f"{task}:b", "undone")]
    refused = {f"{task}:a": (1, 1, 0), f"{task}:b": (1, 1, 0), f"{task}:c": (0, 0, 1)}  # c: tombstone
    assert_nothing_survives(rig, task, refused)
    assert attempts(rig, task, 1) == [
        (1, "do", "expired", doomed.identity),
        (2, "do", "ok", fresh.identity),
        (3, "undo", "ok", fresh.identity),
    ]
