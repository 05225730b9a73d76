"""Telling a dead worker from a slow one, so its steps are rescued in seconds, not at complete-by.

Two signals, the faster first:

- **Same machine**: a worker records its host key (hostname, boot id, PID namespace), its pid and
  its process start time. A supervisor with the same host key reads ``/proc/<pid>/stat``: no such
  process, or one that started at another time (the pid was reused), means the worker is gone.
  This is exact and immediate.
- **Anywhere**: a worker writes a heartbeat every ``heartbeat`` seconds on its lease connection;
  one whose heartbeat is older than ``dead_after`` (judged by the database clock) is presumed dead,
  whether it crashed on another machine or hangs (a paused process is as good as dead to the tasks
  it holds). This one can be wrong about a live worker that stalls longer than ``dead_after``; being wrong
  costs a re-dispatched step (the old attempt's reply is then stale) or a leader change, never a
  double effect, because every transition is fenced by attempt or term.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

# Listings and metrics (not the supervisor, which uses ``dead_after``): a worker or agent instance
# with no heartbeat for this long is shown as silent, and counts as no live series.
SILENT_AFTER = 60.0


def silent(stopped_at: float | None, heartbeat_at: float, now: float) -> bool:
    """Not stopped, and no heartbeat for :data:`SILENT_AFTER` seconds by the database's clock ``now``:
    killed without a word (SIGKILL, a lost machine), or hung."""
    return stopped_at is None and now - float(heartbeat_at) > SILENT_AFTER


@cache
def host_key() -> str:
    """Names this machine and PID namespace: pids are only comparable within one."""
    parts = [socket.gethostname()]
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        return ""  # no /proc: only heartbeats tell
    return "|".join(parts)


def proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) <= 19 or fields[0] in ("Z", "X"):  # a zombie has exited; only its parent can reap it
        return None
    return fields[19]


def hidden(pid: int) -> bool:
    """Whether process ``pid`` exists but this process may not read it: ``/proc`` mounted with
    ``hidepid``, a worker of another user. Its start time cannot be compared, so it is judged by
    its heartbeat alone; before, every sweep took such a live worker for gone and rescued its steps."""
    try:
        Path(f"/proc/{pid}/stat").read_text()
        return False  # readable: proc_start's answer stands (a zombie, say)
    except PermissionError:
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)  # signal 0: only asks whether it exists
    except PermissionError:
        return True  # it exists, under another user
    except OSError:
        return False
    return True


def me() -> dict[str, Any]:
    """What a worker records about its own process."""
    pid = os.getpid()
    key = host_key()
    return {"host_key": key or None, "pid": pid, "proc_start": proc_start(pid) if key else None}


@dataclass(frozen=True)
class Verdict:
    worker: str
    reason: str
    # Judged by its heartbeat's age alone (silent longer than this): it may still beat again
    # before the rescue, which checks that bound again in its own transaction. None for a verdict
    # that stands (stopped, or its process gone).
    silent_for: float | None = None


def presumed_dead(rows: list[dict[str, Any]], now: float, dead_after: float) -> list[Verdict]:
    """The workers among ``rows`` (id, host_key, pid, proc_start, heartbeat_at, stopped_at) that are
    gone: stopped, their process vanished from this machine, or silent for over ``dead_after`` s."""
    mine = host_key()
    out = []
    for r in rows:
        if r.get("stopped_at") is not None:
            out.append(Verdict(r["id"], "stopped"))
        elif (
            mine
            and r.get("host_key") == mine
            and r.get("pid")
            and r.get("proc_start")
            and proc_start(int(r["pid"])) != r["proc_start"]
            and not hidden(int(r["pid"]))
        ):
            out.append(Verdict(r["id"], f"process {r['pid']} is gone"))
        elif now - float(r["heartbeat_at"]) > dead_after:  # alive elsewhere, or hung
            age = now - float(r["heartbeat_at"])
            out.append(Verdict(r["id"], f"no heartbeat for {age:.1f}s", silent_for=dead_after))
    return out


# How long, on its own monotonic clock, a judge (the supervisor, a lease's campaigner) must have
# seen a worker's heartbeat unchanged before it presumes the worker dead by that heartbeat's age,
# as a fraction of ``dead_after`` (so at least the worker's heartbeat interval, dead_after being at
# least twice it). The age is read on the database's clock, which may step: a step forward of a
# few seconds on the database's host (NTP, a resumed virtual machine) aged every heartbeat at once,
# and a supervisor that swept before the workers' next beats took the live ones for dead and had
# their steps run twice (found by a test that steps the clock). A live worker's heartbeat changes
# within its interval; a dead one's stays as it was, and a judge that looks every second has
# watched it for most of dead_after by the time its age passes dead_after: no later a verdict.
WATCH_SHARE = 0.5


class HeartbeatWatch:
    """Since when (monotonic) a judge has read each worker's heartbeat unchanged."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[float, float]] = {}  # worker: (heartbeat_at, since)

    def saw(self, rows: list[dict[str, Any]], at: float) -> None:
        """The workers read at monotonic time ``at``; those not among them are forgotten."""
        self._seen = {
            r["id"]: seen
            if (seen := self._seen.get(r["id"])) is not None and seen[0] == float(r["heartbeat_at"])
            else (float(r["heartbeat_at"]), at)
            for r in rows
        }

    def unchanged_for(self, worker: str, at: float) -> float:
        seen = self._seen.get(worker)
        return 0.0 if seen is None else at - seen[1]

    def doubt(self, verdict: Verdict, at: float, dead_after: float) -> str | None:
        """Why a verdict by a heartbeat's age must wait (watched too briefly here), or None."""
        if verdict.silent_for is None:
            return None
        watched = self.unchanged_for(verdict.worker, at)
        if watched >= dead_after * WATCH_SHARE:
            return None
        return (
            f"{verdict.reason} by the database's clock, but unchanged for {watched:.1f}s only as"
            " seen here: the clock may have stepped"
        )
