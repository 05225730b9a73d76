"""The integration tests' harness: real worker processes on one store, and what a test reads back.

A ``Cluster`` is one store, one execution log (``tests/apps/itapp.py``) and the worker processes of
one test: ``python -m stepwarden worker --app itapp:app`` (or another app of ``tests/apps``)
subprocesses whose output goes to files in the test's directory. ``conftest.py`` makes one per
test (the ``cluster`` fixture) and ends its processes when the test ends.

A module of its own, not the conftest, so that tests import it: every ``tests/`` folder has a
``conftest`` module, and ``import conftest`` at run time would find whichever pytest loaded last.
pytest puts this folder on ``sys.path`` (it has no ``__init__.py``), so ``import harness`` works
from its tests and its conftest alike, one module for both.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import pytest

from stepwarden import App
from stepwarden.store import Store, open_store, views
from stepwarden.store.base import FINAL_TASK_STATES

APPS = Path(__file__).resolve().parents[1] / "apps"
if str(APPS) not in sys.path:
    sys.path.insert(0, str(APPS))
itapp = importlib.import_module("itapp")

T = TypeVar("T")
STOP_DEADLINE = 10.0


def wait_until(pred: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``pred`` until it returns something truthy (returned); fail clearly at the deadline."""
    end = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = pred()
        if last:
            return last
        if time.monotonic() >= end:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what} (last value: {last!r})")
        time.sleep(interval)


def dict_row(cur: sqlite3.Cursor, row: tuple[Any, ...]) -> dict[str, Any]:
    return {d[0]: v for d, v in zip(cur.description, row, strict=True)}


def pid_of(identity: str) -> int:
    """A worker identity is NAME:PID:RANDOM."""
    return int(identity.split(":")[1])


class WorkerProc:
    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_path: Path, log: IO[bytes]) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self._log = log
        self.identity = ""
        self.expect_alive = True  # cleared when a test kills or stops it on purpose

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            self.expect_alive = False
        if self.alive():
            self.popen.send_signal(sig)

    def stop(self, sig: int, within: float) -> tuple[int | None, float]:
        """Send ``sig`` and wait for the exit: its code (None if still running after ``within``
        seconds: then killed, by pid, so the cluster's end-of-test deadline is not what ends it)
        and how long it took from the signal."""
        self.expect_alive = False
        sent = time.monotonic()
        self.signal(sig)
        try:
            code: int | None = self.popen.wait(timeout=within)
        except subprocess.TimeoutExpired:
            code = None
            self.signal(signal.SIGKILL)
        return code, time.monotonic() - sent

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP), from its state in /proc."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"
        except OSError:
            return False

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def end(self, deadline: float) -> None:
        """SIGCONT (a stopped process ignores SIGTERM until continued), SIGTERM, SIGKILL at the deadline."""
        if self.alive():
            self.popen.send_signal(signal.SIGCONT)
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
        self._log.close()


class Cluster:
    """One store, one execution log, and the worker processes of one test."""

    def __init__(self, tmp: Path, url: str) -> None:
        self.tmp = tmp
        self.url = url
        self.sqlite = url.startswith("sqlite:///")
        self.db_path = Path(url[len("sqlite:///") :]) if self.sqlite else tmp / "unused.db"
        self.log_path = tmp / "executions.db"
        self.workers: list[WorkerProc] = []
        self.env = dict(os.environ)
        self.env.update(
            {
                "PYTHONPATH": os.pathsep.join(filter(None, [str(APPS), os.environ.get("PYTHONPATH")])),
                itapp.LOG_ENV: str(self.log_path),
                "STEPWARDEN_DB": self.url,
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.store: Store = open_store(self.url)  # creates the schema before any worker starts
        itapp.connect_log(str(self.log_path)).close()
        self._app: App | None = None
        self._read: sqlite3.Connection | None = None

    pid_of = staticmethod(pid_of)

    # -- processes -----------------------------------------------------------------------------
    def start(
        self,
        name: str,
        roles: str = "scheduler,agent,supervisor",
        *,
        app: str = "itapp:app",
        concurrency: int | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        db: str | None = None,
    ) -> WorkerProc:
        """A worker process running ``app`` (a module of ``tests/apps``), with ``args`` added to its
        command and ``env`` to the cluster's environment; ended by pid when the test ends, its log
        in a failure's report. ``wait``: returned once it has registered in the store. ``db``: the
        URL the worker is given, when it reaches the cluster's store another way (a proxy)."""
        cmd = [sys.executable, "-m", "stepwarden", "--db", db or self.url, "worker", "--app", app]
        cmd += ["--roles", roles, "--name", name]
        if concurrency is not None:
            cmd += ["--concurrency", str(concurrency)]
        cmd += args
        log_path = self.tmp / f"worker-{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed by WorkerProc.end
        popen = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(self.env, **(env or {})), cwd=self.tmp
        )
        w = WorkerProc(name, popen, log_path, log)
        self.workers.append(w)
        if wait:
            self.identity(w)
        return w

    def identity(self, w: WorkerProc, timeout: float = 20.0) -> str:
        """The worker's NAME:PID:RANDOM, once it has registered itself in the store."""
        if not w.identity:

            def registered() -> str | None:
                if not w.alive():
                    pytest.fail(f"worker {w.name} exited with {w.popen.returncode}:\n{w.log_text()}")
                rows = self.sql("SELECT id FROM workers WHERE id LIKE ?", f"{w.name}:{w.pid}:%")
                return rows[0]["id"] if rows else None

            w.identity = wait_until(registered, timeout, f"worker {w.name} to register")
        return w.identity

    def check_alive(self) -> None:
        for w in self.workers:
            if w.expect_alive and not w.alive():
                pytest.fail(f"worker {w.name} died unexpectedly (exit {w.popen.returncode}):\n{w.log_text()}")

    def wait(self, pred: Callable[[], T | None], timeout: float, what: str) -> T:
        """``wait_until`` that also fails at once if a worker that should be running has died."""

        def check() -> T | None:
            self.check_alive()
            return pred()

        return wait_until(check, timeout, what)

    def write_lock_free(self, timeout: float = 1.0) -> bool:
        """Can a writer take the store's lock within ``timeout``? (Workers hold it for milliseconds.)

        PostgreSQL has no store-wide write lock; a process paused inside a transaction there is
        ended by the server's idle_in_transaction_session_timeout, which the store sets."""
        if not self.sqlite:
            return True
        conn = sqlite3.connect(self.db_path, timeout=timeout, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            conn.close()

    def pause(self, w: WorkerProc, tries: int = 5) -> None:
        """SIGSTOP ``w`` at a moment it holds no write lock on the store.

        A stopped process inside a write transaction would block every other process on SQLite's
        single writer lock until it is continued: a limit of the embedded store, not the case
        under test (a leader paused between its writes). So stop it, check that a writer can get
        the lock, and if not continue it and try again.
        """
        for _ in range(tries):
            w.signal(signal.SIGSTOP)
            wait_until(w.stopped, 5, f"worker {w.name} to stop")
            if self.write_lock_free():
                return
            w.signal(signal.SIGCONT)
            time.sleep(0.1)  # let it finish its transaction before stopping it again
        pytest.fail(f"could not pause worker {w.name} outside a write transaction in {tries} tries")

    def close(self) -> None:
        deadline = time.monotonic() + STOP_DEADLINE
        for w in self.workers:
            if w.alive():
                w.popen.send_signal(signal.SIGCONT)
                w.popen.send_signal(signal.SIGTERM)
        for w in self.workers:
            w.end(deadline)
        if self._app is not None:
            self._app.close()
        if self._read is not None:
            self._read.close()
        self.store.close()

    # -- the store -----------------------------------------------------------------------------
    def sql(self, query: str, *params: Any) -> list[dict[str, Any]]:
        """Read with a plain autocommit connection: WAL readers never wait for the workers."""
        if not self.sqlite:
            return self.store.transact_sync(lambda tx: tx.sql(query, tuple(params)))
        if self._read is None:
            self._read = sqlite3.connect(self.db_path, timeout=30, isolation_level=None)
            self._read.row_factory = dict_row
        return self._read.execute(query, params).fetchall()

    def one(self, query: str, *params: Any) -> dict[str, Any]:
        rows = self.sql(query, *params)
        assert len(rows) == 1, f"expected one row from {query!r} {params}, got {rows}"
        return rows[0]

    @property
    def app(self) -> App:
        if self._app is None:
            self._app = itapp.make_app(self.url)
        return self._app

    def submit(self, workflow: str, input: Any = None, **kw: Any) -> int:
        return self.app.submit(workflow, input if input is not None else {}, **kw)

    def show(self, task_id: int) -> dict[str, Any]:
        return self.store.transact_sync(views.show_task, task_id)

    def task_state(self, task_id: int) -> str:
        return str(self.one("SELECT state FROM tasks WHERE id = ?", task_id)["state"])

    def final_state(self, task_id: int) -> str | None:
        """The task's state once it is final (to wait on), else None."""
        state = self.task_state(task_id)
        return state if state in FINAL_TASK_STATES else None

    def events(self, task_id: int | None = None, kind: str | None = None) -> list[dict[str, Any]]:
        where: list[str] = []
        params: list[Any] = []
        if task_id is not None:
            where.append("task_id = ?")
            params.append(task_id)
        if kind is not None:
            where.append("kind = ?")
            params.append(kind)
        sql = "SELECT * FROM events" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id"
        rows = self.sql(sql, *params)
        for r in rows:
            r["detail"] = json.loads(r["detail"]) if r["detail"] else {}
        return rows

    def send_reply(self, me: str, request_id: int, outcome: str, result: Any, error: str | None) -> None:
        asyncio.run(self.store.send_reply(me, request_id, outcome, result, error))

    def cli(self, *args: str) -> Any:
        """Run the real CLI against this store; returns its parsed JSON output."""
        p = subprocess.run(
            [sys.executable, "-m", "stepwarden", "--db", self.url, *args],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.tmp,
            timeout=60,
        )
        assert p.returncode == 0, f"stepwarden {' '.join(args)} exited {p.returncode}: {p.stderr}"
        return json.loads(p.stdout)

    # -- the execution log ---------------------------------------------------------------------
    def executions(self, where: str = "1", *params: Any) -> list[dict[str, Any]]:
        conn = sqlite3.connect(self.log_path, timeout=30, isolation_level=None)
        try:
            conn.row_factory = dict_row
            rows = conn.execute(f"SELECT * FROM executions WHERE {where} ORDER BY id", params).fetchall()
        finally:
            conn.close()
        for r in rows:
            r["detail"] = json.loads(r["detail"]) if r["detail"] else None
        return rows

    # -- reporting -------------------------------------------------------------------------------
    def report(self) -> str:
        out = []
        for w in self.workers:
            status = "running" if w.alive() else f"exited {w.popen.returncode}"
            lines = w.log_text().splitlines()
            out.append(f"===== worker {w.name} pid {w.pid} ({status}) {w.identity} — last 80 lines =====")
            out.extend(lines[-80:])
        try:
            out.append("===== tasks =====")
            for t in self.sql("SELECT id, workflow, state, failure_count, locked_by FROM tasks ORDER BY id")[
                -30:
            ]:
                out.append(str(t))
            out.append("===== leases / terms =====")
            out.extend(str(r) for r in self.sql("SELECT * FROM leases"))
            out.extend(str(r) for r in self.sql("SELECT * FROM lease_terms ORDER BY term"))
            out.append("===== last events =====")
            out.extend(
                str(r)
                for r in self.sql(
                    "SELECT id, task_id, step_idx, attempt, kind, actor, detail, at FROM events "
                    "ORDER BY id DESC LIMIT 40"
                )[::-1]
            )
        except Exception as e:  # pragma: no cover - only while reporting another failure
            out.append(f"(store unreadable: {e})")
        return "\n".join(out)


def load_tcpproxy() -> Any:
    """``bench/tcpproxy.py``, a loopback proxy that can cut a worker off from its server."""
    path = Path(__file__).resolve().parents[2] / "bench" / "tcpproxy.py"
    spec = importlib.util.spec_from_file_location("tcpproxy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
