"""Telling a dead worker from a live one: by its process on this machine, else by its heartbeat."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from stepwarden import liveness


def row(worker: str, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": worker,
        "host_key": None,
        "pid": None,
        "proc_start": None,
        "heartbeat_at": 100.0,
        "stopped_at": None,
    }
    base.update(kw)
    return base


def test_a_live_process_on_this_machine_is_alive_and_a_reaped_one_is_dead() -> None:
    me = liveness.me()
    assert me["pid"] == os.getpid() and me["host_key"] and me["proc_start"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        child_row = row(
            "child", host_key=me["host_key"], pid=child.pid, proc_start=liveness.proc_start(child.pid)
        )
        assert liveness.presumed_dead([row("self", **me), child_row], now=101.0, dead_after=3.0) == []
        child.kill()
        child.wait(timeout=10)
        (verdict,) = liveness.presumed_dead([row("self", **me), child_row], now=101.0, dead_after=3.0)
        assert verdict.worker == "child" and f"process {child.pid} is gone" in verdict.reason
    finally:
        child.kill()
        child.wait(timeout=10)


def test_an_exited_but_unreaped_process_counts_as_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = liveness.proc_start(child.pid)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, still a zombie
    try:
        assert liveness.proc_start(child.pid) is None
        r = row("z", host_key=liveness.host_key(), pid=child.pid, proc_start=started)
        assert [v.worker for v in liveness.presumed_dead([r], now=100.0, dead_after=3.0)] == ["z"]
    finally:
        child.wait(timeout=10)


def test_a_reused_pid_is_not_mistaken_for_the_old_process() -> None:
    r = row("old", host_key=liveness.host_key(), pid=os.getpid(), proc_start="1")  # same pid, other start
    assert [v.worker for v in liveness.presumed_dead([r], now=100.0, dead_after=3.0)] == ["old"]


def test_a_worker_elsewhere_is_judged_by_its_heartbeat_on_the_database_clock() -> None:
    far = row("far", host_key="other-host|boot|pid:[1]", pid=os.getpid(), proc_start="1", heartbeat_at=100.0)
    assert liveness.presumed_dead([far], now=102.9, dead_after=3.0) == []
    (verdict,) = liveness.presumed_dead([far], now=103.5, dead_after=3.0)
    assert verdict.reason == "no heartbeat for 3.5s"
    assert verdict.silent_for == 3.0  # the bound the rescue checks again in its own transaction


def test_a_verdict_that_stands_asks_for_no_second_look() -> None:
    """Stopped, or its process gone: no heartbeat can undo that, so the rescue checks nothing again."""
    gone = row("gone", heartbeat_at=100.0, stopped_at=100.5)
    reused = row("old", host_key=liveness.host_key(), pid=os.getpid(), proc_start="1", heartbeat_at=100.0)
    verdicts = liveness.presumed_dead([gone, reused], now=100.6, dead_after=3.0)
    assert [(v.worker, v.silent_for) for v in verdicts] == [("gone", None), ("old", None)]


def test_a_live_but_silent_process_here_is_presumed_dead_and_a_stopped_one_at_once() -> None:
    hung = row("hung", **liveness.me(), heartbeat_at=90.0)  # this very process: alive, but silent
    stopped = row("gone", heartbeat_at=100.0, stopped_at=100.5)
    verdicts = {
        v.worker: v.reason for v in liveness.presumed_dead([hung, stopped], now=101.0, dead_after=3.0)
    }
    assert verdicts == {"hung": "no heartbeat for 11.0s", "gone": "stopped"}


def test_a_process_this_one_may_not_read_is_judged_by_its_heartbeat(monkeypatch: Any) -> None:
    """/proc mounted with hidepid, or a worker of another user: reading its stat fails with EPERM
    (or it is hidden, and signal 0 says EPERM). It was taken for gone at every sweep and its
    steps rescued while it ran; now only a stale heartbeat condemns it."""
    from pathlib import Path

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        r = row(
            "other-user",
            host_key=liveness.host_key(),
            pid=child.pid,
            proc_start=liveness.proc_start(child.pid),
        )
        real_read = Path.read_text

        def unreadable(self: Path, *args: Any, **kw: Any) -> str:
            if str(self) == f"/proc/{child.pid}/stat":
                raise PermissionError(13, "Permission denied")
            return real_read(self, *args, **kw)

        monkeypatch.setattr(Path, "read_text", unreadable)
        assert liveness.presumed_dead([r], now=101.0, dead_after=3.0) == []
        (verdict,) = liveness.presumed_dead([r], now=110.0, dead_after=3.0)
        assert "no heartbeat" in verdict.reason

        def hidden(self: Path, *args: Any, **kw: Any) -> str:  # hidepid=2: as if it did not exist
            if str(self) == f"/proc/{child.pid}/stat":
                raise FileNotFoundError(2, "No such file or directory")
            return real_read(self, *args, **kw)

        real_kill = os.kill

        def kill(pid: int, sig: int) -> None:
            if pid == child.pid and sig == 0:
                raise PermissionError(1, "Operation not permitted")
            real_kill(pid, sig)

        monkeypatch.setattr(Path, "read_text", hidden)
        monkeypatch.setattr(os, "kill", kill)
        assert liveness.presumed_dead([r], now=101.0, dead_after=3.0) == []
        monkeypatch.undo()
        child.kill()
        child.wait(timeout=10)
        (gone,) = liveness.presumed_dead([r], now=101.0, dead_after=3.0)
        assert f"process {child.pid} is gone" in gone.reason
    finally:
        child.kill()
        child.wait(timeout=10)
