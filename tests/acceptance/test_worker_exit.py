"""A stopped worker's process ends, whatever its operations left running (DEP4, docs/cli.md: "it
exits 0 in every case"). Found by review: a thread an operation started, or an async operation
that swallows its cancellation, kept a worker that had logged ``stopped`` alive, its stop signals
ignored from then on, so only SIGKILL ended it."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
from pathlib import Path

from stepwarden.cli import EXIT_WITHIN

from .helpers import SW, clean_env, sw, wait_until

APP = """
import asyncio, threading, time
from stepwarden import App, Step

app = App()
rw = app.agent("rw")


@rw.operation
def leak(req):
    threading.Thread(target=time.sleep, args=(3600,), daemon=False, name="user-leak").start()


@rw.operation
async def stubborn(req):
    open(req.input["mark"], "w").close()  # it runs: the test may stop the worker now
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            await asyncio.sleep(0.2)
        except BaseException:
            continue


@rw.operation
def flush_at_exit(req):  # as an exporter of spans does: a flush at exit that takes a few seconds
    import atexit, os

    def flush():
        time.sleep(7)
        open(os.environ["FLUSHED"], "w").close()

    atexit.register(flush)


@rw.operation
def noisy(req):  # what Python writes to stderr by itself: a warning, a thread's uncaught exception
    import warnings

    warnings.warn("an old API", DeprecationWarning, stacklevel=1)
    warnings.warn("something odd", UserWarning, stacklevel=1)
    t = threading.Thread(target=lambda: 1 / 0, name="user-thread")
    t.start()
    t.join()


app.workflow("leak", [Step("a", "rw.leak")])
app.workflow("noisy", [Step("a", "rw.noisy")])
app.workflow("flush", [Step("a", "rw.flush_at_exit")])
app.workflow("stubborn", [Step("a", "rw.stubborn", complete_by=300)])
"""


def _start(tmp_path: Path, *first: str, **env: str) -> tuple[subprocess.Popen[bytes], Path, str]:
    (tmp_path / "exit_app.py").write_text(APP)
    url = f"sqlite:///{tmp_path / 'exit.db'}"
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(SW), *first, "--db", url, "worker", "--app", "exit_app:app", "--name", "exiting"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env(**env),
            cwd=tmp_path,
        )
    wait_until(lambda: "leads with term" in log_path.read_text() or proc.poll() is not None, 30, "the worker")
    assert proc.poll() is None, log_path.read_text()
    return proc, log_path, url


def _state(tmp_path: Path) -> str:
    with sqlite3.connect(tmp_path / "exit.db") as conn:
        return str(conn.execute("SELECT state FROM tasks WHERE id = 1").fetchone()[0])


def _submit(tmp_path: Path, url: str, workflow: str, data: str = "{}") -> None:
    r = sw("--db", url, "submit", workflow, "--input", data, "--app", "exit_app:app", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "1", str(r)


def _ended(proc: subprocess.Popen[bytes], log_path: Path, within: float, *, traceback: bool = False) -> str:
    try:
        code = proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"still running {within:g}s after its stop:\n{log_path.read_text()}") from None
    text = log_path.read_text()
    assert code == 0, text
    assert traceback or "Traceback" not in text, text
    return text


def test_a_thread_an_operation_left_running_does_not_keep_the_stopped_worker_alive(tmp_path: Path) -> None:
    proc, log_path, url = _start(tmp_path)
    try:
        _submit(tmp_path, url, "leak")
        wait_until(lambda: _state(tmp_path) == "processed", 30, "the task to be processed")
        proc.send_signal(signal.SIGTERM)
        text = _ended(proc, log_path, EXIT_WITHIN + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopped" in text
    assert "its process has not ended, held by thread(s) user-leak; exiting now" in text, text


def test_an_async_operation_that_swallows_its_cancellation_does_not_keep_the_stopped_worker_alive(
    tmp_path: Path,
) -> None:
    proc, log_path, url = _start(tmp_path)
    try:
        mark = tmp_path / "running"
        _submit(tmp_path, url, "stubborn", json.dumps({"mark": str(mark)}))
        wait_until(mark.exists, 30, "the call to be running")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "stopping gracefully" in log_path.read_text(), 10, "the first signal's line")
        proc.send_signal(signal.SIGINT)  # the second: the call is cancelled now, and ignores it
        text = _ended(proc, log_path, 15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "cancelling 1 running call(s) now" in text, text
    assert "exiting with 1 task(s) still running that ignored their cancellation (request-1)" in text, text


def test_a_flush_at_exit_that_takes_a_few_seconds_still_happens(tmp_path: Path) -> None:
    """Found by review of the exit watch: it ended the process 5 s after the stop, cutting an
    atexit flush (an OpenTelemetry exporter's) that the interpreter was running. An exit held by
    its own shutdown, with no thread of an operation's alive, is given a minute."""
    flushed = tmp_path / "flushed"
    proc, log_path, url = _start(tmp_path, FLUSHED=str(flushed))
    try:
        _submit(tmp_path, url, "flush")
        wait_until(lambda: _state(tmp_path) == "processed", 30, "the task to be processed")
        proc.send_signal(signal.SIGTERM)
        text = _ended(proc, log_path, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert flushed.exists(), text
    assert "has not ended" not in text, text


def test_a_worker_that_fails_with_a_thread_left_running_exits_1_with_its_error_line(tmp_path: Path) -> None:
    """Found by review of the exit watch: it ran only after a stop, and a worker that failed (its
    SQLite file deleted) with a thread an operation left running waited for that thread (18 s
    here, for ever for one that never ends) before its exit 1."""
    proc, log_path, url = _start(tmp_path)
    try:
        _submit(tmp_path, url, "leak")
        wait_until(lambda: _state(tmp_path) == "processed", 30, "the task to be processed")
        for suffix in ("", "-wal", "-shm"):
            Path(f"{tmp_path / 'exit.db'}{suffix}").unlink(missing_ok=True)
        try:
            code = proc.wait(timeout=EXIT_WITHIN + 15)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after its failure:\n{log_path.read_text()}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert code == 1, text
    assert "was deleted" in text and "held by thread(s) user-leak" in text, text


def test_under_json_logs_a_warning_and_a_threads_uncaught_exception_are_json_records(tmp_path: Path) -> None:
    """Found by review: Python's own writes to stderr (``warnings.warn``, a thread's uncaught
    exception, its traceback over several lines) were raw text among the JSON lines."""
    proc, log_path, url = _start(tmp_path, "--log-format", "json", PYTHONWARNINGS="always")
    try:
        _submit(tmp_path, url, "noisy")
        wait_until(lambda: _state(tmp_path) == "processed", 30, "the task to be processed")
        wait_until(lambda: "ZeroDivisionError" in log_path.read_text(), 10, "the thread's exception")
        proc.send_signal(signal.SIGTERM)
        text = _ended(proc, log_path, 30, traceback=True)  # the thread's, in a record's exc field
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    warned = [r["message"] for r in records if r["logger"] == "py.warnings"]
    assert any("UserWarning: something odd" in m for m in warned), warned
    [thread] = [r for r in records if r["logger"] == "stepwarden.threads"]
    assert (
        thread["message"] == "exception in thread user-thread" and thread["exc_type"] == "ZeroDivisionError"
    )
