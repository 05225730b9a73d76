"""The writes the SQLite store sends as one ``executemany`` per query (deferred and kept writes):
none may return rows. Python 3.12's ``sqlite3`` refuses ``executemany`` of a statement with
``RETURNING`` after its first row ("bad parameter or other API misuse"); 3.11 accepts it, so
the suite on 3.11 never saw that an agent-only worker on 3.12 or later could not send a reply
batch of two (found by a run of the suite on 3.13). Checked here, on any version."""

from __future__ import annotations

import re
from pathlib import Path

import stepwarden
from stepwarden.store.base import DEFERRED
from stepwarden.store.sql import load_queries

SRC = Path(stepwarden.__file__).parent


def batched_queries() -> set[str]:
    """DEFERRED's, and every query a transition keeps for the end (``tx.later("name", ...)``)."""
    kept = set()
    for path in SRC.rglob("*.py"):
        kept |= set(re.findall(r'\.later\(\s*"([a-z_]+)"', path.read_text()))
    return set(DEFERRED) | kept


def test_no_batched_write_returns_rows() -> None:
    queries = load_queries("sqlite", "sw_now()")
    names = batched_queries()
    assert "insert_reply" in names and "insert_applied_reply" in names  # the search finds them
    code = {n: re.sub(r"--[^\n]*", "", queries[n]) for n in names}  # comments may say the word
    returning = sorted(n for n in names if re.search(r"\bRETURNING\b", code[n], re.IGNORECASE))
    assert returning == [], f"sent through executemany, yet RETURNING: {returning}"
