"""CPU time spent by the processes of one measurement, read from ``/proc`` (Linux).

Throughput on a 2-core machine is bounded by the CPU that each task costs across every process
it touches: the submitting harness, the workers and the database server. These figures say where
the time goes and how close a run comes to that bound (``cores_busy``): a workload whose cores
are all busy is only made faster by spending less CPU per task, not by waiting less.

A PostgreSQL server's CPU is its postmaster's own, plus its live children's, plus what its
children that have exited (backends of closed connections) spent, which the kernel adds to the
postmaster's ``cutime``/``cstime`` once it has reaped them. Off Linux, or for a server this
harness did not start, the figures are ``None``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

PROC = Path("/proc")
try:
    TICK = float(os.sysconf("SC_CLK_TCK"))
except (AttributeError, ValueError, OSError):  # not a POSIX system
    TICK = 100.0


def _stat(pid: int) -> tuple[int, float, float] | None:
    """``(ppid, own CPU s, reaped children's CPU s)`` of a live process, or None."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields start after its last ')'
    fields = text[text.rindex(")") + 2 :].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) / TICK for x in fields[11:15])
    return ppid, utime + stime, cutime + cstime


def process_cpu(pids: Iterable[int]) -> float | None:
    """CPU seconds of these processes so far (their own, not their children's)."""
    total = 0.0
    for pid in pids:
        st = _stat(pid)
        if st is None:
            return None
        total += st[1]
    return total


def tree_cpu(root: int) -> float | None:
    """CPU seconds of ``root``, its live children and its reaped children: a PostgreSQL server,
    whose postmaster forks a backend per connection."""
    for _ in range(5):
        st = _stat(root)
        if st is None:
            return None
        total = st[1] + st[2]
        for entry in PROC.iterdir():
            if entry.name.isdigit():
                child = _stat(int(entry.name))
                if child is not None and child[0] == root:
                    total += child[1]
        again = _stat(root)
        # A child reaped during the scan would be in neither sum: read again until none was.
        if again is not None and again[2] == st[2]:
            return total
    return None


def postmaster_pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


class CpuMeter:
    """CPU seconds of named groups of processes between :meth:`start` and :meth:`stop`, and the
    wall time in between. A group whose reading fails at either end reports None."""

    def __init__(
        self, groups: dict[str, Callable[[], float | None]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.groups = groups
        self.clock = clock
        self.before: dict[str, float | None] = {}
        self.t0 = 0.0

    def start(self) -> None:
        self.before = {name: read() for name, read in self.groups.items()}
        self.t0 = self.clock()

    def stop(self, tasks: int) -> dict[str, float | None]:
        """Milliseconds of CPU per task for each group (``<group>_ms``) and in total
        (``cpu_total_ms``), and ``cores_busy``: the total CPU over the wall time, in cores (None
        if any group could not be read)."""
        wall = self.clock() - self.t0
        out: dict[str, float | None] = {}
        spent: list[float | None] = []
        for name, read in self.groups.items():
            now, then = read(), self.before.get(name)
            used = None if now is None or then is None else max(0.0, now - then)
            spent.append(used)
            out[f"{name}_ms"] = None if used is None else round(used / tasks * 1000, 3)
        known = [s for s in spent if s is not None]
        whole = len(known) == len(spent)
        out["cpu_total_ms"] = round(sum(known) / tasks * 1000, 3) if whole else None
        out["cores_busy"] = round(sum(known) / wall, 2) if whole and wall > 0 else None
        return out


def harness() -> float:
    """This process's CPU seconds (the harness submits and polls)."""
    return time.process_time()
