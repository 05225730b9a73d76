"""The chaos harness's faults: the seeded schedule (``plan_faults``) and the ``Injector`` that carries
it out (SIGKILL, SIGSTOP, SIGTERM of workers and leaders; proxy resets and stalls; a server restart)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chaos_common import (
    DB_FAULTS,
    LEADER_FAULTS,
    WEIGHTS,
    Options,
    Reader,
    leader_row,
    log_line,
    now,
    pid_of,
    read_lease,
)
from chaos_procs import ProxyProc, Slot, Workers


def plan_faults(
    rng: random.Random, kinds: Sequence[str], window: float, every: float, stop_hold_max: float
) -> list[tuple[float, str]]:
    """A seeded schedule of (offset, kind). Every enabled kind comes once before any repeats; leader
    faults are spaced so each failover can be measured alone, and a SIGSTOP ends inside the window."""
    if not kinds:
        return []
    required = list(kinds)
    rng.shuffle(required)
    # A stop needs room for its hold before the window ends: give it the earliest slot it can take.
    required.sort(key=lambda k: 0 if k == "stop_leader" else 1)
    leader_gap = stop_hold_max + 2.0
    restart_gap = max(20.0, 6 * every)
    quiet_gap = stop_hold_max
    plan: list[tuple[float, str]] = []
    last: dict[str, float] = {}
    t = rng.uniform(0.3, 0.7) * every
    for _ in range(100_000):  # bounded: one candidate time per iteration
        if t > window - 1.0:
            break

        def allowed(k: str, t: float = t, strict: bool = False) -> bool:
            if k in LEADER_FAULTS:
                if t - last.get("leader", -1e9) < leader_gap:
                    return False
                if k == "stop_leader" and t + stop_hold_max + 1.0 > window:
                    return False
                if strict and t - last.get("db", -1e9) < quiet_gap:
                    return False
            if k in DB_FAULTS and strict and t - last.get("leader", -1e9) < quiet_gap:
                return False
            return not (k == "pg_restart" and t - last.get("pg_restart", -1e9) < restart_gap)

        pick = next((k for k in required if allowed(k)), None)
        if pick is not None:
            required.remove(pick)
        else:
            # Past the first round, keep database faults out of a failover in progress (and the other
            # way round) most of the time, so that most failovers are measured undisturbed.
            options = [k for k in kinds if allowed(k, strict=True)]
            if options:
                pick = rng.choices(options, weights=[WEIGHTS[k] for k in options])[0]
        if pick is not None:
            plan.append((round(t, 3), pick))
            last[pick] = t
            if pick in LEADER_FAULTS:
                last["leader"] = t
            if pick in DB_FAULTS:
                last["db"] = t
        t += rng.uniform(0.5, 1.5) * every
    return plan


@dataclass
class PlannedFault:
    due: float  # monotonic
    kind: str
    give_up: float  # monotonic: a fault whose precondition never holds (no leader) is skipped


class Injector:
    """Carries out the schedule; actions that take time (SIGCONT, a restart) run without blocking it."""

    def __init__(
        self,
        o: Options,
        rng: random.Random,
        workers: Workers,
        reader: Reader,
        proxy: ProxyProc | None,
        pg: Any,
        lease_ttl: float,
    ) -> None:
        self.o = o
        self.rng = rng
        self.workers = workers
        self.reader = reader
        self.proxy = proxy
        self.pg = pg
        self.ttl = lease_ttl
        self.faults: list[dict[str, Any]] = []
        self.skipped: Counter[str] = Counter()
        self.later: list[tuple[float, Callable[[], None]]] = []  # (monotonic due, action)
        self.kill_rotation: list[str] = []
        self.restarting: threading.Thread | None = None
        self.t0 = 0.0

    def record(self, kind: str, at: float, **detail: Any) -> None:
        rec = {"kind": kind, "at": at, "t": round(at - self.t0, 3), **detail}
        self.faults.append(rec)
        log_line(self.o, f"fault {kind}: {json.dumps(detail, default=str)}")

    def leader(self) -> tuple[Slot, dict[str, Any]] | None:
        row = leader_row(self.reader)
        if row is None:
            return None
        slot = self.workers.by_pid(pid_of(row["holder"]))
        if slot is None or slot.stopped:
            return None
        return slot, row

    def try_inject(self, kind: str) -> bool:
        """Inject ``kind`` now; False if its precondition does not hold yet (retried, then skipped)."""
        return bool(getattr(self, "_" + kind)())

    def _kill(self) -> bool:
        if not self.kill_rotation:
            cats = sorted({s.category for s in self.workers.slots})
            self.rng.shuffle(cats)
            self.kill_rotation = cats
        # Not the leader (nor the last holder of an expired lease, who may still believe it leads):
        # leader kills are their own kind, spaced so each failover is measured alone.
        answered, lead = read_lease(self.reader)
        if not answered:
            return False
        leader_pid = pid_of(lead["holder"]) if lead else None
        live = [
            s
            for s in self.workers.slots
            if s.alive() and not s.stopped and s.proc is not None and s.proc.pid != leader_pid
        ]
        # The next role mix in the rotation that has a candidate, so every role gets killed in turn.
        cat = next((c for c in self.kill_rotation if any(s.category == c for s in live)), None)
        if cat is None:
            return False
        self.kill_rotation.remove(cat)
        candidates = [s for s in live if s.category == cat]
        # Aim at undos: a worker of that role mix with a compensation in flight, if there is one
        # (the moment REL2's "no compensated effect survives" is most at risk); else any of them.
        undoing = self.undoing_pids()
        aimed = [s for s in candidates if s.proc is not None and s.proc.pid in undoing]
        slot = self.rng.choice(aimed or candidates)
        at = now()
        pid = self.workers.signal(slot, signal.SIGKILL)
        self.record("kill", at, worker=slot.name(), roles=slot.category, pid=pid, aimed_at_undo=bool(aimed))
        self.note_in_flight(self.faults[-1], slot, pid)
        self.workers.replace(slot, graceful=False)
        return True

    def _kill_leader(self) -> bool:
        got = self.leader()
        if got is None:
            return False
        slot, row = got
        at = now()
        pid = self.workers.signal(slot, signal.SIGKILL)
        self.record("kill_leader", at, worker=slot.name(), roles=slot.category, pid=pid, term=row["term"])
        self.note_in_flight(self.faults[-1], slot, pid)
        self.workers.replace(slot, graceful=False)
        return True

    def undoing_pids(self) -> set[int]:
        """Pids of the workers that have taken an undo request and not answered it yet."""
        rows = self.reader.try_rows(
            "SELECT DISTINCT taken_by FROM requests WHERE state = 'taken' AND kind = 'undo'"
        )
        return {p for p in (pid_of(r["taken_by"]) for r in rows or []) if p is not None}

    def note_in_flight(self, rec: dict[str, Any], slot: Slot, pid: int) -> None:
        """What the SIGKILLed worker had in flight, from the store, read right after the kill: the
        requests it had taken and not answered (its agents' calls, forward and undo: an undo the
        service may have applied whose reply died with the worker), and the tasks it held as a
        scheduler while they were being undone. The process is gone, so these rows can only change
        by the supervisor's rescue, a sweep (up to a second) away; ``None`` if the store could not
        answer (a restart)."""
        mine = f"{slot.name()}:{pid}:%"
        taken = self.reader.try_rows(
            "SELECT task_id, kind FROM requests WHERE state = 'taken' AND taken_by LIKE ?", (mine,)
        )
        held = self.reader.try_rows(
            "SELECT id FROM tasks WHERE state = 'compensating' AND locked_by LIKE ?", (mine,)
        )
        if taken is None or held is None:
            rec["in_flight"] = None
            return
        rec["in_flight"] = {
            "do": sum(1 for r in taken if r["kind"] == "do"),
            "undo": sum(1 for r in taken if r["kind"] == "undo"),
            "compensating_tasks_held": len(held),
        }
        rec["undo_tasks"] = sorted({int(r["task_id"]) for r in taken if r["kind"] == "undo"})

    def _term_leader(self) -> bool:
        got = self.leader()
        if got is None:
            return False
        slot, row = got
        at = now()
        pid = self.workers.signal(slot, signal.SIGTERM)
        self.record("term_leader", at, worker=slot.name(), roles=slot.category, pid=pid, term=row["term"])
        self.workers.replace(slot, graceful=True)
        return True

    def _stop_leader(self) -> bool:
        got = self.leader()
        if got is None:
            return False
        slot, row = got
        return self._pause(slot, "stop_leader", self.ttl + self.rng.uniform(1.0, 3.0), term=row["term"])

    def _stop_worker(self) -> bool:
        """A pause of an ordinary worker (a GC pause, a VM steal): claims and attempts go stale under it."""
        answered, lead = read_lease(self.reader)
        if not answered:
            return False
        leader_pid = pid_of(lead["holder"]) if lead else None
        live = [
            s
            for s in self.workers.slots
            if s.alive() and not s.stopped and s.proc is not None and s.proc.pid != leader_pid
        ]
        if not live:
            return False
        return self._pause(self.rng.choice(live), "stop_worker", self.rng.uniform(1.0, 4.0))

    def _pause(self, slot: Slot, kind: str, hold: float, **detail: Any) -> bool:
        """SIGSTOP ``slot`` for ``hold`` seconds, then SIGCONT (scheduled, not waited for).

        On SQLite a process stopped inside a write transaction would hold the single writer lock and
        freeze every process: a limit of the embedded store, not the case under test (a process paused
        between its writes). So stop it, check a writer can get the lock, else resume and try again."""
        assert slot.proc is not None
        pid = slot.proc.pid
        give_up = time.monotonic() + 5.0
        for _ in range(100):  # bounded in count and in time
            if time.monotonic() > give_up:
                break
            at = now()
            os.kill(pid, signal.SIGSTOP)
            if _wait_stopped(pid, 1.0) and self.reader.write_lock_free(0.3):
                slot.stopped = True
                self.record(
                    kind,
                    at,
                    worker=slot.name(),
                    roles=slot.category,
                    pid=pid,
                    hold_s=round(hold, 3),
                    **detail,
                )

                def resume() -> None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                    slot.stopped = False

                self.later.append((time.monotonic() + hold, resume))
                return True
            os.kill(pid, signal.SIGCONT)
            time.sleep(self.rng.uniform(0.01, 0.08))
        self.skipped[kind + "_lock_busy"] += 1
        return False

    def _proxy_reset(self) -> bool:
        assert self.proxy is not None
        at = now()
        reply = self.proxy.command("reset")
        self.record("proxy_reset", at, connections=reply.get("reset"), ok=reply.get("ok"))
        return True

    def _proxy_stall(self) -> bool:
        assert self.proxy is not None
        seconds = round(self.rng.uniform(2.0, 6.0), 3)
        at = now()
        reply = self.proxy.command(f"stall {seconds}")
        self.record("proxy_stall", at, stall_s=seconds, ok=reply.get("ok"))
        return True

    def _pg_restart(self) -> bool:
        if self.pg is None or (self.restarting is not None and self.restarting.is_alive()):
            return False
        at = now()
        self.record("pg_restart", at)
        rec = self.faults[-1]

        def go() -> None:
            t = time.monotonic()
            try:
                self.pg.restart()
                rec["ok"] = True
            except Exception as e:  # recorded; the run goes on and the report shows it
                rec["ok"] = False
                rec["error"] = repr(e)[:300]
            rec["down_s"] = round(time.monotonic() - t, 3)

        self.restarting = threading.Thread(target=go, name="chaos-pg-restart", daemon=True)
        self.restarting.start()
        return True

    def run_due(self) -> None:
        t = time.monotonic()
        for item in [x for x in self.later if x[0] <= t]:
            self.later.remove(item)
            item[1]()

    def flush(self) -> None:
        """The window is over: run every pending action (SIGCONT) now, and let a restart finish."""
        for _, action in sorted(self.later, key=lambda x: x[0]):
            action()
        self.later.clear()
        if self.restarting is not None:
            self.restarting.join(timeout=120)


def _wait_stopped(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return True
        except OSError:
            return False
        time.sleep(0.002)
    return False
