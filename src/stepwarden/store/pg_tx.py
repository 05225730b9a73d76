"""A transaction on a PostgreSQL connection: the :class:`Tx` that the transitions of
``transitions.py`` write through, with the pipelining, the writes kept for commit and the wake-up
hints that make the PostgreSQL store fast. Kept apart from the store (``postgres.py``) because it
is the one object every transition touches, while the store only opens, retries and commits it.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from . import pg_batching
from .base import DEFERRED, AtCommit, Row

# Without the postgres extra this module still imports: the store then refuses to open, saying what
# to install, so no PgTx is ever made.
with contextlib.suppress(ImportError):
    from psycopg.rows import dict_row
    from psycopg.types.json import Jsonb

# Channels of the wake-up hints, by the query that makes new work for someone.
NOTIFY_ON = {
    "insert_task": "stepwarden_tasks",
    "insert_request": "stepwarden_requests",
    "insert_reply": "stepwarden_replies",
    "release_task": "stepwarden_tasks",
    "finish_task": "stepwarden_done",
}
CHANNELS = sorted(set(NOTIFY_ON.values()))
REQUESTS = NOTIFY_ON["insert_request"]
_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def _to_psycopg(sql: str) -> str:
    return _PARAM.sub(r"%(\1)s", sql)


class PgTx:
    dialect = "postgres"
    waited = 0.0  # see Tx.waited

    def __init__(
        self,
        conn: Any,
        queries: dict[str, str],
        notify: set[str],
        pipeline: Any = None,
        *,
        prepare: bool = True,
        caller_managed: bool = False,
    ) -> None:
        self.conn = conn
        self.q = queries
        self.notify = notify
        self.pipeline = pipeline
        # Server-side prepared statements, each prepared on its first use; off (``prepare=off``)
        # they are never prepared, not even after psycopg's threshold: behind a pooler that does
        # not track them, a statement prepared on one server session is missing on the next.
        self.prepare = prepare
        self.kept: dict[str, list[dict[str, Any]]] = {}  # events, messages: sent at commit
        self.deferred: dict[str, list[dict[str, Any]]] = {}  # hot writes: sent at the next read
        self.dispatched: list[str] = []
        self.quieted: set[str] = set()
        self.tail: list[tuple[str, dict[str, Any], AtCommit]] = []  # at_commit, not yet sent
        self.tail_sent: list[tuple[Any, AtCommit]] = []  # sent: their cursors, read after COMMIT
        self.if_queued: list[str] | None = None  # notify_if_queued's agents
        self.caller_managed = caller_managed

    def _exec(self, query: str, params: dict[str, Any]) -> Any:
        if self.deferred:
            self._send_deferred()
        self._hint(query)
        return self.conn.cursor(row_factory=dict_row).execute(self.q[query], params, prepare=self.prepare)

    def _hint(self, query: str) -> None:
        """Note the wake-up channel of work ``query`` creates; sent once, at commit."""
        channel = NOTIFY_ON.get(query)
        if channel:
            self.notify.add(channel)

    def _send_deferred(self) -> None:
        deferred, self.deferred = self.deferred, {}
        for query, rows in deferred.items():
            keys = DEFERRED[query]
            if len(rows) > 1 and (not keys or len({tuple(r[k] for k in keys) for r in rows}) == len(rows)):
                self._send_many(query, rows)
            else:
                cur = self.conn.cursor()
                for params in rows:
                    cur.execute(self.q[query], params, prepare=self.prepare)

    def _send_many(self, query: str, rows: list[dict[str, Any]]) -> None:
        """Every row of ``rows`` through ``query``, in one statement when the query has a set-based
        form, else one by one (in a pipeline either way: no round trip of its own)."""
        many = self.q.get(query + "__many")
        if many is None:
            self.conn.cursor().executemany(self.q[query], rows)
        else:
            self.conn.cursor().execute(many, {"rows": Jsonb(rows)}, prepare=self.prepare)

    def _sync(self) -> None:
        if self.pipeline is not None:
            pg_batching.drain(self.conn)  # all of what the cursor buffered (see pg_batching)
            self.pipeline.sync()  # a read needs its result: flush the pipelined writes and wait

    @staticmethod
    def _rows(cur: Any) -> list[Row]:
        return list(cur.fetchall()) if cur.description else []

    def one(self, query: str, /, **params: Any) -> Row | None:
        rows = self.all(query, **params)
        return rows[0] if rows else None

    def all(self, query: str, /, **params: Any) -> list[Row]:
        cur = self._exec(query, params)
        self._sync()
        return self._rows(cur)

    def both(
        self, first: tuple[str, dict[str, Any]], second: tuple[str, dict[str, Any]]
    ) -> tuple[list[Row], list[Row]]:
        # Pipelined: the server runs them in order (the second sees the first's locks), and one
        # sync fetches both results.
        a, b = self._exec(*first), self._exec(*second)
        self._sync()
        return self._rows(a), self._rows(b)

    def run(self, query: str, /, **params: Any) -> int:
        cur = self._exec(query, params)
        self._sync()  # the row count is known only once the result is back
        return int(cur.rowcount)

    def put(self, query: str, /, **params: Any) -> None:
        if query in DEFERRED:
            self._hint(query)
            self.deferred.setdefault(query, []).append(params)
        else:
            self._exec(query, params)

    def sql(self, text: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[Row]:
        if isinstance(params, tuple) and params:
            text = text.replace("?", "%s")
        if self.deferred:
            self._send_deferred()
        cur = self.conn.cursor(row_factory=dict_row).execute(
            text, params or None, prepare=None if self.prepare else False
        )
        self._sync()
        return self._rows(cur)

    def quiet(self, channel: str) -> None:
        self.quieted.add(channel)

    def later(self, query: str, /, **params: Any) -> None:
        self.kept.setdefault(query, []).append(params)

    def flush(self) -> None:
        self._send_deferred()
        kept, self.kept = self.kept, {}
        for query, rows in kept.items():
            self._hint(query)
            self._send_many(query, rows)
        tail, self.tail = self.tail, []
        for query, params, out in tail:
            self.tail_sent.append((self._exec(query, params), out))

    def at_commit(self, query: str, /, **params: Any) -> AtCommit:
        out = AtCommit()
        self.tail.append((query, params, out))
        return out

    def read_tail(self) -> None:
        """The rows of the at_commit statements, for their callers; every path calls it once
        COMMIT has come back (in pipeline mode the rows arrive only with it)."""
        sent, self.tail_sent = self.tail_sent, []
        for cur, out in sent:
            out.set(self._rows(cur))

    def notify_if_queued(self, agents: list[str]) -> None:
        self.if_queued = agents

    def send_notifications(self) -> None:
        channels = sorted(self.notify - self.quieted)
        if self.if_queued is not None and REQUESTS in channels:
            # Evaluated after the statements that took requests for our own slots: a hint only
            # if some are left for other workers.
            channels.remove(REQUESTS)
            self._exec("notify_requests_left", {"channel": REQUESTS, "agents": self.if_queued})
        if channels:  # one statement for all channels: each statement costs a message exchange
            calls = ", ".join("pg_notify(%s, '')" for _ in channels)
            self.conn.execute(f"SELECT {calls}", channels, prepare=None if self.prepare else False)
        self.notify.clear()
