"""The SQLite dialect's :class:`~stepwarden.store.base.Tx`: named queries over one connection
inside one transaction, with the hot path's writes deferred (``DEFERRED``) and the events and
messages kept for commit, as ``pg_tx.py`` is for PostgreSQL.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from .base import DEFERRED, AtCommit, Row


def dict_row(cur: sqlite3.Cursor, row: tuple[Any, ...]) -> Row:
    return {d[0]: v for d, v in zip(cur.description, row, strict=True)}


class SqliteTx:
    dialect = "sqlite"
    waited = 0.0  # see Tx.waited

    def __init__(
        self, conn: sqlite3.Connection, queries: dict[str, str], *, caller_managed: bool = False
    ) -> None:
        self.conn = conn
        self.caller_managed = caller_managed
        self.q = queries
        self.kept: dict[str, list[dict[str, Any]]] = {}
        self.deferred: dict[str, list[dict[str, Any]]] = {}  # hot writes: run at the next read
        self.tail: list[tuple[str, dict[str, Any], AtCommit]] = []
        self.dispatched: list[str] = []

    def _cur(self) -> sqlite3.Cursor:
        if self.deferred:
            self._run_deferred()
        cur = self.conn.cursor()
        cur.row_factory = dict_row  # whatever the connection's own row factory (SUB2)
        return cur

    def _run_deferred(self) -> None:
        """The deferred writes (``DEFERRED``: why they may wait and be reordered), each query's
        rows through one prepared statement, in the order they came."""
        deferred, self.deferred = self.deferred, {}
        for query, rows in deferred.items():
            self._many(query, rows)

    def _many(self, query: str, rows: list[dict[str, Any]]) -> None:
        """One query's batch of deferred or kept writes: one prepared statement, stepped per row."""
        self.conn.executemany(self.q[query], rows)

    def one(self, query: str, /, **params: Any) -> Row | None:
        rows = self._cur().execute(self.q[query], params).fetchall()
        return rows[0] if rows else None

    def all(self, query: str, /, **params: Any) -> list[Row]:
        return self._cur().execute(self.q[query], params).fetchall()

    def both(
        self, first: tuple[str, dict[str, Any]], second: tuple[str, dict[str, Any]]
    ) -> tuple[list[Row], list[Row]]:
        return self.all(first[0], **first[1]), self.all(second[0], **second[1])

    def run(self, query: str, /, **params: Any) -> int:
        return self._cur().execute(self.q[query], params).rowcount

    def put(self, query: str, /, **params: Any) -> None:
        if query in DEFERRED:
            self.deferred.setdefault(query, []).append(params)
            return
        if self.deferred:
            self._run_deferred()
        self.conn.execute(self.q[query], params)

    def sql(self, text: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[Row]:
        return self._cur().execute(text, params).fetchall()

    def quiet(self, channel: str) -> None:
        pass  # SQLite's hints come from PRAGMA data_version, not from channels

    def later(self, query: str, /, **params: Any) -> None:
        self.kept.setdefault(query, []).append(params)

    def flush(self) -> None:
        if self.deferred:
            self._run_deferred()
        kept, self.kept = self.kept, {}
        for query, rows in kept.items():
            self._many(query, rows)
        tail, self.tail = self.tail, []
        for query, params, out in tail:
            out.set(self.all(query, **params))

    def at_commit(self, query: str, /, **params: Any) -> AtCommit:
        out = AtCommit()
        self.tail.append((query, params, out))
        return out

    def notify_if_queued(self, agents: list[str]) -> None:
        pass  # as quiet()
