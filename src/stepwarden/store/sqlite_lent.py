"""What the SQLite store keeps about connections it lends to callers' ``app.transaction()`` blocks
(SUB2): how many it keeps between blocks, which files each thread has a block open on, and the
settings a connection must still have when it is given back to be lent again.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from typing import Any

CALLER_IDLE_MAX = 4  # connections kept for callers' transactions between their blocks
# Per thread, the SQLite files (real paths) on which it has an app.transaction() block open,
# each with the asyncio task that opened it (None outside a running loop).
_BLOCKS = threading.local()


def open_blocks() -> dict[str, object]:
    files: dict[str, object] = _BLOCKS.__dict__.setdefault("files", {})
    return files


def current_task() -> object:
    """The running asyncio task of this thread, or None: who opened a block, or asks to write."""
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop in this thread
        return None


# The settings that live on a connection and that a caller's block could change (locking_mode
# EXCLUSIVE would keep the write lock; ignore_check_constraints would let the next block break a
# CHECK): read back when it is given back, each must be as on a new connection of ours (~70 µs
# for all; reading them through their table-valued forms in one statement saved only ~20).
CALLER_PRAGMAS = (
    "automatic_index",
    "busy_timeout",
    "cache_size",
    "cache_spill",
    "cell_size_check",
    "foreign_keys",
    "ignore_check_constraints",
    "journal_size_limit",
    "legacy_alter_table",
    "locking_mode",
    "mmap_size",
    "query_only",
    "recursive_triggers",
    "reverse_unordered_selects",
    "secure_delete",
    "synchronous",
    "temp_store",
    "threads",
    "trusted_schema",
    "wal_autocheckpoint",
    "writable_schema",
)


def caller_pragmas(conn: sqlite3.Connection) -> tuple[Any, ...]:
    return tuple(tuple(conn.execute(f"PRAGMA {name}").fetchone().values()) for name in CALLER_PRAGMAS)
