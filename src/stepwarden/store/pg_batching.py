"""A psycopg cursor whose pipelined statements leave in one ``send()`` per round trip, not one each.

Why: in pipeline mode psycopg sends every statement the moment it is queued, with a ``send()``
and a ``poll()`` of its own, so a reply batch of about a dozen statements cost the worker a dozen
of each, and the server as many wake-ups. Here a statement only goes into libpq's output buffer;
the buffer leaves when the transaction needs a result (a pipeline sync), when :func:`push` sends
the writes before ``COMMIT`` is queued, or when libpq's buffer fills. Measured on a 2-core
virtual machine (docs/performance.md, round s45): the worker's ``sendto`` calls per W1 task fell
from 2.6 to 1.4 and its ``poll`` calls from 4.7 to 1.4. What that buys depends on what a system
call costs: in a slow spell of the machine a prototype took PostgreSQL W1 from 1.65-1.79 to
1.34-1.36 ms of CPU per task (harness, interleaved); in a fast one this version measured the
same CPU with and without (1.37-1.40 ms).

psycopg offers no option for this, so the cursor overrides one of its private generators. It is
used only where the names it relies on exist (:data:`AVAILABLE`); otherwise the store's
connections keep psycopg's own cursor, and ``tests/contract/test_postgres_round_trips.py``
counts the sends, so a psycopg release that changes them fails there rather than silently
slowing down or breaking. Only the store's own connections use it: a caller's connection
(``app.transaction()``) keeps whatever cursor the caller's SQL expects.
"""

from __future__ import annotations

import contextlib
from typing import Any

AVAILABLE = False
with contextlib.suppress(ImportError):
    import psycopg

    _NEEDED = ("_execute_gen", "_start_query", "_convert_query", "_maybe_prepare_gen")
    AVAILABLE = all(hasattr(psycopg.Cursor, name) for name in _NEEDED)

if AVAILABLE:

    class BatchingCursor(psycopg.Cursor[Any]):
        """:class:`psycopg.Cursor`, except that in pipeline mode ``execute`` queues the statement
        in libpq's buffer without flushing it (see the module docstring)."""

        def _execute_gen(
            self, query: Any, params: Any = None, *, prepare: bool | None = None, binary: bool | None = None
        ) -> Any:
            pipeline = self._conn._pipeline
            if pipeline is None:
                return (yield from super()._execute_gen(query, params, prepare=prepare, binary=binary))
            yield from self._start_query(query)
            pgq = self._convert_query(query, params)
            yield from self._maybe_prepare_gen(pgq, prepare=prepare, binary=binary)
            # psycopg would now flush each queued command with a send() of its own; libpq's
            # send calls only buffer it (libpq flushes by itself if the buffer fills).
            queued = pipeline.command_queue
            while queued:
                queued.popleft()()
            self._last_query = query
            yield from self._conn._prepared.maintain_gen(self._conn)
            return None


def cursor_factory() -> dict[str, Any]:
    """The ``cursor_factory`` connection argument for the store's own connections, if any."""
    return {"cursor_factory": BatchingCursor} if AVAILABLE else {}


def push(conn: Any) -> None:
    """Send what a pipelined transaction has buffered, and read what has come back, without
    waiting for it: before ``COMMIT`` is queued, so that a connection found dead here is known
    not to have carried it (``postgres._run_to_commit``)."""
    pipeline = getattr(conn, "_pipeline", None)
    if AVAILABLE and pipeline is not None:
        conn.wait(pipeline._communicate_gen())
