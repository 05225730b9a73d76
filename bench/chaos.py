"""Chaos harness: the demo's order workload under injected faults, on SQLite or PostgreSQL.

    .venv/bin/python bench/chaos.py --store sqlite|postgres [--db URL] [--workers N] [--duration S]
        [--tasks N] [--seed S] [--faults kill,stop,term,proxy,restart,services] [--json PATH]

It starts the demo's fake services (seeded transient, hang-then-apply and permanent faults), N
worker processes (some with every role, one scheduler-only, one agent-only and one supervisor-only,
so each role gets killed), and on PostgreSQL -- unless ``--db`` names a server -- a throwaway
server of its own, with the workers connected through a loopback TCP proxy (``tcpproxy.py``).
During the injection window (``--duration``) it submits orders at a steady rate and injects faults
on a schedule drawn from ``--seed``:

- ``kill``: SIGKILL of a random worker (rotating over the role mixes), and of the supervisor
  leader; a replacement is started at once;
- ``stop``: SIGSTOP of the supervisor leader for longer than its lease TTL, and of an ordinary
  worker for 1-4 s (a GC pause), then SIGCONT;
- ``term``: SIGTERM of the supervisor leader (graceful: it resigns), replacement started;
- ``proxy`` (PostgreSQL): every worker connection reset (RST), or black-holed for a few seconds;
- ``restart`` (PostgreSQL, own server): the server restarted mid-run;
- ``services``: the services' own faults, at the demo's rates.

Then it stops injecting, waits (bounded) for every task to end, stops its processes by pid, reads
the services' ledger and the store's own records (events, lease_terms, requests), and prints and
writes a JSON report; see ``bench/CHAOS.md`` for what each figure means. Exit status 1 when any task
is stuck or lost, any effect was applied twice (or a compensated one survives), two leader terms
acted at once, or a running worker crashed; 2 on bad arguments.

Every loop is bounded in time and count, every process it starts is ended by its pid, and all
traffic stays on 127.0.0.1. Fault times are taken from the host's wall clock, which is the database
clock of the SQLite store and of a PostgreSQL server on the same host.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import random
import re
import secrets
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

HERE = Path(__file__).resolve().parent

WORKFLOW = "process-order"
LEASE_NAME = "supervisor"
FINAL = ("processed", "error", "compensated", "cancelled")
FAULT_GROUPS = ("kill", "stop", "term", "proxy", "restart", "services")
ALL_ROLES = "scheduler,agent,supervisor"
LEADER_FAULTS = ("kill_leader", "stop_leader", "term_leader")
DB_FAULTS = ("proxy_reset", "proxy_stall", "pg_restart")
# How often each fault kind is drawn once every enabled kind has been injected at least once.
WEIGHTS = {
    "kill": 2.0,
    "kill_leader": 2.5,
    "stop_leader": 2.0,
    "stop_worker": 1.2,
    "term_leader": 1.2,
    "proxy_reset": 1.0,
    "proxy_stall": 1.0,
    "pg_restart": 0.4,
}


# -- options --------------------------------------------------------------------------------------


@dataclass
class Options:
    store: str = "sqlite"
    db: str | None = None
    workers: int = 5
    duration: float = 60.0  # the injection window, seconds
    tasks: int | None = None  # orders to submit (at most), spread over the window
    rate: float | None = None  # orders per second (default: tasks / duration, else 8)
    seed: int = 1
    faults: tuple[str, ...] = FAULT_GROUPS
    fault_every: float = 4.0  # mean seconds between injected faults
    settle: float = 120.0  # bounded wait for every task to end after the window
    json_path: str | None = None
    workdir: str | None = None
    keep: bool = False
    transient_rate: float = 0.08
    hang_rate: float = 0.02
    permanent_rate: float = 0.02
    hang_seconds: float | None = None  # default: past the longest complete-by, max(5, complete-by + 1)
    quiet: bool = False
    note: str = ""

    def order_plan(self) -> tuple[int, float]:
        """(orders, rate): bounded in count and in time (all submitted within the window)."""
        if self.rate is not None:
            rate = self.rate
            total = self.tasks if self.tasks is not None else max(1, int(rate * self.duration))
        elif self.tasks is not None:
            total = self.tasks
            rate = total / self.duration
        else:
            rate = 8.0
            total = max(1, int(rate * self.duration))
        return total, rate


def load_tcpproxy() -> Any:
    """``tcpproxy.py`` (next to this file) as a module, for callers that want the proxy in-process."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import tcpproxy

    return tcpproxy


# -- small helpers -------------------------------------------------------------------------------


def now() -> float:
    """The wall clock: the database clock of SQLite, and of a PostgreSQL server on this host."""
    return time.time()


def pct(xs: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))]


def stats(xs: Sequence[float]) -> dict[str, Any]:
    r3: Callable[[float | None], float | None] = lambda v: None if v is None else round(v, 3)  # noqa: E731
    return {
        "n": len(xs),
        "p50": r3(pct(xs, 50)),
        "p99": r3(pct(xs, 99)),
        "max": r3(max(xs) if xs else None),
        "mean": r3(sum(xs) / len(xs) if xs else None),
    }


def log_line(o: Options, text: str) -> None:
    if not o.quiet:
        print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def pid_of(identity: str | None) -> int | None:
    parts = str(identity or "").split(":")
    return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else None


def with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, _, _ = netloc.rpartition("@")
    host = parts.hostname or "127.0.0.1"
    return urlunsplit(parts._replace(netloc=(userinfo + "@" if userinfo else "") + f"{host}:{port}"))


def is_loopback(host: str | None) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


# -- reading the store ----------------------------------------------------------------------------


class Reader:
    """Plain reads for the harness, straight to the database (never through the proxy).

    SQLite: an autocommit connection (WAL readers never wait for writers). PostgreSQL: one
    autocommit connection, reopened after a failure, with a short connect timeout so a restarting
    server never blocks the harness for long. Queries use ``?`` placeholders on both."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.sqlite_path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else None
        self._conn: Any = None

    def _connect(self) -> Any:
        if self.sqlite_path is not None:
            conn = sqlite3.connect(self.sqlite_path, timeout=30, isolation_level=None)
            conn.row_factory = lambda cur, row: {d[0]: v for d, v in zip(cur.description, row, strict=True)}
            return conn
        import psycopg
        from psycopg.rows import dict_row

        from stepwarden.store.postgres import parse_url

        conninfo, _ = parse_url(self.url)
        return psycopg.connect(conninfo, autocommit=True, connect_timeout=3, row_factory=dict_row)

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        if self._conn is None:
            self._conn = self._connect()
        try:
            if self.sqlite_path is not None:
                return list(self._conn.execute(sql, tuple(params)).fetchall())
            return list(self._conn.execute(sql.replace("?", "%s"), tuple(params) or None).fetchall())
        except Exception:
            self.close()
            raise

    def try_rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]] | None:
        """The rows, or None if the database cannot answer (tried twice: a restart breaks the first)."""
        for _ in range(2):
            try:
                return self.rows(sql, params)
            except Exception:
                continue
        return None

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def write_lock_free(self, timeout: float = 0.5) -> bool:
        """SQLite only: can a writer take the lock now? (PostgreSQL has no store-wide lock.)"""
        if self.sqlite_path is None:
            return True
        conn = sqlite3.connect(self.sqlite_path, timeout=timeout, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            conn.close()


def read_lease(reader: Reader) -> tuple[bool, dict[str, Any] | None]:
    """(answered, the supervisor lease row or None): a failed read is not "no leader"."""
    rows = reader.try_rows("SELECT holder, term, expires_at FROM leases WHERE name = ?", (LEASE_NAME,))
    if rows is None:
        return False, None
    return True, (rows[0] if rows and rows[0]["holder"] is not None else None)


def leader_row(reader: Reader) -> dict[str, Any] | None:
    """The lease row if it is held now (not expired), else None."""
    _, row = read_lease(reader)
    if row is None or float(row["expires_at"]) <= now():
        return None
    return row


# -- processes ------------------------------------------------------------------------------------


def _end(p: subprocess.Popen[Any], timeout: float) -> None:
    """SIGCONT (a stopped process ignores SIGTERM), SIGTERM, SIGKILL at the deadline: by pid only."""
    if p.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        p.send_signal(signal.SIGCONT)
        p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def longest_complete_by() -> float:
    from stepwarden.demo.app import app

    return max(float(s.complete_by) for s in app.workflows[WORKFLOW].steps)


def hang_seconds(o: Options) -> float:
    """A hang withholds the reply past complete-by, so that the attempt expires and is rescued."""
    return o.hang_seconds if o.hang_seconds is not None else max(5.0, longest_complete_by() + 1.0)


class ServicesProc:
    """The demo's fake services in a process of their own, counting the faults they inject."""

    def __init__(self, o: Options, workdir: Path) -> None:
        self.o = o
        self.workdir = workdir
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.counts: dict[str, int] = {}

    def start(self) -> str:
        o = self.o
        off = "services" not in o.faults
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "_services",
                "--port",
                "0",
                "--seed",
                str(o.seed),
                "--transient-rate",
                str(0.0 if off else o.transient_rate),
                "--hang-rate",
                str(0.0 if off else o.hang_rate),
                "--permanent-rate",
                str(0.0 if off else o.permanent_rate),
                "--hang-seconds",
                str(hang_seconds(o)),
            ],
            stdout=subprocess.PIPE,
            stderr=open(self.workdir / "services.log", "ab"),  # noqa: SIM115 - the child owns it
            text=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline().strip() if ready else ""
        if not line.startswith("listening on "):
            raise RuntimeError(f"the demo services did not start (said {line!r})")
        self.url = line.removeprefix("listening on ")
        return self.url

    def stop(self) -> dict[str, int]:
        p = self.proc
        if p is None:
            return self.counts
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            out, _ = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate(timeout=10)
        for line in (out or "").splitlines():
            if line.startswith("faults "):
                self.counts = {k: int(v) for k, v in json.loads(line.removeprefix("faults ")).items()}
        self.proc = None
        return self.counts


def serve_counting_services(argv: list[str]) -> int:
    """``chaos.py _services ...``: the demo services, counting each fault they inject by kind.

    A 503 is a transient fault, a withheld reply a hang (the effect is applied, the reply lost), and
    the first refusal of an idempotency key a permanent fault. Printed as one JSON line at exit."""
    from stepwarden.demo import services as svc

    counts: Counter[str] = Counter()
    refused: set[str] = set()
    lock = threading.Lock()
    original = svc.FakeServices.call

    def call(self: Any, service: str, op: str, key: str, body: dict[str, Any]) -> Any:
        reply = original(self, service, op, key, body)
        kind = None
        if reply.status == 503:
            kind = "transient"
        elif reply.withhold:
            kind = "hang"
        elif reply.status == 422 and "permanent" in str(reply.body.get("error", "")) and key not in refused:
            refused.add(key)
            kind = "permanent"
        if kind:
            with lock:
                counts[kind] += 1
        return reply

    svc.FakeServices.call = call  # type: ignore[method-assign]
    rc = svc.main(argv)
    with lock:
        print("faults " + json.dumps(dict(counts)), flush=True)
    return rc


class ProxyProc:
    """``tcpproxy.py`` in a process of its own (off the harness's GIL), driven over stdin/stdout."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.lock = threading.Lock()

    def start(self, host: str, port: int) -> int:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "tcpproxy.py"), "--upstream", f"{host}:{port}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.workdir / "proxy.log", "ab"),  # noqa: SIM115 - the child owns it
            text=True,
        )
        line = self._readline(30)
        if not line.startswith("listening on "):
            raise RuntimeError(f"the proxy did not start (said {line!r})")
        self.port = int(line.rsplit(":", 1)[1])
        return self.port

    def _readline(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().strip() if ready else ""

    def command(self, line: str, timeout: float = 10) -> dict[str, Any]:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None or self.proc.stdin is None:
                return {"ok": False, "error": "proxy not running"}
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            reply = self._readline(timeout)
        try:
            out = json.loads(reply)
            return out if isinstance(out, dict) else {"ok": False, "error": reply}
        except ValueError:
            return {"ok": False, "error": f"no reply to {line!r}"}

    def stop(self) -> dict[str, Any]:
        if self.proc is None:
            return {}
        final = self.command("stats", timeout=5) if self.proc.poll() is None else {}
        with contextlib.suppress(Exception):
            self.command("quit", timeout=5)
        if self.proc.stdin is not None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        return final


@dataclass
class Slot:
    """A place for one worker process with a fixed role mix; a killed worker is replaced in its slot."""

    index: int
    category: str  # "all", "scheduler", "agent", "supervisor"
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    stopped: bool = False  # SIGSTOPped by us, waiting for its SIGCONT

    @property
    def roles(self) -> str:
        return ALL_ROLES if self.category == "all" else self.category

    def name(self) -> str:
        return f"chaos-w{self.index}-{self.category}-{self.incarnation}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def layout(n: int) -> list[str]:
    """Role mixes of N workers: at least two with every role, then one of each single role."""
    if n < 4:
        return ["all"] * n
    if n == 4:
        return ["all", "scheduler", "agent", "supervisor"]
    return ["all"] * (n - 3) + ["scheduler", "agent", "supervisor"]


class Workers:
    def __init__(self, o: Options, workdir: Path, url: str, env: dict[str, str]) -> None:
        self.o = o
        self.logdir = workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.url = url
        self.env = env
        self.slots = [Slot(i + 1, c) for i, c in enumerate(layout(o.workers))]
        self.retiring: list[tuple[subprocess.Popen[bytes], float]] = []  # SIGTERMed, still exiting
        self.expected: set[int] = set()  # pids we killed or stopped on purpose
        self.started = 0
        self.unexpected: list[dict[str, Any]] = []

    def start(self, slot: Slot) -> subprocess.Popen[bytes]:
        slot.incarnation += 1
        slot.stopped = False
        name = slot.name()
        cmd = [sys.executable, "-m", "stepwarden", "--db", self.url, "--log-level", "WARNING", "worker"]
        cmd += ["--app", "stepwarden.demo.app:app", "--roles", slot.roles, "--name", name]
        with open(self.logdir / f"{name}.log", "ab") as log:  # the child keeps its own copy
            slot.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.started += 1
        return slot.proc

    def by_pid(self, pid: int | None) -> Slot | None:
        return next((s for s in self.slots if s.alive() and s.proc is not None and s.proc.pid == pid), None)

    def signal(self, slot: Slot, sig: int) -> int:
        assert slot.proc is not None
        pid = slot.proc.pid
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.expected.add(pid)
        os.kill(pid, sig)
        return pid

    def replace(self, slot: Slot, graceful: bool) -> None:
        """Start a fresh incarnation in ``slot``; a gracefully stopping one is reaped later."""
        old = slot.proc
        if old is not None:
            if graceful:
                self.retiring.append((old, time.monotonic() + 30))
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    old.wait(timeout=10)
        self.start(slot)

    def check(self, restart: bool = True) -> None:
        """Workers that died without our doing: recorded (REL3: never crash) and restarted (bounded)."""
        for slot in self.slots:
            p = slot.proc
            if p is None or p.poll() is None or p.pid in self.expected:
                continue
            log_path = self.logdir / f"{slot.name()}.log"
            text = log_path.read_text(errors="replace") if log_path.exists() else ""
            # `stepwarden worker` prints "worker NAME:PID:RANDOM on URL" once its store is open: an
            # exit before that is a failed start, after it a crash of a running worker (REL3).
            phase = "running" if f"worker {slot.name()}:{p.pid}:" in text else "startup"
            self.unexpected.append(
                {
                    "worker": slot.name(),
                    "pid": p.pid,
                    "exit": p.returncode,
                    "phase": phase,
                    "log_tail": text.splitlines()[-30:],
                    "at": now(),
                }
            )
            self.expected.add(p.pid)
            if restart and len(self.unexpected) <= 50:
                self.start(slot)
        for p, deadline in list(self.retiring):
            if p.poll() is not None:
                self.retiring.remove((p, deadline))
            elif time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
                self.retiring.remove((p, deadline))

    def stop_all(self, timeout: float = 20) -> None:
        procs = [s.proc for s in self.slots if s.proc is not None] + [p for p, _ in self.retiring]
        for p in procs:
            if p.poll() is None:
                self.expected.add(p.pid)
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            _end(p, max(0.1, deadline - time.monotonic()))

    def log_counts(self, patterns: dict[str, str]) -> dict[str, int]:
        out = dict.fromkeys(patterns, 0)
        compiled = {k: re.compile(v) for k, v in patterns.items()}
        for path in self.logdir.glob("*.log"):
            text = path.read_text(errors="replace")
            for k, rx in compiled.items():
                out[k] += len(rx.findall(text))
        return out


# -- submitting orders ----------------------------------------------------------------------------


class Submitter(threading.Thread):
    """Submits ``total`` orders at ``rate`` per second until ``stop_at``; failed submissions are retried
    with the same idempotency key (so an ambiguous commit never makes a second task)."""

    def __init__(self, app: Any, prefix: str, total: int, rate: float, seed: int, stop_at: float) -> None:
        super().__init__(name="chaos-submitter", daemon=True)
        self.app = app
        self.prefix = prefix
        self.total = total
        self.rate = rate
        self.rng = random.Random(seed)
        self.stop_at = stop_at
        self.halt = threading.Event()
        self.acked: dict[str, int] = {}
        self.unacked: dict[str, dict[str, Any]] = {}
        self.errors = 0
        self.last_error = ""

    def order(self, i: int) -> dict[str, Any]:
        oid = f"{self.prefix}{i:06d}"
        return {
            "order_id": oid,
            "sku": f"SKU-{self.rng.randint(1, 40)}",
            "quantity": self.rng.randint(1, 5),
            "amount_cents": self.rng.randint(100, 50_000),
        }

    def _submit(self, order: dict[str, Any]) -> bool:
        oid = order["order_id"]
        try:
            task_id = self.app.submit(WORKFLOW, order, correlation_id=oid, idempotency_key=oid)
        except Exception as e:  # the store may be restarting: keep it for a retry
            self.errors += 1
            where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
            self.last_error = f"{e!r} at {where.filename}:{where.lineno}" if where else repr(e)
            self.last_error = self.last_error[:400]
            self.unacked[oid] = order
            return False
        self.acked[oid] = task_id
        self.unacked.pop(oid, None)
        return True

    def retry_unacked(self, until: float) -> None:
        for oid in sorted(self.unacked):
            if time.monotonic() > until or self.halt.is_set():
                return
            self._submit(self.unacked[oid])

    def run(self) -> None:
        start = time.monotonic()
        for i in range(self.total):
            due = start + i / self.rate
            while not self.halt.is_set() and time.monotonic() < due:
                self.halt.wait(min(0.05, max(0.0, due - time.monotonic())))
            if self.halt.is_set() or time.monotonic() >= self.stop_at:
                break
            if self.unacked and i % 10 == 0:
                self.retry_unacked(time.monotonic() + 1.0)
            self._submit(self.order(i))
        self.retry_unacked(time.monotonic() + 30)


# -- the fault schedule ---------------------------------------------------------------------------


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
        slot = self.rng.choice([s for s in live if s.category == cat])
        at = now()
        pid = self.workers.signal(slot, signal.SIGKILL)
        self.record("kill", at, worker=slot.name(), roles=slot.category, pid=pid)
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
        self.workers.replace(slot, graceful=False)
        return True

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


# -- analysis (pure functions over the store's records) ------------------------------------------


def _detail(e: dict[str, Any]) -> dict[str, Any]:
    d = e.get("detail")
    if isinstance(d, dict):
        return d
    try:
        out = json.loads(d) if d else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def rescue_samples(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each rescue that was retried: complete-by passing -> the retry's dispatch.

    ``events`` are ``rescued``, ``retry_scheduled`` and ``dispatched`` rows in id order. The back-off
    the retry policy asks for (``retry_scheduled.delay``) is kept apart, so the machinery's own share
    (detection by the supervisor, pickup by a scheduler) can be compared with its target."""
    open_: dict[tuple[int, int], dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    for e in events:
        key = (int(e["task_id"]), int(e["step_idx"]))
        d = _detail(e)
        if e["kind"] == "rescued":
            open_[key] = {
                "attempt": e["attempt"],
                "complete_by": float(d.get("complete_by", e["at"])),
                "rescued_at": float(e["at"]),
                "delay": None,
                # Rescued because its worker was presumed dead, before complete-by (see liveness).
                "dead_worker": "presumed dead" in str(d.get("reason", "")),
            }
        elif e["kind"] == "retry_scheduled":
            r = open_.get(key)
            if r is not None and r["attempt"] == e["attempt"]:
                r["delay"] = float(d.get("delay", 0.0))
        elif e["kind"] == "dispatched":
            r = open_.pop(key, None)
            if r is None or r["delay"] is None:
                continue  # escalated (compensation), not a retry
            at = float(e["at"])
            out.append(
                {
                    "task_id": key[0],
                    "step_idx": key[1],
                    "attempt": r["attempt"],
                    "complete_by": r["complete_by"],
                    "dispatched_at": at,
                    "latency": at - r["complete_by"],
                    "detection": r["rescued_at"] - r["complete_by"],
                    "backoff": r["delay"],
                    "machinery": at - r["complete_by"] - r["delay"],
                    "dead_worker": r["dead_worker"],
                    "rescued_at": r["rescued_at"],
                }
            )
    return out


def failover_samples(
    faults: Sequence[dict[str, Any]],
    acquisitions: Sequence[dict[str, Any]],
    kinds: Sequence[str],
    db_quiet_before: float = 8.0,
) -> list[dict[str, Any]]:
    """Fault time -> the next ``lease_acquired`` (any holder, a newer term).

    A sample is *disturbed* when a database fault (reset, stall, restart) happened within
    ``db_quiet_before`` seconds before the leader fault or before the new leader was elected: then
    the database, not the election, may have set the pace."""
    acq = sorted(acquisitions, key=lambda a: float(a["at"]))
    db_times = [float(f["at"]) for f in faults if f["kind"] in DB_FAULTS]
    out = []
    for f in faults:
        if f["kind"] not in kinds:
            continue
        if f["kind"] == "kill" and f.get("held_term") is None:
            continue
        nxt = next(
            (
                a
                for a in acq
                if float(a["at"]) > f["at"] and a["term"] > (f.get("term") or f.get("held_term") or 0)
            ),
            None,
        )
        out.append(
            {
                "kind": f["kind"],
                "at": f["at"],
                "failover": None if nxt is None else float(nxt["at"]) - f["at"],
                "new_term": None if nxt is None else nxt["term"],
                "disturbed": any(
                    f["at"] - db_quiet_before <= d <= (f["at"] + 60 if nxt is None else float(nxt["at"]))
                    for d in db_times
                ),
            }
        )
    return out


def term_analysis(terms: Sequence[dict[str, Any]], rescued: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Overlapping leader terms, from ``lease_terms`` and the terms' own fenced writes.

    An *acting overlap* is a term that began before an earlier term's last fenced write (a
    ``rescued`` event carries the term it was written under): two leaders would then both have
    acted. A *nominal overlap* is a term that began before the previous one was recorded as ended."""
    terms = sorted(terms, key=lambda r: int(r["term"]))
    holder = {int(r["term"]): r["holder"] for r in terms}
    last_write: dict[int, float] = {}
    writes: Counter[int] = Counter()
    foreign = 0
    for e in rescued:
        term = _detail(e).get("term")
        if term is None:
            continue
        term = int(term)
        writes[term] += 1
        last_write[term] = max(last_write.get(term, -math.inf), float(e["at"]))
        if term in holder and e.get("actor") != holder[term]:
            foreign += 1
    acting: list[dict[str, Any]] = []
    nominal = 0
    latest_write, latest_term = -math.inf, None
    prev: dict[str, Any] | None = None
    for r in terms:
        term, acquired = int(r["term"]), float(r["acquired_at"])
        if latest_write > acquired:
            acting.append(
                {
                    "term": term,
                    "acquired_at": acquired,
                    "earlier_term": latest_term,
                    "earlier_write_at": latest_write,
                    "by_s": round(latest_write - acquired, 6),
                }
            )
        if prev is not None and (prev["ended_at"] is None or float(prev["ended_at"]) > acquired):
            nominal += 1
        if last_write.get(term, -math.inf) > latest_write:
            latest_write, latest_term = last_write[term], term
        prev = r
    gaps = [
        float(b["acquired_at"]) - float(a["ended_at"])
        for a, b in itertools.pairwise(terms)
        if a["ended_at"] is not None
    ]
    return {
        "terms": len(terms),
        "acting_overlaps": len(acting),
        "acting_overlap_detail": acting[:20],
        "nominal_overlaps": nominal,
        "fenced_writes_by_non_holder": foreign,
        "terms_with_writes": len(writes),
        "fenced_writes": sum(writes.values()),
        "handover_gap_s": stats(gaps),
        # a leader that gave its term up and took the next one itself: it deposed itself
        "same_holder_reelections": sum(1 for a, b in itertools.pairwise(terms) if a["holder"] == b["holder"]),
    }


def mark_term_holders(faults: Sequence[dict[str, Any]], terms: Sequence[dict[str, Any]]) -> None:
    """Record on each kill or pause of an ordinary worker whether its victim held a leader term at
    that moment, from ``lease_terms`` (the harness avoids it, but checks rather than trusts)."""
    for f in faults:
        if f["kind"] not in ("kill", "stop_worker") or "pid" not in f:
            continue
        held = [
            int(t["term"])
            for t in terms
            if pid_of(t["holder"]) == f["pid"]
            and str(t["holder"]).startswith(f["worker"] + ":")
            and float(t["acquired_at"]) <= f["at"]
            and (t["ended_at"] is None or float(t["ended_at"]) > f["at"])
        ]
        f["held_term"] = max(held) if held else None


def in_any(a: float, b: float, windows: Sequence[tuple[float, float]]) -> bool:
    return any(a < w1 and w0 < b for w0, w1 in windows)


# -- the run -------------------------------------------------------------------------------------


@dataclass
class Run:
    o: Options
    workdir: Path
    store_kind: str
    direct_url: str = ""
    worker_url: str = ""
    pg: Any = None
    services: ServicesProc | None = None
    proxy: ProxyProc | None = None
    workers: Workers | None = None
    store: Any = None
    reader: Reader | None = None
    notes: list[str] = field(default_factory=list)


def _start_db(run: Run) -> None:
    o = run.o
    if run.store_kind == "sqlite":
        run.direct_url = o.db or f"sqlite:///{run.workdir / 'chaos.db'}"
        if not run.direct_url.startswith("sqlite:///"):
            raise SystemExit("--store sqlite needs a sqlite:/// URL")
        run.worker_url = run.direct_url
        return
    if o.db:
        run.direct_url = o.db
        if not run.direct_url.startswith(("postgresql://", "postgres://")):
            raise SystemExit("--store postgres needs a postgresql:// URL")
        if "restart" in o.faults:
            run.notes.append("restart: not injected, the server named by --db is not ours to restart")
    else:
        import psycopg

        from stepwarden.testing.postgres import LocalPostgres

        run.pg = LocalPostgres(run.workdir / "pg" / "data").start()
        with psycopg.connect(run.pg.url(), autocommit=True) as c:
            c.execute("CREATE DATABASE chaos")
        run.direct_url = run.pg.url("chaos")
    run.worker_url = run.direct_url
    if "proxy" in o.faults:
        host = urlsplit(run.direct_url).hostname
        port = urlsplit(run.direct_url).port or 5432
        if not is_loopback(host):
            run.notes.append(f"proxy: not used, the server {host} is not on the loopback interface")
        else:
            run.proxy = ProxyProc(run.workdir)
            run.worker_url = with_port(run.direct_url, run.proxy.start(str(host), port))


def enabled_kinds(run: Run) -> list[str]:
    o = run.o
    kinds = []
    if "kill" in o.faults:
        kinds += ["kill", "kill_leader"]
    if "stop" in o.faults:
        kinds += ["stop_leader", "stop_worker"]
    if "term" in o.faults:
        kinds.append("term_leader")
    if "proxy" in o.faults and run.proxy is not None:
        kinds += ["proxy_reset", "proxy_stall"]
    if "restart" in o.faults and run.pg is not None:
        kinds.append("pg_restart")
    return kinds


def execute(o: Options) -> tuple[dict[str, Any], bool]:
    """Run the whole thing; returns (report, ok). Every process started here is ended here."""
    from stepwarden.demo.app import app
    from stepwarden.leader import LeaseSettings
    from stepwarden.store import open_store
    from stepwarden.store.core import _register
    from stepwarden.supervisor import SupervisorSettings

    lease = LeaseSettings()
    sup = SupervisorSettings()
    # The harness's own pool (submissions) complains on every reconnect during a restart; the
    # report counts what matters.
    pool_log = logging.getLogger("psycopg.pool")
    pool_level = pool_log.level
    pool_log.setLevel(logging.CRITICAL)
    workdir = Path(o.workdir) if o.workdir else Path(tempfile.mkdtemp(prefix=f"stepwarden-chaos-{o.store}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = Run(o, workdir, o.store)
    ok = False
    report: dict[str, Any] = {}
    try:
        _start_db(run)
        run.services = ServicesProc(o, workdir)
        services_url = run.services.start()
        run.store = open_store(run.direct_url)
        run.store.transact_sync(_register, list(app.workflows.values()), "chaos")
        app.use_store(run.store)
        run.reader = reader = Reader(run.direct_url)
        first_event = int(reader.rows("SELECT COALESCE(MAX(id), 0) AS m FROM events")[0]["m"])
        run_started = now()
        env = dict(os.environ, STEPWARDEN_DEMO_SERVICES=services_url, PYTHONUNBUFFERED="1")
        env.pop("STEPWARDEN_DB", None)
        run.workers = workers = Workers(o, workdir, run.worker_url, env)
        for slot in workers.slots:
            workers.start(slot)
        _wait_ready(run)
        report = _drive(run, first_event, run_started, lease, sup)
        ok = bool(report["ok"])
        return report, ok
    finally:
        _teardown(run, ok)
        pool_log.setLevel(pool_level)


def _wait_ready(run: Run) -> None:
    assert run.workers is not None and run.reader is not None
    end = time.monotonic() + 60
    while time.monotonic() < end:
        run.workers.check(restart=False)
        rows = (
            run.reader.try_rows(
                "SELECT id FROM workers WHERE id LIKE ? AND stopped_at IS NULL", ("chaos-w%",)
            )
            or []
        )
        if len(rows) >= len(run.workers.slots) and leader_row(run.reader) is not None:
            return
        if run.workers.unexpected:
            raise RuntimeError(f"a worker failed to start: {run.workers.unexpected[0]}")
        time.sleep(0.2)
    raise RuntimeError("the workers did not register and elect a leader within 60 s")


def _drive(run: Run, first_event: int, run_started: float, lease: Any, sup: Any) -> dict[str, Any]:
    from stepwarden.demo.app import app

    o = run.o
    assert run.workers is not None and run.reader is not None and run.services is not None
    workers, reader = run.workers, run.reader
    rng = random.Random(o.seed)
    prefix = f"chaos-{secrets.token_hex(3)}-"
    total, rate = o.order_plan()
    kinds = enabled_kinds(run)
    stop_hold_max = lease.ttl + 3.0
    plan = plan_faults(random.Random(o.seed * 7919 + 1), kinds, o.duration, o.fault_every, stop_hold_max)
    injector = Injector(o, rng, workers, reader, run.proxy, run.pg, lease.ttl)
    log_line(
        o,
        f"{o.store}: {len(workers.slots)} workers {layout(o.workers)}, {total} orders at {rate:.2f}/s over "
        f"{o.duration:g}s, {len(plan)} faults planned ({', '.join(kinds) or 'none'}); workdir {run.workdir}",
    )
    t0_mono = time.monotonic()
    injector.t0 = t0 = now()
    window_end = t0_mono + o.duration
    submitter = Submitter(app, prefix, total, rate, o.seed, window_end)
    submitter.start()
    queue = [PlannedFault(t0_mono + off, kind, t0_mono + off + 12.0) for off, kind in plan]
    next_progress = t0_mono + 5
    for _ in range(int(o.duration * 50) + 1000):  # bounded: one pass per ~20 ms of the window
        t = time.monotonic()
        if t >= window_end:
            break
        injector.run_due()
        for pf in [p for p in queue if p.due <= t]:
            if injector.try_inject(pf.kind):
                queue.remove(pf)
            elif t >= pf.give_up:
                injector.skipped[pf.kind] += 1
                queue.remove(pf)
            else:
                pf.due = t + 0.25
        workers.check()
        if t >= next_progress:
            next_progress = t + max(5.0, o.duration / 60)
            _progress(o, reader, prefix, submitter, injector, t - t0_mono)
        time.sleep(0.02)
    injector.skipped.update(p.kind for p in queue)
    injected_until = now()
    injector.flush()
    submitter.halt.set()
    submitter.join(timeout=60)
    submitter.halt.clear()
    submitter.retry_unacked(time.monotonic() + 30)
    log_line(o, f"injection over: {len(injector.faults)} faults; waiting up to {o.settle:g}s for every task")
    settle_start = time.monotonic()
    settle_end = settle_start + o.settle
    counts: dict[str, int] = {}
    while time.monotonic() < settle_end:
        workers.check()
        rows = reader.try_rows(
            "SELECT state, COUNT(*) AS n FROM tasks WHERE substr(correlation_id, 1, ?) = ? GROUP BY state",
            (len(prefix), prefix),
        )
        if rows is not None:
            counts = {r["state"]: int(r["n"]) for r in rows}
            if sum(counts.values()) >= len(submitter.acked) and all(s in FINAL for s in counts):
                break
        time.sleep(0.5)
    settled_s = time.monotonic() - settle_start
    workers.check(restart=False)
    workers.stop_all()
    end_wall = now()
    effects = _ledger(run)
    report = _report(
        run,
        prefix,
        first_event,
        run_started,
        t0,
        injected_until,
        end_wall,
        settled_s,
        submitter,
        injector,
        plan,
        effects,
        lease,
        sup,
    )
    return report


def _progress(o: Options, reader: Reader, prefix: str, sub: Submitter, inj: Injector, elapsed: float) -> None:
    rows = reader.try_rows(
        "SELECT state, COUNT(*) AS n FROM tasks WHERE substr(correlation_id, 1, ?) = ? GROUP BY state",
        (len(prefix), prefix),
    )
    counts = {r["state"]: int(r["n"]) for r in rows or []}
    final = sum(n for s, n in counts.items() if s in FINAL)
    log_line(
        o,
        f"t={elapsed:5.1f}s submitted {len(sub.acked)} (retrying {len(sub.unacked)}), final {final}, "
        f"in flight {sum(counts.values()) - final}, faults {len(inj.faults)}"
        + ("" if rows is not None else " (store unreachable)"),
    )


def _ledger(run: Run) -> dict[str, dict[str, object]]:
    from stepwarden.demo.ledger import fetch_ledger

    assert run.services is not None
    return fetch_ledger(run.services.url, timeout=30)


def _report(
    run: Run,
    prefix: str,
    first_event: int,
    run_started: float,
    t0: float,
    injected_until: float,
    end_wall: float,
    settled_s: float,
    sub: Submitter,
    inj: Injector,
    plan: list[tuple[float, str]],
    effects: dict[str, dict[str, object]],
    lease: Any,
    sup: Any,
) -> dict[str, Any]:
    from stepwarden.demo.ledger import OrderOutcome, check_ledger

    o = run.o
    assert run.reader is not None and run.workers is not None and run.services is not None
    reader = run.reader
    tasks = reader.rows(
        "SELECT id, correlation_id, state FROM tasks WHERE substr(correlation_id, 1, ?) = ? ORDER BY id",
        (len(prefix), prefix),
    )
    by_state = Counter(t["state"] for t in tasks)
    stuck_rows = [t for t in tasks if t["state"] not in FINAL]
    in_store = {t["correlation_id"] for t in tasks}
    lost_ids = sorted(oid for oid in sub.acked if oid not in in_store)
    ledger = check_ledger(
        effects, [OrderOutcome(t["correlation_id"], str(t["id"]), t["state"]) for t in tasks]
    )
    events = reader.rows(
        "SELECT id, task_id, step_idx, attempt, kind, actor, detail, at FROM events WHERE id > ? "
        "AND kind IN ('rescued', 'retry_scheduled', 'dispatched') ORDER BY id",
        (first_event,),
    )
    kinds = Counter(
        {
            r["kind"]: int(r["n"])
            for r in reader.rows(
                "SELECT kind, COUNT(*) AS n FROM events WHERE id > ? GROUP BY kind", (first_event,)
            )
        }
    )
    acquisitions = reader.rows(
        "SELECT id, actor, detail, at FROM events WHERE id > ? AND kind = 'lease_acquired' ORDER BY id",
        (first_event,),
    )
    acq = [
        {"at": float(a["at"]), "term": int(_detail(a).get("term", 0)), "holder": a["actor"]}
        for a in acquisitions
        if _detail(a).get("lease") == LEASE_NAME
    ]
    resigned = [
        {"at": float(a["at"]), "term": int(_detail(a).get("term", 0)), "holder": a["actor"]}
        for a in reader.rows(
            "SELECT actor, detail, at FROM events WHERE id > ? AND kind = 'lease_resigned' ORDER BY id",
            (first_event,),
        )
        if _detail(a).get("lease") == LEASE_NAME
    ]
    terms = reader.rows(
        "SELECT term, holder, acquired_at, ended_at FROM lease_terms WHERE name = ? AND acquired_at >= ? "
        "ORDER BY term",
        (LEASE_NAME, run_started - 1.0),
    )
    rescued = [e for e in events if e["kind"] == "rescued"]
    overlaps = term_analysis(terms, rescued)
    mark_term_holders(inj.faults, terms)
    requests = reader.rows(
        "SELECT outcome, COUNT(*) AS n FROM requests WHERE task_id IN "
        "(SELECT id FROM tasks WHERE substr(correlation_id, 1, ?) = ?) GROUP BY outcome",
        (len(prefix), prefix),
    )

    # -- failovers
    fo_kill = failover_samples(inj.faults, acq, ("kill", "kill_leader"))
    fo_stop = failover_samples(inj.faults, acq, ("stop_leader",))
    fo_term = failover_samples(inj.faults, acq, ("term_leader",))
    handovers = []
    for f in inj.faults:
        if f["kind"] != "term_leader":
            continue
        res = next((r for r in resigned if r["at"] >= f["at"] and r["term"] == f.get("term")), None)
        nxt = next(
            (a for a in acq if res is not None and a["at"] >= res["at"] and a["term"] > res["term"]), None
        )
        if res is not None and nxt is not None:
            handovers.append(nxt["at"] - res["at"])

    # -- rescue latency, and the subset no fault was slowing down (no leader outage, no DB fault)
    # Steps of a worker presumed dead are rescued before their complete-by: their latency from
    # complete-by would be negative, so they are reported apart (rescue -> retry dispatched).
    every_sample = rescue_samples(events)
    early = [s for s in every_sample if s["dead_worker"]]
    samples = [s for s in every_sample if not s["dead_worker"]]
    disturbed: list[tuple[float, float]] = []
    for s in fo_kill + fo_stop + fo_term:
        disturbed.append((s["at"], s["at"] + (s["failover"] if s["failover"] is not None else 60.0)))
    for f in inj.faults:
        if f["kind"] in DB_FAULTS:
            length = float(f.get("stall_s") or f.get("down_s") or 1.0) + lease.ttl + lease.retry_every
            disturbed.append((f["at"], f["at"] + length))
        if f["kind"] == "stop_worker":
            # A process paused inside a transaction commits its writes (with their earlier timestamps)
            # only when it resumes: a step it dispatched may become visible after its complete-by.
            disturbed.append((f["at"], f["at"] + float(f["hold_s"]) + sup.interval))
    quiet = [s for s in samples if not in_any(s["complete_by"], s["dispatched_at"], disturbed)]

    fault_counts = Counter(f["kind"] for f in inj.faults)
    kills_by_role = Counter(f["roles"] for f in inj.faults if f["kind"] in ("kill", "kill_leader"))
    svc_counts = run.services.stop()
    log_counts = run.workers.log_counts(
        {
            "fenced_sweeps_rejected": r"is no longer held by",
            "tracebacks": r"Traceback \(most recent call last\)",
        }
    )
    complete_by = longest_complete_by()
    target_rescue = 2 * sup.interval
    target_kill = lease.ttl + lease.renew_every
    target_term = lease.retry_every
    kill_fo = [s["failover"] for s in fo_kill if s["failover"] is not None]
    stop_fo = [s["failover"] for s in fo_stop if s["failover"] is not None]
    term_fo = [s["failover"] for s in fo_term if s["failover"] is not None]
    kill_fo_q = [s["failover"] for s in fo_kill if s["failover"] is not None and not s["disturbed"]]
    stop_fo_q = [s["failover"] for s in fo_stop if s["failover"] is not None and not s["disturbed"]]
    injected_total = sum(fault_counts.values())
    report: dict[str, Any] = {
        "store": o.store,
        "seed": o.seed,
        "workdir": str(run.workdir),
        "stepwarden": _version(),
        "note": o.note,
        "workers": {
            "slots": layout(o.workers),
            "processes_started": run.workers.started,
            "unexpected_exits": len(run.workers.unexpected),
            "crashes": sum(1 for u in run.workers.unexpected if u["phase"] == "running"),
            "startup_failures": sum(1 for u in run.workers.unexpected if u["phase"] == "startup"),
            "unexpected_exit_detail": run.workers.unexpected[:10],
        },
        "settings": {
            "complete_by_s": complete_by,
            "supervisor_interval_s": sup.interval,
            "lease_ttl_s": lease.ttl,
            "lease_renew_s": lease.renew_every,
            "lease_retry_s": lease.retry_every,
            "services": {
                "transient_rate": o.transient_rate if "services" in o.faults else 0.0,
                "hang_rate": o.hang_rate if "services" in o.faults else 0.0,
                "permanent_rate": o.permanent_rate if "services" in o.faults else 0.0,
                "hang_s": hang_seconds(o),
            },
            "fault_every_s": o.fault_every,
            "faults": list(o.faults),
        },
        "timing": {
            "injection_window_s": round(injected_until - t0, 2),
            "settle_s": round(settled_s, 2),
            "elapsed_s": round(end_wall - run_started, 2),
        },
        "tasks": {
            "planned": o.order_plan()[0],
            "submitted": len(sub.acked),
            "in_store": len(tasks),
            "never_acknowledged": len(sub.unacked),
            "submit_errors_retried": sub.errors,
            "by_state": dict(sorted(by_state.items())),
            "throughput_per_s": round(len(tasks) / max(1e-9, end_wall - t0), 2),
        },
        "stuck": len(stuck_rows),
        "stuck_tasks": stuck_rows[:20],
        "lost": len(lost_ids) + ledger.lost,
        "lost_detail": {"not_in_store": lost_ids[:20], "processed_but_not_applied": ledger.lost},
        "duplicate_effects": ledger.duplicate_effects,
        "ledger": ledger.as_dict(),
        "faults": {
            "injected_total": injected_total,
            "by_kind": dict(sorted(fault_counts.items())),
            "kills_by_role": dict(sorted(kills_by_role.items())),
            "leader_kills": len(fo_kill),
            "ordinary_faults_that_hit_a_term_holder": sum(
                1
                for f in inj.faults
                if f["kind"] in ("kill", "stop_worker") and f.get("held_term") is not None
            ),
            "skipped": dict(sorted(inj.skipped.items())),
            "planned": len(plan),
            "services": dict(sorted(svc_counts.items())),
            "services_total": sum(svc_counts.values()),
            "notes": run.notes,
        },
        "stale_replies_rejected": kinds.get("stale_reply", 0),
        "fenced_sweeps_rejected": log_counts["fenced_sweeps_rejected"],
        "rescues": kinds.get("rescued", 0),
        "retries_scheduled": kinds.get("retry_scheduled", 0),
        "requests_by_outcome": {str(r["outcome"]): int(r["n"]) for r in requests},
        "rescue_latency_s": stats([s["latency"] for s in samples]),
        "rescue_latency_without_backoff_s": stats([s["machinery"] for s in samples]),
        "rescue_latency_without_backoff_undisturbed_s": stats([s["machinery"] for s in quiet]),
        "rescue_detection_s": stats([s["detection"] for s in samples]),
        "dead_worker_rescues": len(early),
        "dead_worker_rescue_to_dispatch_s": stats([s["dispatched_at"] - s["rescued_at"] for s in early]),
        "slowest_undisturbed_rescues": [
            {
                "task_id": s["task_id"],
                "step_idx": s["step_idx"],
                "attempt": s["attempt"],
                "t_complete_by": round(s["complete_by"] - t0, 3),
                "detection_s": round(s["detection"], 3),
                "backoff_s": round(s["backoff"], 3),
                "without_backoff_s": round(s["machinery"], 3),
            }
            for s in sorted(quiet, key=lambda s: -s["machinery"])[:10]
        ],
        "retry_backoff_s": stats([s["backoff"] for s in samples]),
        "failover_after_sigkill_s": stats(kill_fo) | {"unmeasured": len(fo_kill) - len(kill_fo)},
        "failover_after_sigkill_undisturbed_s": stats(kill_fo_q),
        "failover_after_sigstop_s": stats(stop_fo) | {"unmeasured": len(fo_stop) - len(stop_fo)},
        "failover_after_sigstop_undisturbed_s": stats(stop_fo_q),
        "failover_after_sigterm_s": stats(term_fo) | {"unmeasured": len(fo_term) - len(term_fo)},
        "handover_after_resign_s": stats(handovers),
        "leader_terms": overlaps,
        "leader_changes": max(0, len(acq) - 1),
        "log_tracebacks": log_counts["tracebacks"],
        "targets": {
            "rescue_without_backoff_le_s": target_rescue,
            "rescue_without_backoff_undisturbed_p99_met": _le(
                pct([s["machinery"] for s in quiet], 99), target_rescue
            ),
            "failover_after_sigkill_le_s": target_kill,
            "failover_after_sigkill_undisturbed_max_met": _le(
                max(kill_fo_q) if kill_fo_q else None, target_kill
            ),
            "failover_after_sigstop_undisturbed_max_met": _le(
                max(stop_fo_q) if stop_fo_q else None, target_kill
            ),
            "handover_after_resign_le_s": target_term,
            "handover_after_resign_max_met": _le(max(handovers) if handovers else None, target_term),
        },
        "fault_log": [
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in f.items() if k != "at"}
            for f in inj.faults
        ],
    }
    problems = []
    if not tasks or sub.unacked:
        problems.append(
            f"submissions failed: {len(tasks)} task(s) in the store, {len(sub.unacked)} order(s) never "
            f"acknowledged (last error: {sub.last_error or '-'})"
        )
    if report["stuck"]:
        problems.append(f"{report['stuck']} task(s) stuck")
    if report["lost"]:
        problems.append(f"{report['lost']} task(s) lost")
    if report["duplicate_effects"]:
        problems.append(f"{report['duplicate_effects']} duplicate effect(s)")
    if not ledger.ok:
        problems.extend(ledger.problems[:10])
    crashes = report["workers"]["crashes"]
    if crashes:
        problems.append(f"{crashes} running worker(s) crashed (REL3)")
    if overlaps["acting_overlaps"] or overlaps["fenced_writes_by_non_holder"]:
        problems.append(f"{overlaps['acting_overlaps']} acting overlap(s) of leader terms")
    report["problems"] = problems
    report["ok"] = not problems
    return report


def _version() -> dict[str, Any]:
    """Which code ran: the package's location, and the repository's commit when it is a checkout."""
    import stepwarden

    out: dict[str, Any] = {"path": str(Path(stepwarden.__file__).resolve().parent)}
    with contextlib.suppress(Exception):
        git = ["git", "-C", out["path"]]
        out["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        out["dirty"] = bool(
            subprocess.run(
                [*git, "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        )
    return out


def _le(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


def _teardown(run: Run, ok: bool) -> None:
    for step in (
        lambda: run.workers.stop_all() if run.workers else None,
        lambda: run.services.stop() if run.services else None,
        lambda: run.proxy.stop() if run.proxy else None,
        lambda: run.reader.close() if run.reader else None,
        lambda: run.store.close() if run.store else None,
        lambda: run.pg.stop("immediate") if run.pg else None,
    ):
        try:
            step()
        except Exception as e:  # keep tearing down the rest
            print(f"[chaos] teardown: {e!r}", file=sys.stderr)
    if (ok and not run.o.keep) and not run.o.workdir:
        shutil.rmtree(run.workdir, ignore_errors=True)
    else:
        log_line(run.o, f"kept {run.workdir} (worker logs in logs/)")


# -- output --------------------------------------------------------------------------------------


def summary_lines(r: dict[str, Any]) -> list[str]:
    def fmt(s: dict[str, Any]) -> str:
        if not s.get("n"):
            return "n=0"
        return f"p50 {s['p50']:.2f}s  p99 {s['p99']:.2f}s  max {s['max']:.2f}s  (n={s['n']})"

    t = r["tasks"]
    f = r["faults"]
    lt = r["leader_terms"]
    return [
        f"store {r['store']}  seed {r['seed']}  workers {r['workers']['slots']}  "
        f"elapsed {r['timing']['elapsed_s']}s (injection {r['timing']['injection_window_s']}s, "
        f"settle {r['timing']['settle_s']}s)",
        f"tasks: submitted {t['submitted']}, by final state {t['by_state']}",
        f"stuck {r['stuck']}  lost {r['lost']}  duplicate effects {r['duplicate_effects']}  "
        f"acting overlaps {lt['acting_overlaps']}  (ledger ok: {r['ledger']['ok']})",
        f"faults injected: {f['injected_total']} {f['by_kind']}  kills by role {f['kills_by_role']}",
        f"services' faults: {f['services_total']} {f['services']}",
        f"stale replies rejected {r['stale_replies_rejected']}  fenced sweeps rejected "
        f"{r['fenced_sweeps_rejected']}  rescues {r['rescues']}  leader terms {lt['terms']}",
        f"rescue latency (complete-by -> retry dispatched): {fmt(r['rescue_latency_s'])}",
        f"  without the policy's back-off: {fmt(r['rescue_latency_without_backoff_s'])}; "
        f"undisturbed: {fmt(r['rescue_latency_without_backoff_undisturbed_s'])} "
        f"(target <= {r['targets']['rescue_without_backoff_le_s']}s)",
        f"failover after SIGKILL of the leader: {fmt(r['failover_after_sigkill_s'])}; undisturbed "
        f"{fmt(r['failover_after_sigkill_undisturbed_s'])} "
        f"(target <= {r['targets']['failover_after_sigkill_le_s']}s)",
        f"failover after SIGSTOP of the leader: {fmt(r['failover_after_sigstop_s'])}; undisturbed "
        f"{fmt(r['failover_after_sigstop_undisturbed_s'])}",
        f"failover after SIGTERM of the leader: {fmt(r['failover_after_sigterm_s'])}; "
        f"resign -> next leader {fmt(r['handover_after_resign_s'])} "
        f"(target <= {r['targets']['handover_after_resign_le_s']}s)",
        f"worker crashes {r['workers']['crashes']}, failed starts {r['workers']['startup_failures']}  "
        f"tracebacks in logs {r['log_tracebacks']}",
        ("OK" if r["ok"] else "FAILED: " + "; ".join(r["problems"])),
    ]


def parse_args(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(
        prog="bench/chaos.py", description="Run the demo workload under injected faults and report."
    )
    p.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    p.add_argument("--db", help="store URL (default: a fresh SQLite file, or a PostgreSQL server of our own)")
    p.add_argument("--workers", type=int, default=5, help="worker processes (default 5)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of fault injection (default 60)")
    p.add_argument("--tasks", type=int, help="orders to submit, spread over the window")
    p.add_argument("--rate", type=float, help="orders per second (default tasks/duration, else 8)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--faults",
        default=",".join(FAULT_GROUPS),
        help=f"comma-separated fault kinds (default all: {','.join(FAULT_GROUPS)}); 'none' for none",
    )
    p.add_argument("--fault-every", type=float, default=4.0, help="mean seconds between faults (default 4)")
    p.add_argument("--settle", type=float, default=120.0, help="max seconds to wait for every task to end")
    p.add_argument("--json", dest="json_path", help="write the report here")
    p.add_argument("--workdir", help="keep logs and data here (default: a temp dir, removed on success)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir even on success")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--note", default="", help="free text kept in the report (e.g. which code ran)")
    a = p.parse_args(argv)
    faults = tuple(x.strip() for x in a.faults.split(",") if x.strip() and x.strip() != "none")
    bad = [x for x in faults if x not in FAULT_GROUPS]
    if bad:
        p.error(f"unknown fault kind(s) {', '.join(bad)}; choose from {', '.join(FAULT_GROUPS)}")
    if not 1 <= a.workers <= 64:
        p.error("--workers must be between 1 and 64")
    if not 1 <= a.duration <= 24 * 3600 or not 1 <= a.settle <= 3600:
        p.error("--duration must be within [1, 86400] and --settle within [1, 3600] seconds")
    if a.tasks is not None and not 1 <= a.tasks <= 10_000_000:
        p.error("--tasks must be between 1 and 10000000")
    if a.rate is not None and not 0 < a.rate <= 10_000:
        p.error("--rate must be within (0, 10000]")
    if not 0.2 <= a.fault_every <= 3600:
        p.error("--fault-every must be within [0.2, 3600] seconds")
    return Options(
        store=a.store,
        db=a.db,
        workers=a.workers,
        duration=a.duration,
        tasks=a.tasks,
        rate=a.rate,
        seed=a.seed,
        faults=faults,
        fault_every=a.fault_every,
        settle=a.settle,
        json_path=a.json_path,
        workdir=a.workdir,
        keep=a.keep,
        quiet=a.quiet,
        note=a.note,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_services"]:
        return serve_counting_services(argv[1:])
    o = parse_args(argv)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds through execute(), which ends every process it started

    signal.signal(signal.SIGTERM, interrupted)
    try:
        report, ok = execute(o)
    except KeyboardInterrupt:
        print("[chaos] interrupted; every process it started was ended", file=sys.stderr)
        return 130
    text = json.dumps(report, indent=2, default=str)
    if o.json_path:
        Path(o.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(o.json_path).write_text(text + "\n")
    for line in summary_lines(report):
        print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
