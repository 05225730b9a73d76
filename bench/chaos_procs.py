"""The chaos harness's processes: the demo services (counting the faults they inject), the TCP
proxy between the workers and PostgreSQL, the worker processes in their slots, and the thread that
submits the orders. Every process started here is ended by its pid."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos_common import ALL_ROLES, WORKFLOW, Options, now

HERE = Path(__file__).resolve().parent


def load_tcpproxy() -> Any:
    """``tcpproxy.py`` (next to this file) as a module, for callers that want the proxy in-process."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import tcpproxy

    return tcpproxy


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
                str(HERE / "chaos.py"),  # its `_services` command
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
