"""The tests' fork server runs the console script as an exec would (``cli_runner``, ``cli_zygote``).

Most CLI tests run ``stepwarden`` forked from a server that has done its imports. These tests hold it
to what a real ``exec`` of the console script gives: the same exit code, stdout and stderr, the
test's environment, working directory and stdin, and a timeout or an interruption that ends the
run; and they check that each run they compare was forked at all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from stepwarden.liveness import proc_start

from . import cli_runner
from .helpers import SW, Db, Result, clean_env, make_db, order, sw

CASES = {
    "version": (("--version",), b""),
    "help": (("--help",), b""),
    "tasks-json": (("tasks", "--json"), b""),
    "tasks-table": (("tasks",), b""),
    "bad-id": (("task", "show", "-1"), b""),
    "unknown-task": (("task", "show", "99"), b""),
    "bad-stdin": (("submit", "process-order", "--input", "-"), b"{not json"),
    "unknown-command": (("no-such-command",), b""),
}


def _exec(*args: str, cwd: Path, env: dict[str, str], stdin: bytes = b"") -> tuple[int, str, str]:
    p = subprocess.run([str(SW), *args], cwd=cwd, env=env, input=stdin, capture_output=True, timeout=60)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def _forked(pg: bool, *args: str, cwd: Path, env: dict[str, str], stdin: bytes = b"") -> Result:
    server = cli_runner.fork_server(pg)
    before = len(server.pids)
    r = sw(*args, cwd=cwd, env=env, stdin=stdin)
    assert len(server.pids) == before + 1, "the run was not forked: this test compares nothing"
    return r


@pytest.fixture(params=["sqlite", "postgres"])
def any_db(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    pg = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    return make_db(tmp_path, pg=pg)


@pytest.mark.parametrize("case", CASES)
def test_a_forked_run_gives_what_an_exec_gives(any_db: Db, case: str) -> None:
    args, stdin = CASES[case]
    any_db.submit()
    env = clean_env(STEPWARDEN_DB=any_db.url)  # and no --db: the run must see the test's environment
    forked = _forked(any_db.pg is not None, *args, cwd=any_db.cwd, env=env, stdin=stdin)
    execd = _exec(*args, cwd=any_db.cwd, env=env, stdin=stdin)
    assert (forked.returncode, forked.stdout, forked.stderr) == execd, str(forked)
    assert forked.stdout or forked.stderr, "a run that printed nothing compares nothing"


def test_a_forked_run_starts_in_the_tests_working_directory(tmp_path: Path) -> None:
    r = _forked(False, "init", cwd=tmp_path, env=clean_env())  # sqlite:///stepwarden.db is relative
    assert r.returncode == 0, str(r)
    assert (tmp_path / "stepwarden.db").exists(), str(r)


def _running(pid: int) -> bool:
    """Whether ``pid`` is still a live process (a zombie, ended but not yet reaped, is not)."""
    return proc_start(pid) is not None


def test_a_run_past_its_timeout_is_ended_and_keeps_its_output(db: Db) -> None:
    task_id = db.submit()  # no worker: `watch` follows it without end
    server = cli_runner.fork_server(False)
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        sw("--db", db.url, "watch", str(task_id), cwd=db.cwd, timeout=3)
    pid = server.pids[-1]
    assert raised.value.output, "the events `watch` printed before its timeout are lost"
    assert not _running(pid), "subprocess.run ends its child before it raises TimeoutExpired"


def test_a_run_whose_test_is_interrupted_is_ended(db: Db) -> None:
    """As ``subprocess.run`` kills its child on any exception (pytest-timeout's, Ctrl-C)."""
    task_id = db.submit()
    server = cli_runner.fork_server(False)
    before = len(server.pids)

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGALRM))
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            sw("--db", db.url, "watch", str(task_id), cwd=db.cwd, timeout=60)
    finally:
        timer.cancel()
        signal.signal(signal.SIGALRM, previous)
    assert len(server.pids) == before + 1
    pid = server.pids[-1]
    assert not _running(pid), "subprocess.run ends its child before the exception goes on"


def test_a_test_with_its_own_interpreter_settings_gets_an_exec(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("import sys\nsys.stderr.write('shadowed\\n')\n")
    server = cli_runner.fork_server(False)
    before = len(server.pids)
    r = sw("--version", cwd=tmp_path, env=clean_env(PYTHONPATH=str(shadow)))
    assert r.returncode == 0 and "shadowed" in r.stderr, str(r)  # only a fresh interpreter reads it
    assert len(server.pids) == before


def test_a_run_exec_would_refuse_is_refused_as_exec_refuses_it(tmp_path: Path) -> None:
    big = "x" * (cli_runner.FORK_MAX_STRING * 2)  # past Linux's 128 KiB for one string
    with pytest.raises(OSError, match="Argument list too long"):
        sw("submit", "process-order", "--input", big, cwd=tmp_path)
    with pytest.raises(OSError, match="Argument list too long"):
        sw("--version", cwd=tmp_path, env=clean_env(BIG=big))
    with pytest.raises(ValueError, match="null byte"):
        sw("--version", "x\0y", cwd=tmp_path)
    with pytest.raises(FileNotFoundError):
        sw("--version", cwd=tmp_path / "missing")


def test_only_a_postgresql_url_sends_a_run_to_the_server_that_preloads_postgresql(tmp_path: Path) -> None:
    folder = tmp_path / "postgres-like-name"  # a path that merely mentions postgres is no URL
    folder.mkdir()
    plain, pg = cli_runner.fork_server(False), cli_runner.fork_server(True)
    counts = len(plain.pids), len(pg.pids)
    r = sw("--db", f"sqlite:///{folder}/s.db", "--version", cwd=folder)
    assert r.returncode == 0, str(r)
    assert (len(plain.pids), len(pg.pids)) == (counts[0] + 1, counts[1])


# The real server with one change: recording the run it has just forked fails once (pidfd_open).
FAILING_SERVER = """
import os, sys
sys.path.insert(0, {folder!r})
import cli_zygote

real, calls = os.pidfd_open, []

def pidfd_open(pid, *args):
    calls.append(pid)
    if len(calls) == 2:  # the first is the server's probe of itself
        raise OSError(38, "injected: no pidfd for this run")
    return real(pid, *args)

os.pidfd_open = pidfd_open
cli_zygote.serve(sys.argv[1], False)
from stepwarden.cli import main
sys.exit(main())
"""


def test_a_run_the_server_cannot_record_never_starts_so_exec_runs_it_once(db: Db, tmp_path: Path) -> None:
    script = tmp_path / "failing_server.py"
    script.write_text(FAILING_SERVER.format(folder=str(Path(cli_runner.__file__).parent)))
    server = cli_runner._Zygote(pg=False, script=script)
    env = clean_env()
    argv = [str(SW), "--db", db.url, "submit", "process-order", "--input", json.dumps(order())]
    try:
        assert server.usable_for(env)
        assert server.run(argv, str(db.cwd), env, b"", 60) is None  # refused: the caller execs
        assert server.failed and len(server.pids) == 0
        # The forked child waited for the server's go, which never came: it wrote nothing.
        assert db.json("tasks", "--json") == []
    finally:
        server.stop()
