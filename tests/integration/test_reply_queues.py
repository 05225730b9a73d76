"""A reply-queue consumer killed mid-stream and restarted misses nothing (SCH8, acceptance 2).

Real workers run tasks that end processed, compensated and in error, each replying to queue
``shop``; a consumer process (``tests/apps/consumer.py``) reads the queue under a durable cursor
and is SIGKILLed while messages are still coming, again and again. Across its incarnations it must
receive every status message of every task, in order, none missing; the only repeat allowed is the
one message a killed incarnation had received but not yet acknowledged.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import APPS, Cluster

pytestmark = pytest.mark.timeout(180)

QUEUE = "shop"
# Workflows of tests/apps/itapp.py and the messages each task sends, in order.
EXPECTED = {
    "one": [("received", None), ("step_completed", "only"), ("processed", None)],
    "refused": [("received", None), ("step_completed", "first"), ("error", "refused")],
    "undone": [
        ("received", None),
        ("step_completed", "first"),
        ("step_completed", "second"),
        ("compensating", None),  # "third" has no compensation
        ("step_compensated", "second"),
        ("step_compensated", "first"),
        ("compensated", None),
    ],
}
ROUNDS = 4


class Consumers:
    """Incarnations of the consumer process, one at a time, all appending to one file."""

    def __init__(self, cluster: Cluster, tmp: Path) -> None:
        self.cluster = cluster
        self.out = tmp / "consumed.jsonl"
        self.out.touch()
        self.log_path = tmp / "consumer.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        p = subprocess.Popen(
            [sys.executable, str(APPS / "consumer.py"), QUEUE, "shop-app", str(self.out)],
            env=self.cluster.env,
            cwd=self.cluster.tmp,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(p)
        return p

    def lines(self) -> list[dict[str, Any]]:
        text = self.out.read_text()
        assert not text or text.endswith("\n"), "a line was cut in half"
        return [json.loads(ln) for ln in text.splitlines()]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        self.log.close()


def test_a_consumer_killed_mid_stream_receives_every_message_in_order(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start("w1")
    cluster.start("w2")
    consumers = Consumers(cluster, tmp_path)
    try:
        tasks: dict[int, str] = {}
        backlog_at_kill: list[int] = []
        current = consumers.start()
        for r in range(ROUNDS):
            for i, wf in enumerate(list(EXPECTED) * 4):
                tid = cluster.submit(wf, {}, reply_to=QUEUE, correlation_id=f"r{r}-{i}")
                tasks[tid] = wf
            seen = len(consumers.lines())
            # kill it after a few messages, later and later in the stream
            want = seen + 5 + 8 * r

            def read_on(n: int = want) -> bool:
                return len(consumers.lines()) >= n

            cluster.wait(read_on, 30, "the consumer to read on")
            current.send_signal(signal.SIGKILL)
            current.wait(timeout=10)
            done = consumers.lines()[-1]["seq"]
            total = cluster.one("SELECT COUNT(*) AS n FROM messages WHERE queue = ?", QUEUE)["n"]
            backlog_at_kill.append(total - done)
            current = consumers.start()

        def all_final() -> bool:
            ids = ",".join(map(str, tasks))
            rows = cluster.sql(f"SELECT state FROM tasks WHERE id IN ({ids})")
            return all(r["state"] in ("processed", "error", "compensated") for r in rows)

        cluster.wait(all_final, 90, "every task to end")
        total = cluster.one("SELECT COUNT(*) AS n FROM messages WHERE queue = ?", QUEUE)["n"]
        cluster.wait(lambda: consumers.lines()[-1]["seq"] == total, 30, "the consumer to catch up")
        current.send_signal(signal.SIGTERM)
        assert current.wait(timeout=10) == 0, consumers.log_path.read_text()
        lines = consumers.lines()
    finally:
        consumers.close()

    # Every kill happened mid-stream: messages were still waiting to be read.
    assert all(n > 0 for n in backlog_at_kill), backlog_at_kill

    # The queue as the store holds it: positions 1..N, each task's messages in their order.
    stored = cluster.sql(
        "SELECT seq, id, task_id, correlation_id, kind FROM messages WHERE queue = ? ORDER BY seq", QUEUE
    )
    assert [m["seq"] for m in stored] == list(range(1, len(stored) + 1))
    for tid, wf in tasks.items():
        mine = [m for m in stored if m["task_id"] == tid]
        assert [m["kind"] for m in mine] == [k for k, _ in EXPECTED[wf]], (tid, wf, mine)
        assert [m["id"] for m in mine] == sorted(m["id"] for m in mine)

    # Each incarnation read a gapless run; the next one began at the message after the last one
    # acknowledged: the next, or the same one again if the kill came before its acknowledgement.
    runs: list[list[dict[str, Any]]] = []
    for ln in lines:
        if not runs or runs[-1][-1]["pid"] != ln["pid"]:
            runs.append([])
        runs[-1].append(ln)
    assert len(runs) == ROUNDS + 1, [r[0]["pid"] for r in runs]
    repeats = 0
    for prev, run in zip([None, *runs], runs, strict=False):
        seqs = [x["seq"] for x in run]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        if prev is None:
            assert seqs[0] == 1
        else:
            assert seqs[0] in (prev[-1]["seq"], prev[-1]["seq"] + 1), (prev[-1], run[0])
            repeats += seqs[0] == prev[-1]["seq"]
    assert runs[-1][-1]["seq"] == len(stored)
    assert len(lines) == len(stored) + repeats

    # What was received is what was stored, message by message.
    got: dict[int, dict[str, Any]] = {}
    for ln in lines:
        got.setdefault(ln["seq"], ln)
    for m in stored:
        g = got[m["seq"]]
        assert (g["id"], g["task_id"], g["correlation_id"], g["kind"]) == (
            m["id"],
            m["task_id"],
            m["correlation_id"],
            m["kind"],
        )
    for tid, wf in tasks.items():
        assert [(g["kind"], g["step"]) for g in got.values() if g["task_id"] == tid] == EXPECTED[wf]
