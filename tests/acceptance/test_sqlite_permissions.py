"""SQLite stores and file permissions, through the real CLI (DEP1, SPEC section 3: exit 1, one line).

A WAL store is used through its ``-shm`` and ``-wal`` files. A user who cannot write the store
but can write its folder, opening it while no process has it open, made SQLite create both files
owned by that user, even to read; the store's owner could then no longer write to it. Such an
open is refused now and creates nothing; while a process has the store open (its ``-shm`` exists)
another user still reads it. A store that cannot be read or written as this user is named with
the cause (never "not a stepwarden store"), and so is a write lock held past the busy timeout.

The users: these tests run as root (as CI does) and run the CLI as two other uids with
``setpriv``. The store's owner is not root: root may write any file, so a store of root's would
hide the lock-out these tests are about.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from stepwarden import StoreError
from stepwarden.store import SQLiteStore

from .helpers import (
    SW,
    WORKFLOW,
    Procs,
    Result,
    assert_one_error_line,
    clean_env,
    make_db,
    order,
    sw,
    wait_until,
)

OWNER = 65533  # owns the stores: an ordinary user, not root
READER = 65534  # nobody: may read the stores' files, not write them
READS = (("tasks",), ("leases",), ("alerts",), ("task", "show", "1"))


def side_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name + "-"))


def run_as(uid: int, db: Path, *args: str, cwd: Path) -> Result:
    """The console script with ``--db`` the store at ``db``, run as ``uid`` (its group the same id)."""
    setpriv = shutil.which("setpriv")
    assert setpriv is not None
    cmd = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", str(SW)]
    cmd += ["--db", f"sqlite:///{db}", *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, env=clean_env(HOME=str(cwd)), input=b"", capture_output=True, timeout=60)
    return Result(
        args=[f"(as uid {uid})", "--db", str(db), *args],
        returncode=p.returncode,
        stdout=p.stdout.decode("utf-8", "replace"),
        stderr=p.stderr.decode("utf-8", "replace"),
        elapsed=time.monotonic() - t0,
    )


@dataclass
class Users:
    """A folder every user can write (mode 1777, as /tmp) and the store ``OWNER`` made in it."""

    shared: Path
    store: Path

    def submit_as_owner(self) -> int:
        r = run_as(OWNER, self.store, "submit", WORKFLOW, "--input", json.dumps(order()), cwd=self.shared)
        assert r.returncode == 0, f"the store's owner can no longer submit\n{r}"
        return int(r.stdout.strip())


def owned_store(folder: Path, name: str, mode: int = 0o644) -> Path:
    """A store knowing the demo's workflow, handed to ``OWNER``, with no -wal or -shm file left."""
    db = make_db(folder, name)
    assert side_files(db.path) == [], "the store must start with no process having it open"
    os.chown(db.path, OWNER, OWNER)
    db.path.chmod(mode)
    return db.path


@pytest.fixture
def users(tmp_path: Path) -> Users:
    # Not a skip: CI runs as root and forbids skips; a run that cannot test this must say so.
    if os.geteuid() != 0:
        pytest.fail(f"these tests switch users with setpriv and must run as root, not uid {os.geteuid()}")
    if shutil.which("setpriv") is None:
        pytest.fail("these tests need setpriv (util-linux) to run the CLI as other users")
    for folder in [tmp_path, *tmp_path.parents]:  # pytest makes its folders 0700: let others through
        mode = folder.stat().st_mode
        if not mode & stat.S_IXOTH:
            folder.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
    # An interpreter installed under a folder other users cannot enter (pyenv's under /root, 0700)
    # fails every command below with the loader's error: say so once, plainly.
    probe = subprocess.run(
        [
            "setpriv",
            f"--reuid={READER}",
            f"--regid={READER}",
            "--clear-groups",
            sys.executable,
            "-c",
            "import stepwarden",
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    if probe.returncode != 0:
        pytest.fail(
            f"uid {READER} cannot run {sys.executable} (installed under a folder other users cannot"
            f" enter, such as /root with mode 0700?): {probe.stderr.strip()[-300:]}"
        )
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    return Users(shared, owned_store(shared, "store.db"))


# -- case 1: a reader who cannot write the store, in a folder it can write -----------------------


def test_a_reader_who_cannot_write_the_store_is_refused_creates_nothing_and_the_owner_still_writes(
    users: Users,
) -> None:
    for args in READS:
        r = run_as(READER, users.store, *args, cwd=users.shared)
        line = assert_one_error_line(r, code=1)
        assert f"cannot open the SQLite store {str(users.store)!r} as this user" in line, line
        assert "not writable by you" in line and "no process has it open" in line, line
        assert f"lock its owner (uid {OWNER}" in line, line
        assert "run as the store's owner, or while a worker has it open" in line, line
        assert side_files(users.store) == [], f"the refused read created files\n{r}"
    users.submit_as_owner()


def test_while_a_process_has_the_store_open_another_user_reads_it_but_cannot_write(
    users: Users, procs: Procs
) -> None:
    """Its -shm file exists: SQLite reads through it without writing it. A write is refused by
    SQLite, and the line says which file is not writable and whose store it is."""
    holder = procs.start(
        [
            *("setpriv", f"--reuid={OWNER}", f"--regid={OWNER}", "--clear-groups", sys.executable, "-c"),
            "import sqlite3, sys, time\n"
            "c = sqlite3.connect(sys.argv[1])\n"
            "c.execute('SELECT COUNT(*) FROM tasks').fetchall()\n"
            "time.sleep(300)\n",
            str(users.store),
        ],
        "holder",
    )
    wait_until(lambda: "store.db-shm" in side_files(users.store) or holder.poll() is not None, 20, "the -shm")
    assert holder.poll() is None, procs.log_of(holder)
    shm_owner = (users.shared / "store.db-shm").stat().st_uid
    assert shm_owner == OWNER
    for args in READS[:3]:
        r = run_as(READER, users.store, *args, cwd=users.shared)
        assert r.returncode == 0, str(r)
    r = run_as(READER, users.store, "submit", WORKFLOW, "--input", json.dumps(order()), cwd=users.shared)
    line = assert_one_error_line(r, code=1)
    assert f"cannot write to the SQLite store {str(users.store)!r}" in line, line
    assert "attempt to write a readonly database" in line, line
    assert "the file is not writable by this user" in line, line
    assert f"run as the store's owner (uid {OWNER}" in line, line
    assert "OperationalError" not in line, line
    assert (users.shared / "store.db-shm").stat().st_uid == OWNER
    assert users.submit_as_owner() == 1, "the refused submission wrote a task"


# -- case 2: a folder the reader cannot write, no -shm ---------------------------------------------


@pytest.mark.parametrize("writable_file", [True, False], ids=["file-writable", "file-read-only"])
def test_a_store_in_a_folder_the_reader_cannot_write_is_named_as_a_store_with_the_cause(
    users: Users, writable_file: bool
) -> None:
    private = users.shared / "private"
    private.mkdir(mode=0o755)
    os.chown(private, OWNER, OWNER)
    store = owned_store(private, "r.db", 0o666 if writable_file else 0o644)
    r = run_as(READER, store, "tasks", cwd=users.shared)
    line = assert_one_error_line(r, code=1)
    assert "not a stepwarden store" not in line, line
    assert str(store) in line, line
    if writable_file:
        assert f"cannot read the SQLite store {str(store)!r}: attempt to write a readonly database" in line
        assert f"its folder {str(private)!r} is not writable by this user" in line, line
        assert "SQLite must create its -wal and -shm files" in line, line
    else:
        assert f"cannot open the SQLite store {str(store)!r} as this user" in line, line
        assert "neither the file nor its folder is writable by you" in line, line
    assert side_files(store) == []


# -- case 3: write failures in operator commands --------------------------------------------------


# The console script's own code with one change: the busy timeout is 1 s instead of 30 s, so that a
# lock held throughout fails in about a second. Nothing else on the CLI or in the URL sets it.
def test_a_write_lock_held_past_the_busy_timeout_is_one_line_naming_the_store(tmp_path: Path) -> None:
    db = make_db(tmp_path)
    task = db.submit()
    other = sqlite3.connect(db.path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        for args in (("task", "retry", str(task)), ("submit", WORKFLOW, "--input", json.dumps(order()))):
            r = sw("--db", f"{db.url}?busy_timeout=1", *args, cwd=tmp_path, timeout=30)
            line = assert_one_error_line(r, code=1)
            assert f"the SQLite store {str(db.path)!r} stayed locked by another writer for" in line, line
            assert "(busy timeout 1 s)" in line and "nothing was written" in line, line
            assert r.elapsed < 5, str(r)
    finally:
        other.close()
    assert [t["id"] for t in db.json("tasks", "--json")] == [task]


def test_only_the_lock_and_read_only_causes_become_store_errors(tmp_path: Path) -> None:
    """The library's side of case 3: the StoreError is chained from sqlite3's error, and any other
    OperationalError goes on as it came (callers that handle sqlite3's errors still see them)."""
    path = tmp_path / "lib.db"
    store = SQLiteStore(str(path), busy_timeout=0.2)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        with pytest.raises(sqlite3.OperationalError, match="no such table"):
            store.transact_sync(lambda tx: tx.sql("SELECT * FROM no_such_table"))
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreError, match="stayed locked by another writer") as raised:
            store.transact_sync(lambda tx: tx.sql("DELETE FROM tasks"))
        assert isinstance(raised.value.__cause__, sqlite3.OperationalError)
        other.execute("ROLLBACK")
        assert store.transact_sync(lambda tx: tx.sql("SELECT COUNT(*) AS n FROM tasks")) == [{"n": 0}]
    finally:
        other.close()
        store.close()
