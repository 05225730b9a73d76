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
