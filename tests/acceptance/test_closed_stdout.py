"""A reader of standard output that went away (``stepwarden tasks | head -1``, ``| true``): the
command ends quietly with exit 0, nothing on stderr, whatever it printed: its work stays done
(``submit``'s task is written) and the reader had what it wanted. docs/cli.md says why not 1 or
141. It used to exit 1 with nothing said (rich and click turned EPIPE into exit 1), ``submit``
included, although its task was written.

Each command runs with its standard output the write end of a pipe whose read end is closed
before it starts, so its first write fails with EPIPE: no timing is involved."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from .helpers import SW, WORKFLOW, Db, clean_env, order


def to_closed_pipe(db: Db, *args: str) -> subprocess.CompletedProcess[bytes]:
    """``stepwarden --db URL ARGS`` with standard output a pipe nobody reads any more."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [str(SW), "--db", db.url, *args],
            cwd=db.cwd,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=60,
        )
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "args",
    [
        ("tasks",),
        ("tasks", "--json"),
        ("task", "show", "1"),
        ("task", "show", "1", "--json"),
        ("leases",),
        ("init",),
    ],
    ids=" ".join,
)
def test_a_command_whose_reader_is_gone_exits_0_saying_nothing(db: Db, args: tuple[str, ...]) -> None:
    assert db.submit() == 1
    p = to_closed_pipe(db, *args)
    assert (p.returncode, p.stderr.decode()) == (0, "")


def test_submit_whose_reader_is_gone_exits_0_and_its_task_is_written(db: Db) -> None:
    """Exit 1 would tell a script the task was not submitted, and one that submits again on
    failure would submit it twice."""
    p = to_closed_pipe(db, "submit", WORKFLOW, "--input", json.dumps(order("o-9")), "--correlation-id", "o-9")
    assert (p.returncode, p.stderr.decode()) == (0, "")
    assert [t["correlation_id"] for t in db.json("tasks", "--json")] == ["o-9"]


def test_a_failing_command_whose_reader_is_gone_still_says_why(db: Db) -> None:
    """Only the reader's going is quiet: an error is still one line on stderr, with its code."""
    p = to_closed_pipe(db, "task", "show", "99")
    assert p.returncode == 2
    assert p.stderr.decode().startswith("error: ") and p.stderr.decode().count("\n") == 1
