"""Helpers of the PostgreSQL lock tests: a call on a thread of its own, and a watch of the
database for a session waiting on a lock (no test sleeps and hopes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``fn()`` started on a thread of its own; its result (or exception) lands in the list."""
    out: list[Any] = []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    th = threading.Thread(target=call, daemon=True)
    th.start()
    return th, out


def ends_before_it_waits(pg_url: str, th: threading.Thread, within: float = 10.0) -> bool:
    """Wait until ``th`` has ended (True) or a session of the database waits on a lock (False)."""
    end = time.monotonic() + within
    with psycopg.connect(pg_url, autocommit=True) as watch:
        while th.is_alive():
            if watch.execute(
                "SELECT 1 FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone():
                return False
            assert time.monotonic() < end, "the transaction neither ended nor waited on a lock"
            th.join(0.01)
    return True
