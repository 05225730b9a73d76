"""Text from services reaches an operator's terminal as text: an error message carrying escape
sequences (clear the screen, retitle the window, draw a fake line) is shown with its control
characters escaped by every human-readable command, never sent to the terminal raw."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from stepwarden.store import open_store
from stepwarden.store import transitions as t

from .helpers import make_db, submit_in_process

HOSTILE = "card \x1b[2J\x1b[31mdeclined\x1b]0;pwned\x07 \x9b1A\rfake line"


def test_a_hostile_error_message_is_escaped_in_every_view(tmp_path: Path) -> None:
    db = make_db(tmp_path)
    task_id = submit_in_process(db.url)
    store = open_store(db.url)
    try:
        store.transact_sync(t.claim_and_dispatch, "sched-1:1:aaa", 10)
        agent = store.transact_sync(lambda tx: tx.sql("SELECT agent FROM steps WHERE idx = 0", ()))[0][
            "agent"
        ]
        (req,) = asyncio.run(store.claim_requests("agent-1:1:bbb", [agent], 10))
        asyncio.run(store.send_reply("agent-1:1:bbb", req.id, "error", None, HOSTILE))
        store.transact_sync(t.apply_replies, "sched-1:1:aaa", 10, random.Random(0))
    finally:
        store.close()
    assert db.json("task", "show", str(task_id), "--json")["state"] == "error"
    for args, shows_it in (
        (("task", "show", str(task_id)), True),
        (("alerts",), True),
        (("watch", str(task_id), "--timeout", "1"), True),
        (("tasks",), False),
    ):
        out = db.ok(*args).stdout
        for raw in ("\x1b", "\x07", "\x9b", "\r"):
            assert raw not in out, f"{args}: a raw {raw!r} reached the terminal"
        assert ("\\x1b[2J" in out) == shows_it, f"{args}: the hostile text is not shown escaped:\n{out}"


def test_init_shows_a_hostile_store_path_escaped(tmp_path: Path) -> None:
    """Found by review: `init` printed the store's URL, which is the user's (or the
    environment's), as it came: a path with an escape sequence cleared the screen or retitled
    the window."""
    from .helpers import sw

    folder = tmp_path / "a\x1b]0;pwned\x07b"
    folder.mkdir()
    r = sw("--db", f"sqlite:///{folder}/store.db", "init", cwd=tmp_path)
    assert r.returncode == 0, r
    for raw in ("\x1b", "\x07"):
        assert raw not in r.stdout, r.stdout
    assert "store ready: " in r.stdout and "\\x1b]0;pwned\\x07b" in r.stdout, r.stdout


def test_a_damaged_sqlite_store_is_named_as_such_by_init_and_the_read_commands(tmp_path: Path) -> None:
    """Found by review: a store whose tasks table's first page was overwritten made `init` say
    "store ready" (it reads only the schema), and `tasks` fail with a bare "DatabaseError:
    database disk image is malformed" that named no store."""
    import sqlite3

    from .helpers import assert_one_error_line

    db = make_db(tmp_path)
    submit_in_process(db.url)
    conn = sqlite3.connect(db.path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'tasks'").fetchone()
    (size,) = conn.execute("PRAGMA page_size").fetchone()
    conn.close()
    with open(db.path, "r+b") as f:
        f.seek((root - 1) * size)
        f.write(b"\xff" * size)
    for args in (("init",), ("tasks",)):
        line = assert_one_error_line(db.sw(*args), code=1)
        assert "is damaged" in line and "store.db" in line and "integrity_check" in line, (args, line)


def test_init_finds_an_index_that_no_longer_matches_its_table(tmp_path: Path) -> None:
    """Found by review: a backup moved over a live store left an index wrong (the old -wal applied
    to the new file) and 36 tasks never claimable; `init` ran quick_check, which does not compare
    indexes with their tables, and said "store ready". On a store of usual size it now runs the
    full integrity_check. The index is made wrong here by rewriting its definition, so that its
    entries no longer match it, which only integrity_check sees."""
    import sqlite3

    from .helpers import assert_one_error_line

    db = make_db(tmp_path)
    submit_in_process(db.url)
    conn = sqlite3.connect(db.path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'tasks_claimable'").fetchone()
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute(
        "UPDATE sqlite_master SET sql = ? WHERE name = 'tasks_claimable'",
        (sql.replace("(priority DESC, id)", "(id, priority DESC)"),),
    )
    conn.commit()
    assert conn.execute("PRAGMA quick_check").fetchone() == ("ok",)  # what init ran before
    conn.close()
    line = assert_one_error_line(db.sw("init"), code=1)
    assert "is damaged (integrity_check: " in line and "tasks_claimable" in line, line
