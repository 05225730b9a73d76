"""Chaos harness: the demo's order workload under injected faults, on SQLite or PostgreSQL.

    .venv/bin/python bench/chaos.py --store sqlite|postgres [--db URL] [--workers N] [--duration S]
        [--tasks N] [--seed S] [--faults kill,stop,term,proxy,restart,services] [--json PATH]
        [--retention SECONDS] [--operator-every SECONDS]

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
- ``services``: the services' own faults, at the demo's rates;
- with ``--operator-every``, an operator: ``stepwarden task cancel`` and ``task retry`` through the
  real CLI on random tasks; with ``--retention``, the workers keep finished tasks that many seconds,
  so the leader prunes the run's tasks while it runs (and while leaders are killed).

A thread follows the store meanwhile (``Tracker``), so that what a prune deletes is counted before
it goes. Then it stops injecting, waits (bounded) for every task to end, stops its processes by
pid, reads the services' ledger and the store's own records (events, lease_terms, requests, as
the tracker kept them), and prints and writes a JSON report; see ``bench/CHAOS.md`` for what each
figure means. Exit status 1 when any task is stuck, lost or unaccounted, any effect was applied
twice (or a compensated one survives), a cancelled task was not undone, two leader terms acted at
once, or a running worker crashed; 2 on bad arguments.

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
    # The workers' record retention, seconds (``stepwarden worker --retention``): None keeps the
    # default (7 days: nothing is pruned during a run); a few seconds makes the leader prune the
    # run's finished tasks while it runs, and while leaders are killed.
    retention: float | None = None
    operator_every: float = 0.0  # mean seconds between operator actions (task cancel / retry); 0: none
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
        self.stop_s: float | None = None
        self.killed_at_stop: list[int] = []

    def start(self, slot: Slot) -> subprocess.Popen[bytes]:
        slot.incarnation += 1
        slot.stopped = False
        name = slot.name()
        cmd = [sys.executable, "-m", "stepwarden", "--db", self.url, "--log-level", "WARNING", "worker"]
        cmd += ["--app", "stepwarden.demo.app:app", "--roles", slot.roles, "--name", name]
        if self.o.retention is not None:
            cmd += ["--retention", repr(self.o.retention / 86400.0)]  # the option takes days
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
        """SIGTERM every worker, SIGKILL at the deadline; records how long the stop took and which
        workers did not stop gracefully in time (``stop_s``, ``killed_at_stop``)."""
        t = time.monotonic()
        procs = [s.proc for s in self.slots if s.proc is not None] + [p for p, _ in self.retiring]
        running = []
        for p in procs:
            if p.poll() is None:
                running.append(p)
                self.expected.add(p.pid)
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            _end(p, max(0.1, deadline - time.monotonic()))
        if running:  # the first stop, at the end of the run (teardown may call it again)
            self.stop_s = round(time.monotonic() - t, 3)
            self.killed_at_stop = [p.pid for p in running if p.returncode == -signal.SIGKILL]

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


# -- following the run while it runs --------------------------------------------------------------

# The task states that never change again, and the only ones the leader's prune deletes (``error``
# waits for an operator and is kept): a task seen in one of them has its outcome known for good.
TERMINAL = ("processed", "compensated", "cancelled")
# The events the analysis needs row by row; every other kind is only counted.
KEPT_EVENTS = ("rescued", "retry_scheduled", "dispatched", "lease_acquired", "lease_resigned")
# A finished task is read again by every poll for this long after the last good poll began: a
# transaction stamps ``finished_at`` with its own clock reading and may commit a little later
# (at most seconds: PostgreSQL ends a session idle in a transaction after 5 s).
FINISH_MARGIN = 15.0
EVENT_BATCH = 20_000
MIN_RETENTION = 5.0  # seconds: see parse_args


class Tracker(threading.Thread):
    """Follows the store while the run goes on, so a prune cannot take records away uncounted.

    With a short retention (``--retention``) the leader deletes the run's finished tasks -- steps,
    requests, replies, events and messages with them -- and old lease terms and task-less events,
    minutes before the harness would read them at the end. So this thread reads them as they
    appear, every ``every`` seconds, and keeps what the end of the run needs:

    - each task of the run (``tasks``): its latest state and whether a cancel was ever requested.
      A poll reads the tasks not finished and those finished since shortly before the previous
      good poll, so each task is seen in its final state before its retention is up, however
      many tasks the run has;
    - every event once (``kinds`` by kind, and the rows of ``KEPT_EVENTS``): on SQLite in id order,
      which is commit order; on PostgreSQL by the transaction that wrote each row (``xact_id``,
      as ``stepwarden.metrics.tally`` reads it): the rows of every transaction older than the
      snapshot's ``xmin`` are final, so each poll reads those written from the previous poll's
      ``xmin`` on and drops the ones it has read before;
    - every supervisor lease term (``terms``), and when ``event_totals`` -- what prunes deleted,
      counted by the deleting transaction -- grew: the moments prunes ran (``prunes``).

    Its last poll (``finish``, once the workers are stopped and nothing moves) reads every task of
    the run: those it returns are in the store, the others were pruned, in the last state seen.
    A task that was pruned before it was ever seen in a final state (``unaccounted``) would mean
    the thread was blind for longer than the retention: the harness cannot vouch for it, and the
    run fails. With the default retention nothing is pruned and this is what the end read gave.
    """

    def __init__(
        self, url: str, prefix: str, first_event: int, run_started: float, every: float = 0.5
    ) -> None:
        super().__init__(name="chaos-tracker", daemon=True)
        self.reader = Reader(url)
        self.postgres = self.reader.sqlite_path is None
        self.prefix = prefix
        self.first_event = first_event
        self.run_started = run_started
        self.every = every
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.tasks: dict[int, dict[str, Any]] = {}
        self.in_store_at_end: set[int] | None = None
        self.events: list[dict[str, Any]] = []
        self.event_ids: set[int] = set()
        self.kinds: Counter[str] = Counter()
        self.terms: dict[int, dict[str, Any]] = {}
        self.pruned_totals: list[tuple[float, int]] = []  # (when, SUM(event_totals.pruned)) as it grew
        self.polls = 0
        self.failed_polls = 0
        self.longest_blind_s = 0.0
        self._horizon = 0.0  # tasks finished before it were seen final by an earlier poll
        self._cursor = first_event if not self.postgres else 0  # SQLite: id; PostgreSQL: last xmin
        self._last_ok = time.monotonic()

    # -- reading --
    def _read_events(self) -> tuple[list[dict[str, Any]], int]:
        """The events not read yet (and some read before, on PostgreSQL), and the cursor to keep once
        they are merged: a poll that fails half-way keeps the old one and reads them again."""
        cols = "id, task_id, step_idx, attempt, kind, actor, detail, at"
        out: list[dict[str, Any]] = []
        if not self.postgres:
            cursor = self._cursor
            for _ in range(1000):  # bounded: EVENT_BATCH rows a round
                rows = self.reader.rows(
                    f"SELECT {cols} FROM events WHERE id > ? ORDER BY id LIMIT ?", (cursor, EVENT_BATCH)
                )
                out.extend(rows)
                if rows:
                    cursor = int(rows[-1]["id"])
                if len(rows) < EVENT_BATCH:
                    break
            return out, cursor
        xmin = int(
            self.reader.rows("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS x")[0]["x"]
        )
        after = (self._cursor, 0)  # (xact_id, id): every row of a transaction below _cursor was read
        for _ in range(1000):
            rows = self.reader.rows(
                f"SELECT xact_id, {cols} FROM events WHERE id > ? AND (xact_id, id) > (?, ?) "
                "ORDER BY xact_id, id LIMIT ?",
                (self.first_event, after[0], after[1], EVENT_BATCH),
            )
            out.extend(rows)
            if len(rows) < EVENT_BATCH:
                break
            after = (int(rows[-1]["xact_id"]), int(rows[-1]["id"]))
        return out, xmin  # the next poll reads from the oldest transaction running now

    def poll(self, full: bool = False) -> None:
        """One read of everything; ``full``: every task of the run, not only the recent ones."""
        began = now()
        tasks = self.reader.rows(
            "SELECT id, correlation_id, state, cancel_requested FROM tasks"
            " WHERE substr(correlation_id, 1, ?) = ? AND (finished_at IS NULL OR finished_at >= ?)",
            (len(self.prefix), self.prefix, 0.0 if full else self._horizon),
        )
        events, cursor = self._read_events()
        terms = self.reader.rows(
            "SELECT term, holder, acquired_at, ended_at FROM lease_terms WHERE name = ? AND acquired_at >= ?",
            (LEASE_NAME, self.run_started - 1.0),
        )
        pruned = int(self.reader.rows("SELECT COALESCE(SUM(pruned), 0) AS n FROM event_totals")[0]["n"])
        with self.lock:
            for r in tasks:
                t = self.tasks.setdefault(
                    int(r["id"]), {"correlation_id": r["correlation_id"], "cancel_requested": False}
                )
                t["state"] = r["state"]
                t["cancel_requested"] = t["cancel_requested"] or bool(r["cancel_requested"])
                t.setdefault("seen_at", began)  # when first seen: a task seen long ago and not final is slow
            for e in events:
                eid = int(e["id"])
                if eid in self.event_ids:
                    continue
                self.event_ids.add(eid)
                self.kinds[e["kind"]] += 1
                if e["kind"] in KEPT_EVENTS:
                    e.pop("xact_id", None)
                    self.events.append(e)
            for r in terms:
                self.terms[int(r["term"])] = r
            if not self.pruned_totals or pruned > self.pruned_totals[-1][1]:
                self.pruned_totals.append((began, pruned))
            if full:
                self.in_store_at_end = {int(r["id"]) for r in tasks}
        self._cursor = cursor
        self._horizon = began - FINISH_MARGIN
        self.polls += 1

    def _poll_once(self, full: bool = False) -> bool:
        try:
            self.poll(full)
        except Exception:  # the store is restarting or cut off: the next poll reads it all
            self.failed_polls += 1
            return False
        t = time.monotonic()
        self.longest_blind_s = max(self.longest_blind_s, t - self._last_ok)
        self._last_ok = t
        return True

    def run(self) -> None:
        while not self.halt.is_set():
            t = time.monotonic()
            self._poll_once()
            self.halt.wait(max(0.05, self.every - (time.monotonic() - t)))
        for _ in range(10):  # the last read: every task; bounded in count
            if self._poll_once(full=True):
                break
            time.sleep(1.0)
        self.reader.close()

    def finish(self) -> None:
        """Stop after one last, full poll (call it once the workers are stopped)."""
        self.halt.set()
        self.join(timeout=180)

    # -- what others read while it runs --
    def snapshot(self) -> dict[int, tuple[str, bool, float]]:
        """Task id -> (state, cancel ever requested, when first seen), as of the last poll."""
        with self.lock:
            return {i: (t["state"], t["cancel_requested"], t["seen_at"]) for i, t in self.tasks.items()}

    def seen_terminal(self) -> set[int]:
        with self.lock:
            return {i for i, t in self.tasks.items() if t["state"] in TERMINAL}

    def prune_moments(self) -> list[float]:
        """When the store's count of pruned events was seen to grow (the first reading is the base)."""
        with self.lock:
            return [t for t, _ in self.pruned_totals[1:]]


# -- operator actions -----------------------------------------------------------------------------


class Operator(threading.Thread):
    """An operator at the console during the window: ``stepwarden task cancel`` and ``task retry``
    on random tasks, through the real CLI in a process of its own, as a user's script would call it
    (exit 0: done; 2: refused, the task being in no state for it; 1: failed).

    A seeded schedule, an action every ``every`` seconds on average (each gap uniform in 0.5-1.5 x).
    A retry needs a task in ``error`` (the demo's are the orders whose stock reservation was refused
    for good): the first action after one appears is a retry, then one action in three while some
    exist. Every other action is a cancel: of a task in flight (pending or processing) mostly, one
    time in ten of a task in ``error`` (a cancel undoes it), one in ten of a ``processed`` one (to be
    refused). Most tasks finish in well under a second, before the CLI has even started, so a cancel
    goes to a *slow* task in flight when there is one -- seen in flight for a second or more: its
    step hung, or is being retried, or its worker was killed -- the cases where a cancel has work to
    do. Targets come from the tracker's last poll, so a target may have moved on since: a refusal
    then is the CLI doing its job, counted, not a failure.
    """

    def __init__(
        self,
        o: Options,
        url: str,
        env: dict[str, str],
        tracker: Tracker,
        seed: int,
        stop_at: float,
        t0: float,
    ) -> None:
        super().__init__(name="chaos-operator", daemon=True)
        self.o = o
        self.url = url
        self.env = env
        self.tracker = tracker
        self.rng = random.Random(seed)
        self.stop_at = stop_at
        self.t0 = t0
        self.halt = threading.Event()
        self.actions: list[dict[str, Any]] = []
        self.skipped = 0

    def run(self) -> None:
        every = self.o.operator_every
        due = time.monotonic() + self.rng.uniform(0.3, 0.7) * every
        for _ in range(1_000_000):  # bounded: one action per iteration
            while not self.halt.is_set() and time.monotonic() < due:
                self.halt.wait(min(0.1, max(0.0, due - time.monotonic())))
            if self.halt.is_set() or time.monotonic() >= self.stop_at:
                return
            self.act()
            due = max(due + self.rng.uniform(0.5, 1.5) * every, time.monotonic())

    def pick(self) -> tuple[str, int, str] | None:
        """(action, task id, its state as last seen), or None if no task fits."""
        snap = self.tracker.snapshot()
        by_state: dict[str, list[int]] = {}
        slow_before = now() - 1.0
        for tid, (state, cancel_requested, seen_at) in sorted(snap.items()):
            if not cancel_requested:
                by_state.setdefault(state, []).append(tid)
                if state in ("pending", "processing") and seen_at <= slow_before:
                    by_state.setdefault("slow", []).append(tid)
        errors = by_state.get("error", [])
        retried = any(a["action"] == "retry" and a["outcome"] == "accepted" for a in self.actions)
        if errors and (not retried or self.rng.random() < 1 / 3):
            return "retry", self.rng.choice(errors), "error"
        r = self.rng.random()
        in_flight = by_state.get("pending", []) + by_state.get("processing", [])
        processed = by_state.get("processed", [])
        if r < 0.1 and errors:
            return "cancel", self.rng.choice(errors), "error"
        if r < 0.2 and processed:
            return "cancel", self.rng.choice(processed[-200:]), "processed"
        if in_flight:
            tid = self.rng.choice(by_state.get("slow") or in_flight)
            return "cancel", tid, snap[tid][0]
        return None

    def act(self) -> None:
        choice = self.pick()
        if choice is None:
            self.skipped += 1
            return
        action, tid, seen = choice
        at = now()
        t = time.monotonic()
        cmd = [sys.executable, "-m", "stepwarden", "--db", self.url, "task", action, str(tid)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=60)
            code, said = p.returncode, (p.stdout.strip() or p.stderr.strip()).splitlines()
        except subprocess.TimeoutExpired:  # run() has killed it
            code, said = -1, ["timed out after 60 s"]
        outcome = {0: "accepted", 2: "refused"}.get(code, "failed")
        rec = {
            "t": round(at - self.t0, 3),
            "action": action,
            "task_id": tid,
            "seen_state": seen,
            "exit": code,
            "outcome": outcome,
            "said": (said[-1] if said else "")[:300],
            "took_s": round(time.monotonic() - t, 3),
        }
        self.actions.append(rec)
        log_line(self.o, f"operator {action} {tid} ({seen}): {outcome}: {rec['said']}")


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
    tracker: Tracker | None = None
    operator: Operator | None = None
    events_before: int = 0  # events in the store before the run (a reused --db)
    pruned_before: int = 0  # event_totals' sum before the run
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
        run.events_before = int(reader.rows("SELECT COUNT(*) AS n FROM events")[0]["n"])
        run.pruned_before = int(reader.rows("SELECT COALESCE(SUM(pruned), 0) AS n FROM event_totals")[0]["n"])
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
        f"{o.duration:g}s, {len(plan)} faults planned ({', '.join(kinds) or 'none'}); workdir {run.workdir}"
        + (f"; retention {o.retention:g}s" if o.retention is not None else "")
        + (f"; an operator action every {o.operator_every:g}s" if o.operator_every else ""),
    )
    run.tracker = tracker = Tracker(run.direct_url, prefix, first_event, run_started)
    tracker.start()
    t0_mono = time.monotonic()
    injector.t0 = t0 = now()
    window_end = t0_mono + o.duration
    submitter = Submitter(app, prefix, total, rate, o.seed, window_end)
    submitter.start()
    if o.operator_every:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("STEPWARDEN_DB", None)
        run.operator = Operator(o, run.direct_url, env, tracker, o.seed * 104729 + 3, window_end, t0)
        run.operator.start()
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
            _progress(o, reader, prefix, submitter, injector, tracker, t - t0_mono)
        time.sleep(0.02)
    injector.skipped.update(p.kind for p in queue)
    injected_until = now()
    if run.operator is not None:
        run.operator.halt.set()
        run.operator.join(timeout=90)  # an action in progress ends within its 60 s timeout
    injector.flush()
    submitter.halt.set()
    submitter.join(timeout=60)
    submitter.halt.clear()
    submitter.retry_unacked(time.monotonic() + 30)
    log_line(o, f"injection over: {len(injector.faults)} faults; waiting up to {o.settle:g}s for every task")
    settle_start = time.monotonic()
    settle_end = settle_start + o.settle
    while time.monotonic() < settle_end:
        workers.check()
        rows = reader.try_rows(
            "SELECT id, state FROM tasks WHERE substr(correlation_id, 1, ?) = ?", (len(prefix), prefix)
        )
        if rows is not None and all(r["state"] in FINAL for r in rows):
            # Every acknowledged order's task is final in the store, or was seen final and pruned.
            stored = {int(r["id"]) for r in rows}
            seen = tracker.seen_terminal()
            if all(tid in stored or tid in seen for tid in submitter.acked.values()):
                break
        time.sleep(0.5)
    settled_s = time.monotonic() - settle_start
    workers.check(restart=False)
    workers.stop_all()
    end_wall = now()
    tracker.finish()  # its last, full read: nothing moves any more
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


def _progress(
    o: Options, reader: Reader, prefix: str, sub: Submitter, inj: Injector, tracker: Tracker, elapsed: float
) -> None:
    rows = reader.try_rows(
        "SELECT id, state FROM tasks WHERE substr(correlation_id, 1, ?) = ?", (len(prefix), prefix)
    )
    final = sum(1 for r in rows or [] if r["state"] in FINAL)
    pruned = len(tracker.seen_terminal() - {int(r["id"]) for r in rows or []}) if rows is not None else 0
    log_line(
        o,
        f"t={elapsed:5.1f}s submitted {len(sub.acked)} (retrying {len(sub.unacked)}), final {final}"
        + (f" (and {pruned} pruned)" if pruned else "")
        + f", in flight {len(rows or []) - final}, faults {len(inj.faults)}"
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
    assert run.tracker is not None
    reader, tracker = run.reader, run.tracker
    # The run's tasks: as the tracker's last, full read found them in the store, and those the
    # leader pruned before it, in the last state the tracker saw them in.
    stored = tracker.in_store_at_end
    if stored is None:
        raise RuntimeError("the store could not be read at the end of the run")
    tasks = [
        {"id": tid, "correlation_id": t["correlation_id"], "state": t["state"], "pruned": tid not in stored}
        for tid, t in sorted(tracker.tasks.items())
    ]
    pruned_rows = [t for t in tasks if t["pruned"]]
    unaccounted = [t for t in pruned_rows if t["state"] not in TERMINAL]
    by_state = Counter(t["state"] for t in tasks)
    stuck_rows = [t for t in tasks if t["state"] not in FINAL and not t["pruned"]]
    in_store = {t["correlation_id"] for t in tasks}
    lost_ids = sorted(oid for oid in sub.acked if oid not in in_store)
    ledger = check_ledger(
        effects, [OrderOutcome(t["correlation_id"], str(t["id"]), t["state"]) for t in tasks]
    )
    # Events, lease terms and prunes, as the tracker followed them.
    events = sorted(
        (e for e in tracker.events if e["kind"] in ("rescued", "retry_scheduled", "dispatched")),
        key=lambda e: int(e["id"]),
    )
    kinds = Counter(tracker.kinds)
    leases = sorted((e for e in tracker.events if e["kind"].startswith("lease_")), key=lambda e: int(e["id"]))
    acq = [
        {"at": float(a["at"]), "term": int(_detail(a).get("term", 0)), "holder": a["actor"]}
        for a in leases
        if a["kind"] == "lease_acquired" and _detail(a).get("lease") == LEASE_NAME
    ]
    resigned = [
        {"at": float(a["at"]), "term": int(_detail(a).get("term", 0)), "holder": a["actor"]}
        for a in leases
        if a["kind"] == "lease_resigned" and _detail(a).get("lease") == LEASE_NAME
    ]
    terms = [tracker.terms[k] for k in sorted(tracker.terms)]
    rescued = [e for e in events if e["kind"] == "rescued"]
    overlaps = term_analysis(terms, rescued)
    mark_term_holders(inj.faults, terms)
    # Of the tasks still stored: a pruned task's requests went with it.
    requests = reader.rows(
        "SELECT outcome, COUNT(*) AS n FROM requests WHERE task_id IN "
        "(SELECT id FROM tasks WHERE substr(correlation_id, 1, ?) = ?) GROUP BY outcome",
        (len(prefix), prefix),
    )
    events_check = _events_check(run, tracker, first_event)
    operator = _operator_report(run, tasks, effects)
    retention = _retention_report(run, tracker, inj, tasks, t0)
    undo_kills = _undo_kill_report(run, inj, tasks)

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
            "stop_s": run.workers.stop_s,  # SIGTERM of every worker at the end -> all exited
            "killed_at_stop": run.workers.killed_at_stop,  # pids that outlived the 20 s and were SIGKILLed
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
            "in_store": len(tasks) - len(pruned_rows),
            "pruned": len(pruned_rows),
            "unaccounted": len(unaccounted),
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
        "retention": retention,
        "operator": operator,
        "kills_in_flight": undo_kills,
        "events": events_check,
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
        "requests_by_outcome": {str(r["outcome"]): int(r["n"]) for r in requests},  # of stored tasks
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
    if unaccounted:
        problems.append(
            f"{len(unaccounted)} task(s) pruned before the harness saw them final (blind for "
            f"{tracker.longest_blind_s:.1f}s at most): their outcome is unchecked"
        )
    if not events_check["complete"]:
        problems.append(
            f"the harness read {events_check['tracked']} of the run's {events_check['expected']} events:"
            " the figures and the leader-term check may miss some"
        )
    problems.extend(operator["problems"][:10])
    problems.extend(undo_kills["problems"][:10])
    report["problems"] = problems
    report["ok"] = not problems
    return report


def _cmp3_tasks(reader: Reader) -> set[int]:
    """Tasks whose compensation failed for good (CMP3: ``error`` with a ``compensation_failed``
    alert naming the step left un-undone): the outcome the spec gives an undo that exhausts its
    retries, so not a violation, but never an effect silently left."""
    rows = reader.rows("SELECT DISTINCT task_id FROM alerts WHERE kind = 'compensation_failed'")
    return {int(r["task_id"]) for r in rows if r["task_id"] is not None}


def _effects_left(effects: dict[str, dict[str, object]]) -> Counter[int]:
    """Task id -> how many of its effects are applied more often than undone, from the ledger."""
    left: Counter[int] = Counter()
    for key, e in effects.items():
        task, _, _ = key.rpartition(":")
        applied, undone = e.get("applied", 0), e.get("undone", 0)
        if task.isdigit() and isinstance(applied, int) and isinstance(undone, int) and applied > undone:
            left[int(task)] += 1
    return left


def undone_as_promised(state: str | None, tid: int, cmp3: set[int]) -> bool:
    """A task an operator cancelled, or whose undo was in flight when its worker was killed, ends
    undone (``cancelled``, ``compensated``), or in ``error`` with its compensation failed (CMP3)."""
    return state in ("cancelled", "compensated") or (state == "error" and tid in cmp3)


def _operator_report(
    run: Run, tasks: list[dict[str, Any]], effects: dict[str, dict[str, object]]
) -> dict[str, Any]:
    """The operator's actions and what became of their tasks.

    The cancelled tasks are those whose cancel the CLI acknowledged and those the store showed with
    ``cancel_requested`` (only the operator sets it; a cancel whose exit status was lost still
    counts). Each must end undone (``undone_as_promised``), with no effect of it left standing in
    the services' ledger; each acknowledged cancel must be recorded. Each retried task must end in
    a final state. Duplicates are the ledger's check, over every task."""
    assert run.reader is not None and run.tracker is not None
    actions = run.operator.actions if run.operator is not None else []
    final = {int(t["id"]): str(t["state"]) for t in tasks}
    requested = {tid for tid, t in run.tracker.tasks.items() if t["cancel_requested"]}
    acked_cancels = {a["task_id"] for a in actions if a["action"] == "cancel" and a["outcome"] == "accepted"}
    retried = {a["task_id"] for a in actions if a["action"] == "retry" and a["outcome"] == "accepted"}
    cancelled = acked_cancels | requested
    cmp3 = _cmp3_tasks(run.reader)
    left = _effects_left(effects)
    problems: list[str] = []
    for tid in sorted(acked_cancels - requested):
        problems.append(f"task {tid}: cancel acknowledged by the CLI but never recorded")
    for tid in sorted(cancelled):
        state = final.get(tid)
        if not undone_as_promised(state, tid, cmp3):
            problems.append(f"task {tid} was cancelled but ended {state}")
        elif state != "error" and left[tid]:
            problems.append(f"task {tid} ended {state} with {left[tid]} effect(s) still applied")
    for tid in sorted(retried):
        if final.get(tid) not in FINAL:
            problems.append(f"task {tid} was retried but is {final.get(tid)}, not final")

    def outcomes(action: str) -> dict[str, int]:
        c = Counter(a["outcome"] for a in actions if a["action"] == action)
        return {k: c.get(k, 0) for k in ("accepted", "refused", "failed")}

    return {
        "every_s": run.o.operator_every or None,
        "actions": len(actions),
        "skipped_no_target": run.operator.skipped if run.operator is not None else 0,
        "cancel": outcomes("cancel"),
        "retry": outcomes("retry"),
        "cancelled_tasks": len(cancelled),
        "cancelled_final_states": dict(sorted(Counter(str(final.get(t)) for t in cancelled).items())),
        "cancelled_undo_failed_cmp3": sum(1 for t in cancelled if final.get(t) == "error" and t in cmp3),
        "cancelled_with_effects_left": sum(1 for t in cancelled if final.get(t) != "error" and left[t]),
        "retried_tasks": len(retried),
        "retried_final_states": dict(sorted(Counter(str(final.get(t)) for t in retried).items())),
        "problems": problems,
        "log": actions[:300],
    }


def _undo_kill_report(run: Run, inj: Injector, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """SIGKILLs by what the victim had in flight, as the store showed right after each kill
    (``Injector.note_in_flight``); the tasks whose undo was in flight must end undone."""
    assert run.reader is not None
    kills = [f for f in inj.faults if f["kind"] in ("kill", "kill_leader")]
    known = [f for f in kills if f.get("in_flight") is not None]
    with_undo = [f for f in known if f["in_flight"]["undo"]]
    undo_tasks = sorted({t for f in with_undo for t in f.get("undo_tasks", [])})
    final = {int(t["id"]): str(t["state"]) for t in tasks}
    cmp3 = _cmp3_tasks(run.reader) if undo_tasks else set()
    problems = [
        f"task {tid}: its undo was in flight in a killed worker, and it ended {final.get(tid)}"
        for tid in undo_tasks
        if not undone_as_promised(final.get(tid), tid, cmp3)
    ]
    return {
        "kills": len(kills),
        "unknown": len(kills) - len(known),
        "with_undo_in_flight": len(with_undo),
        "aimed_at_undo": sum(1 for f in kills if f.get("aimed_at_undo")),
        "with_forward_step_in_flight": sum(1 for f in known if f["in_flight"]["do"]),
        "holding_compensating_tasks": sum(1 for f in known if f["in_flight"]["compensating_tasks_held"]),
        "undo_tasks": len(undo_tasks),
        "undo_tasks_final_states": dict(sorted(Counter(str(final.get(t)) for t in undo_tasks).items())),
        "problems": problems,
    }


def _retention_report(
    run: Run, tracker: Tracker, inj: Injector, tasks: list[dict[str, Any]], t0: float
) -> dict[str, Any]:
    """What the leader pruned during the run, and which leader faults came while it was pruning."""
    moments = tracker.prune_moments()
    first = moments[0] if moments else None
    leader_faults = [
        f
        for f in inj.faults
        if f["kind"] in LEADER_FAULTS or (f["kind"] == "kill" and f.get("held_term") is not None)
    ]
    pruned = [t for t in tasks if t["pruned"]]
    return {
        "retention_s": run.o.retention,
        "pruned_tasks": len(pruned),
        "pruned_by_state": dict(sorted(Counter(str(t["state"]) for t in pruned).items())),
        "unaccounted_tasks": [t["id"] for t in pruned if t["state"] not in TERMINAL][:20],
        "prunes_seen": len(moments),
        "first_prune_t": None if first is None else round(first - t0, 3),
        "leader_faults_after_first_prune": sum(
            1 for f in leader_faults if first is not None and f["at"] >= first
        ),
        "tracker": {
            "polls": tracker.polls,
            "failed_polls": tracker.failed_polls,
            "longest_blind_s": round(tracker.longest_blind_s, 3),
        },
    }


def _events_check(run: Run, tracker: Tracker, first_event: int) -> dict[str, Any]:
    """Did the tracker read every event of the run? It should have read those stored now plus those
    the prunes deleted meanwhile (``event_totals`` counts them in the deleting transaction), less
    the deleted ones written before the run (a reused ``--db``)."""
    assert run.reader is not None
    r = run.reader
    stored_new = int(r.rows("SELECT COUNT(*) AS n FROM events WHERE id > ?", (first_event,))[0]["n"])
    stored_old = int(r.rows("SELECT COUNT(*) AS n FROM events WHERE id <= ?", (first_event,))[0]["n"])
    pruned_now = int(r.rows("SELECT COALESCE(SUM(pruned), 0) AS n FROM event_totals")[0]["n"])
    pruned_during = pruned_now - run.pruned_before
    expected = stored_new + pruned_during - (run.events_before - stored_old)
    return {
        "tracked": len(tracker.event_ids),
        "expected": expected,
        "complete": len(tracker.event_ids) == expected,
        "stored_at_end": stored_new,
        "pruned_during_run": pruned_during,
    }


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


def _stop_threads(run: Run) -> None:
    """The operator and the tracker, if a failure left them running (each ends on its own flag)."""
    if run.operator is not None and run.operator.is_alive():
        run.operator.halt.set()
        run.operator.join(timeout=90)
    if run.tracker is not None and run.tracker.is_alive():
        run.tracker.finish()


def _teardown(run: Run, ok: bool) -> None:
    for step in (
        lambda: _stop_threads(run),
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
    k, rt, op = r["kills_in_flight"], r["retention"], r["operator"]
    return [
        f"store {r['store']}  seed {r['seed']}  workers {r['workers']['slots']}  "
        f"elapsed {r['timing']['elapsed_s']}s (injection {r['timing']['injection_window_s']}s, "
        f"settle {r['timing']['settle_s']}s)",
        f"tasks: submitted {t['submitted']}, by final state {t['by_state']} ({t['pruned']} of them pruned)",
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
        f"kills: {k['kills']}, with an undo in flight {k['with_undo_in_flight']} "
        f"(aimed {k['aimed_at_undo']}; {k['undo_tasks']} task(s), ended {k['undo_tasks_final_states']}), "
        f"with a forward step in flight {k['with_forward_step_in_flight']}, holding compensating "
        f"tasks {k['holding_compensating_tasks']}, unknown {k['unknown']}",
        f"retention {rt['retention_s'] if rt['retention_s'] is not None else 'default'}: pruned "
        f"{rt['pruned_tasks']} task(s) {rt['pruned_by_state']} in {rt['prunes_seen']} prune(s) seen, "
        f"leader faults after the first {rt['leader_faults_after_first_prune']}; unaccounted "
        f"{t['unaccounted']}; events read {r['events']['tracked']}/{r['events']['expected']}",
        f"operator: {op['actions']} action(s), cancel {op['cancel']}, retry {op['retry']}; cancelled "
        f"tasks ended {op['cancelled_final_states']}, retried ended {op['retried_final_states']}",
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
    p.add_argument(
        "--retention",
        type=float,
        help="seconds the workers keep finished tasks before the leader prunes them (default: the "
        "workers' own, 7 days); a few seconds prunes the run's tasks while it runs",
    )
    p.add_argument(
        "--operator-every",
        type=float,
        default=0.0,
        help="mean seconds between operator actions, `task cancel` and `task retry` (default 0: none)",
    )
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
    # The tracker reads every finished task within about a second, blind at most while the store
    # restarts: a retention shorter than a few seconds would let the prune outrun it.
    if a.retention is not None and not MIN_RETENTION <= a.retention <= 36500 * 86400:
        p.error(f"--retention must be within [{MIN_RETENTION:g}, 3153600000] seconds")
    if a.operator_every and not 0.5 <= a.operator_every <= 3600:
        p.error("--operator-every must be 0 (none) or within [0.5, 3600] seconds")
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
        retention=a.retention,
        operator_every=a.operator_every,
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
