"""CPU time spent by the processes of one measurement (``psutil``).

Throughput on a 2-core machine is bounded by the CPU that each task costs across every process
it touches: the submitting harness, the workers and the database server. These figures say where
the time goes and how close a run comes to that bound (``cores_busy``): a workload whose cores
are all busy is only made faster by spending less CPU per task, not by waiting less.

A PostgreSQL server's CPU is its postmaster's own, plus its live children's, plus what its
children that have exited (backends of closed connections) spent, which the kernel adds to the
postmaster's children times once it has reaped them. For a server this harness did not start,
the figures are ``None``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil


def process_cpu(pids: Iterable[int]) -> float | None:
    """CPU seconds of these processes so far (their own, not their children's)."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            return None
        total += t.user + t.system
    return total


def tree_cpu(root: int) -> float | None:
    """CPU seconds of ``root``, its live children and its reaped children: a PostgreSQL server,
    whose postmaster forks a backend per connection."""
    try:
        server = psutil.Process(root)
        for _ in range(5):
            t = server.cpu_times()
            total = t.user + t.system + t.children_user + t.children_system
            for child in server.children():
                with contextlib.suppress(psutil.NoSuchProcess):  # gone meanwhile: see below
                    c = child.cpu_times()
                    total += c.user + c.system
            again = server.cpu_times()
            # A child reaped during the scan would be in neither sum: read again until none was.
            if (again.children_user, again.children_system) == (t.children_user, t.children_system):
                return total
    except psutil.Error:
        return None
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
