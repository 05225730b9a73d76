"""The tests' fork server runs the console script as an exec would (``cli_runner``, ``cli_zygote``).

Most CLI tests run ``stepwarden`` forked from a server that has done its imports. These tests hold it
to what a real ``exec`` of the console script gives: the same exit code, stdout and stderr, the
test's environment, working directory and stdin, and a timeout that ends the run.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from . import cli_runner
from .helpers import SW, Db, clean_env, sw, wait_until


def _exec(*args: str, cwd: Path, env: dict[str, str], stdin: bytes = b"") -> tuple[int, str, str]:
    p = subprocess.run([str(SW), *args], cwd=cwd, env=env, input=stdin, capture_output=True, timeout=60)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


@pytest.mark.parametrize(
    ("args", "stdin"),
    [
        (("--version",), b""),
        (("--help",), b""),
        (("tasks", "--json"), b""),
        (("tasks",), b""),
        (("task", "show", "-1"), b""),
        (("task", "show", "99"), b""),
        (("submit", "process-order", "--input", "-"), b"{not json"),
        (("no-such-command",), b""),
    ],
    ids=["version", "help", "tasks-json", "tasks-table", "bad-id", "unknown-task", "bad-stdin", "unknown"],
)
def test_a_forked_run_gives_what_an_exec_gives(db: Db, args: tuple[str, ...], stdin: bytes) -> None:
    db.submit()
    env = clean_env(STEPWARDEN_DB=db.url)  # and no --db: the run must see the test's environment
    forked = sw(*args, cwd=db.cwd, env=env, stdin=stdin)
    execd = _exec(*args, cwd=db.cwd, env=env, stdin=stdin)
    assert (forked.returncode, forked.stdout, forked.stderr) == execd, str(forked)
    assert forked.stdout or forked.stderr, "a run that printed nothing compares nothing"


def test_a_forked_run_starts_in_the_tests_working_directory(tmp_path: Path) -> None:
    r = sw("init", cwd=tmp_path)  # the default store, sqlite:///stepwarden.db, is relative
    assert r.returncode == 0, str(r)
    assert (tmp_path / "stepwarden.db").exists(), str(r)


def test_a_run_past_its_timeout_is_ended(db: Db) -> None:
    task_id = db.submit()  # no worker: `watch` waits for it without end
    with pytest.raises(subprocess.TimeoutExpired):
        sw("--db", db.url, "watch", str(task_id), cwd=db.cwd, timeout=2)

    def gone() -> bool:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                text = cmdline.read_bytes()
            except OSError:
                continue
            if db.url.encode() in text and b"watch" in text:
                return False
        return True

    wait_until(gone, 10, "the timed-out `watch` to be ended")


def test_a_test_with_its_own_interpreter_settings_gets_an_exec(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("import sys\nsys.stderr.write('shadowed\\n')\n")
    r = sw("--version", cwd=tmp_path, env=clean_env(PYTHONPATH=str(shadow)))
    assert r.returncode == 0 and "shadowed" in r.stderr, str(r)  # only a fresh interpreter reads it


def test_an_argument_too_big_for_exec_is_refused_as_exec_refuses_it(tmp_path: Path) -> None:
    big = "x" * (cli_runner.FORK_MAX_ARG * 2)  # past Linux's 128 KiB for one argument
    with pytest.raises(OSError, match="Argument list too long"):
        sw("submit", "process-order", "--input", big, cwd=tmp_path)
