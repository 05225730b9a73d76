"""Shared helpers: run the real ``stepwarden`` console script, own a store file, start and end processes.

Every process a test starts is recorded in a :class:`Procs` and ended by its pid (SIGTERM, then
SIGKILL after a deadline) in a finaliser. Nothing here sleeps and hopes: waits poll with deadlines.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import pytest

from .cli_runner import clean_env as clean_env  # re-exported: the tests take it from here
from .cli_runner import run_console_script

SW = Path(sys.executable).parent / "stepwarden"
WORKFLOW = "process-order"
DEMO_APP = "stepwarden.demo.app:app"
FINAL = frozenset({"processed", "error", "compensated", "cancelled"})
TASK_STATES = FINAL | {"pending", "processing", "compensating"}
STEP_STATES = frozenset(
    {"pending", "running", "completed", "failed", "compensating", "compensated", "skipped"}
)
TASK_KEYS = {
    "id",
    "workflow",
    "state",
    "correlation_id",
    "failure_count",
    "created_at",
    "updated_at",
    "steps",
}
STEP_KEYS = {"name", "state", "attempt", "failure_count", "locked_by", "complete_by"}
LEASE_KEYS = {"name", "holder", "term", "expires_at"}
# Tables every store has (a snapshot compares every table the store has, these and any other).
TABLES = (
    "tasks",
    "steps",
    "events",
    "messages",
    "alerts",
    "requests",
    "replies",
    "workflows",
    "leases",
    "workers",
)
MiB = 1024 * 1024

T = TypeVar("T")


def order(order_id: str = "o-1", **over: Any) -> dict[str, Any]:
    """An input of the demo's workflow (SPEC section 4)."""
    return {"order_id": order_id, "sku": "SKU-1", "quantity": 1, "amount_cents": 100, **over}


@dataclass
class Result:
    args: Sequence[str | bytes]
    returncode: int
    stdout: str
    stderr: str
    elapsed: float

    @property
    def stderr_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.strip()]

    @property
    def stdout_lines(self) -> list[str]:
        return [ln for ln in self.stdout.splitlines() if ln.strip()]

    def __str__(self) -> str:
        shown = " ".join(repr(a)[:60] if isinstance(a, bytes) else a[:60] for a in self.args)
        return (
            f"`stepwarden {shown}` exited {self.returncode} after {self.elapsed:.1f}s\n"
            f"--- stdout ---\n{self.stdout[-3000:]}\n--- stderr ---\n{self.stderr[-3000:]}"
        )


def sw(
    *args: str | bytes,
    cwd: Path,
    env: dict[str, str] | None = None,
    stdin: str | bytes | None = None,
    timeout: float = 60,
) -> Result:
    """Run the console script once, as a process of its own (forked from a server that has done its
    imports, where that is the same as an exec: ``cli_runner``); stdin is empty unless given."""
    cmd: list[Any] = [str(SW), *args]
    if any(isinstance(a, bytes) for a in cmd):
        cmd = [os.fsencode(a) for a in cmd]
    data = stdin.encode() if isinstance(stdin, str) else stdin
    t0 = time.monotonic()
    code, out, err = run_console_script(
        cmd, cwd, env if env is not None else clean_env(), data if data is not None else b"", timeout
    )
    return Result(
        args=list(args),
        returncode=code,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        elapsed=time.monotonic() - t0,
    )


def assert_one_error_line(r: Result, code: int = 2) -> str:
    """Exit ``code``, nothing on stdout, exactly one non-empty ``error:`` line on stderr, no traceback."""
    assert r.returncode == code, str(r)
    assert "Traceback" not in r.stderr, str(r)
    assert len(r.stderr_lines) == 1, f"expected one line on stderr\n{r}"
    line = r.stderr_lines[0]
    assert line.startswith("error:") and line[len("error:") :].strip(), str(r)
    assert r.stdout.strip() == "", f"expected nothing on stdout\n{r}"
    return line


def refused_without_store(tmp_path: Path, *args: str, code: int = 2) -> str:
    """Run ``stepwarden --db sqlite:///TMP/never.db ARGS``: it must exit ``code`` with one
    ``error:`` line (returned) and leave no store file behind (bad input writes nothing)."""
    missing = tmp_path / "never.db"
    r = sw("--db", f"sqlite:///{missing}", *args, cwd=tmp_path)
    line = assert_one_error_line(r, code=code)
    assert not missing.exists(), f"a refused command created the store file\n{r}"
    return line


def wait_until(pred: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll ``pred`` until it returns something truthy (returned); fail clearly at the deadline."""
    end = time.monotonic() + timeout
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() >= end:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what} (last value: {last!r})")
        time.sleep(interval)


def register_demo_workflows(url: str) -> None:
    """Make a store know the demo's workflow the way a worker would, without running one."""
    from stepwarden.demo.app import app as demo_app
    from stepwarden.store import open_store
    from stepwarden.store.core import _register

    store = open_store(url)
    try:
        store.transact_sync(_register, list(demo_app.workflows.values()), "acceptance-test")
    finally:
        store.close()


def submit_in_process(url: str, data: Any = None, **kw: Any) -> int:
    """Submit a task through the library (faster than a subprocess) for tests about something else."""
    from stepwarden import App

    app = App(url)
    try:
        return app.submit(WORKFLOW, order() if data is None else data, **kw)
    finally:
        app.close()


@dataclass
class Db:
    """One store -- a SQLite file, or with ``pg`` a PostgreSQL database -- and the commands run against
    it (always with ``--db``, from the folder of ``path``)."""

    path: Path
    cwd: Path
    pg: str | None = None  # a PostgreSQL URL instead of the SQLite file

    @property
    def url(self) -> str:
        return self.pg or f"sqlite:///{self.path}"

    def sw(self, *args: str | bytes, **kw: Any) -> Result:
        return sw("--db", self.url, *args, cwd=self.cwd, **kw)

    def ok(self, *args: str | bytes, **kw: Any) -> Result:
        r = self.sw(*args, **kw)
        assert r.returncode == 0, str(r)
        return r

    def json(self, *args: str) -> Any:
        r = self.ok(*args)
        try:
            return json.loads(r.stdout)
        except json.JSONDecodeError:
            pytest.fail(f"not JSON on stdout\n{r}")

    def submit(self, data: Any = None, *opts: str, **kw: Any) -> int:
        payload = json.dumps(order() if data is None else data)
        r = self.ok("submit", WORKFLOW, "--input", payload, *opts, **kw)
        out = r.stdout.strip()
        assert out.isdigit() and int(out) > 0, f"submit must print a task id\n{r}"
        return int(out)

    def task(self, task_id: int) -> dict[str, Any]:
        shown = self.json("task", "show", str(task_id), "--json")
        assert isinstance(shown, dict), shown
        return shown

    def wait_state(
        self, task_id: int, states: set[str] | frozenset[str], timeout: float = 45
    ) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            t = self.task(task_id)
            return t if t["state"] in states else None

        return wait_until(reached, timeout, f"task {task_id} to reach one of {sorted(states)}", 0.2)

    def snapshot(self, *, require_schema: bool = True) -> dict[str, Any]:
        """Everything a write could change, read straight from the database (not through stepwarden):
        the names of the tables, the row count of each, and every row of every table, sorted so that
        the comparison does not depend on the order a backend returns rows in. On PostgreSQL also the
        identity sequences' positions: a refused command must not even start an INSERT."""
        sequences: dict[str, Any] = {}
        if self.pg:
            import psycopg

            with psycopg.connect(self.pg, autocommit=True) as pc:
                tables = sorted(
                    r[0]
                    for r in pc.execute("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
                )
                rows = {t: pc.execute(f'SELECT * FROM "{t}"').fetchall() for t in tables}
                seqs = "SELECT sequencename, last_value FROM pg_sequences WHERE schemaname = current_schema()"
                sequences = {name: value for name, value in pc.execute(seqs)}
        else:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
            try:
                tables = sorted(
                    r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                )
                rows = {t: conn.execute(f'SELECT * FROM "{t}"').fetchall() for t in tables}
            finally:
                conn.close()
        if require_schema:
            assert set(TABLES) <= set(tables), f"tables missing from the store: {set(TABLES) - set(tables)}"
        return {
            "tables": tables,
            "counts": {t: len(r) for t, r in rows.items()},
            "rows": {t: sorted(r, key=repr) for t, r in rows.items()},
            "sequences": sequences,
        }


def make_db(folder: Path, name: str = "store.db", *, demo: bool = True, pg: str | None = None) -> Db:
    """A fresh store file in ``folder`` (the commands' working directory too), knowing the demo workflow;
    or, with ``pg``, that fresh PostgreSQL database."""
    db = Db(folder / name, folder, pg)
    if demo:
        register_demo_workflows(db.url)
    else:
        db.ok("init")
    return db


class Procs:
    """Processes a test started; each is ended by its own pid, never by name."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[tuple[subprocess.Popen[bytes], Path, IO[bytes]]] = []

    def start(
        self, cmd: Sequence[str], name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log_path = self.folder / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed in stop_all()
        p = subprocess.Popen(
            list(cmd),
            cwd=self.folder,
            env=env or clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
        self.procs.append((p, log_path, log))
        return p

    def log_of(self, p: subprocess.Popen[bytes]) -> str:
        for q, path, log in self.procs:
            if q is p:
                log.flush()
                return path.read_text(errors="replace")[-4000:]
        return ""

    def services(self, *extra: str, name: str = "services") -> str:
        """Start the demo's fake services on a free port; returns their base URL."""
        p = self.start([sys.executable, "-m", "stepwarden.demo.services", "--port", "0", *extra], name)

        def listening() -> str | None:
            if p.poll() is not None:
                pytest.fail(f"the demo services exited {p.returncode}:\n{self.log_of(p)}")
            for line in self.log_of(p).splitlines():
                if line.startswith("listening on "):
                    return line.removeprefix("listening on ").strip()
            return None

        return wait_until(listening, 20, "the demo services to say `listening on URL`", 0.05)

    def worker(self, db: Db, services_url: str, name: str) -> subprocess.Popen[bytes]:
        """A worker running every role of the demo's app against ``db``."""
        cmd = [str(SW), "--db", db.url, "worker", "--app", DEMO_APP, "--name", name]
        return self.start(cmd, name, clean_env(STEPWARDEN_DEMO_SERVICES=services_url))

    def stop_all(self) -> None:
        live = [p for p, _, _ in reversed(self.procs) if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 10
        for p in live:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for _, _, log in self.procs:
            log.close()
        self.procs.clear()
