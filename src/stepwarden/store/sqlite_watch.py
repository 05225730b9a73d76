"""SQLite's wake-up hint for the roles: a thread that watches ``PRAGMA data_version``.

SQLite has no notifications; ``data_version`` changes whenever another connection commits, and
reading it is a read of shared memory. Kept apart from the store: it is a thread of its own with
its own connection and outage handling, and shares nothing with the store's transactions.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence

from .base import WORK_CHANNELS

log = logging.getLogger("stepwarden.sqlite")  # the store's logger: operators filter on one name

WATCH_RETRY_MAX = 2.0  # seconds between the watcher's attempts to come back after an error
WATCH_SETTLED = 1.0  # seconds a new watch connection must keep working to end an outage


async def watch_data_version(
    connect: Callable[[], sqlite3.Connection],
    interval: float,
    wake: Callable[[str], None],
    stop: asyncio.Event,
    channels: Sequence[str] | None = None,
) -> None:
    """SQLite's wake-up hint: ``PRAGMA data_version`` changes whenever another connection
    commits. A thread reads it every ``interval`` seconds (a read of shared memory, no
    disk I/O) and wakes the roles when it moves, so idle workers pick up new work in
    milliseconds without polling the tables."""
    if interval <= 0:
        await stop.wait()
        return
    loop = asyncio.get_running_loop()
    done = threading.Event()

    # Failed connections (or reads) in the current outage; 0 while the watch works.
    outage = 0

    def watch() -> None:
        nonlocal outage
        while not done.is_set():
            try:
                conn = connect()
                try:
                    follow(conn)
                finally:
                    conn.close()
            except sqlite3.Error as e:
                if outage == 0:  # once per outage: the roles still poll, work only starts later
                    log.warning("data_version watcher failed, the roles poll until it is back: %r", e)
                outage += 1
            except RuntimeError:  # the event loop closed under us: the worker is leaving
                return
            # Until the watch works again the roles poll at their idle interval (as with
            # watch_interval=0); retried on a fresh connection, 0.05 s apart, doubling to 2 s.
            done.wait(min(WATCH_RETRY_MAX, 0.05 * 2 ** min(outage - 1, 10)))

    def follow(conn: sqlite3.Connection) -> None:
        """Wake the roles whenever ``data_version`` moves, until ``done``; raises on an error."""
        nonlocal outage
        last = conn.execute("PRAGMA data_version").fetchone()[0]
        opened = time.monotonic()
        if outage:
            wake_all()  # a commit may have come while it was down
        while not done.wait(interval):
            now = conn.execute("PRAGMA data_version").fetchone()[0]
            if now != last:
                last = now
                wake_all()
            if outage and time.monotonic() - opened >= WATCH_SETTLED:
                # Only a connection that keeps working ends the outage: one that fails again
                # after a few reads must not restart the back-off or the warnings.
                log.info("data_version watcher: working again")
                outage = 0

    def wake_all() -> None:
        for channel in WORK_CHANNELS if channels is None else channels:
            loop.call_soon_threadsafe(wake, channel)

    thread = threading.Thread(target=watch, name="stepwarden-sqlite-watch", daemon=True)
    thread.start()
    try:
        await stop.wait()
    finally:
        done.set()
