"""State stores: one database holds tasks, steps, messages, leases and events.

``open_store(url)`` picks the dialect from the URL: ``sqlite:///path.db`` (the embedded default).
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import InputError
from .base import FINAL_TASK_STATES, STEP_STATES, TASK_STATES, ApplyResult, RequestMsg, SweepResult, Tx
from .core import Store
from .sqlite import SQLiteStore

DEFAULT_URL = "sqlite:///stepwarden.db"

__all__ = [
    "DEFAULT_URL",
    "FINAL_TASK_STATES",
    "STEP_STATES",
    "TASK_STATES",
    "ApplyResult",
    "RequestMsg",
    "SQLiteStore",
    "Store",
    "SweepResult",
    "Tx",
    "open_store",
    "resolve_url",
]


def resolve_url(url: str | None) -> str:
    """``--db``, else ``STEPWARDEN_DB``, else the default file in the working directory (DEP5)."""
    return url or os.environ.get("STEPWARDEN_DB") or DEFAULT_URL


def open_store(url: str | None = None, *, clock: Clock = SYSTEM_CLOCK, migrate: bool = True) -> Store:
    url = resolve_url(url)
    if url.startswith("sqlite:///"):
        path, _, query = url[len("sqlite:///") :].partition("?")
        if not path:
            raise InputError("sqlite URL has no path: use sqlite:///relative.db or sqlite:////absolute.db")
        options = dict(parse_qsl(query, keep_blank_values=True))
        unknown = sorted(set(options) - {"synchronous"})
        if unknown:
            raise InputError(
                f"unknown sqlite URL option(s) {', '.join(repr(k)[:40] for k in unknown)}: only synchronous"
            )
        sync = options.get("synchronous", "FULL").upper()
        if sync not in ("FULL", "NORMAL", "EXTRA"):
            raise InputError("sqlite URL option synchronous must be FULL (the default), NORMAL or EXTRA")
        return SQLiteStore(path, clock=clock, migrate=migrate, synchronous=sync)
    if url.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresStore

        return PostgresStore(url, clock=clock, migrate=migrate)
    raise InputError(f"unsupported store URL {url[:80]!r}: expected sqlite:///PATH or postgresql://...")
