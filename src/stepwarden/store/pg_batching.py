"""A psycopg cursor whose pipelined statements leave in a few writes per transaction, not one each.

Why: in pipeline mode psycopg sends every statement the moment it is queued, with a ``send()``
and a ``poll()`` of its own, so a reply batch of about a dozen statements cost the worker a dozen
of each, and the server as many wake-ups. Here a statement only goes into libpq's output buffer;
:func:`drain` sends all of it when the transaction needs a result (before a pipeline sync), and
:func:`push` before ``COMMIT`` is queued. (psycopg's sync can stop sending with bytes still in
libpq's buffer and then wait for a reply the server cannot send before it has read them: psycopg
issue #685. Without the drain, a 16 MiB statement followed by a read stalled in 1 of 6 runs on a
busy machine: ``test_postgres_round_trips.py``.)
Measured on a 2-core virtual machine (docs/performance.md, round s45): the worker's ``sendto``
calls per W1 task fell from 2.6 to 1.4 and its ``poll`` calls from 4.7 to 1.4. No gain in CPU or
throughput could be told from the noise with this version in a fast spell of the machine; a first
prototype (no push) did better than psycopg's cursor in a slow spell, in two interleaved pairs of
harness runs (CPU per W1 task 1.34-1.36 against 1.65-1.79 ms).

psycopg offers no option for this, so the cursor overrides one of its private generators and
uses two private names of its pipeline. It is used only with the psycopg release it was read
against (3.3) and only if those names exist (:data:`AVAILABLE`); otherwise the store's
connections keep psycopg's own cursor. ``tests/contract/test_postgres_round_trips.py`` counts a
transaction's writes to the socket with this cursor and with psycopg's, so a release that
changes what it relies on fails there. Only the store's own connections use it: a caller's connection
(``app.transaction()``) keeps whatever cursor the caller's SQL expects.
"""

from __future__ import annotations

import contextlib
from typing import Any

AVAILABLE = False
with contextlib.suppress(ImportError, ValueError):
    import psycopg
    from psycopg.generators import send

    _RELEASE = tuple(int(part) for part in psycopg.__version__.split(".")[:2])
    _NEEDED = ("_execute_gen", "_start_query", "_convert_query", "_maybe_prepare_gen")
    AVAILABLE = (
        _RELEASE == (3, 3)
        and all(hasattr(psycopg.Cursor, name) for name in _NEEDED)
        and hasattr(psycopg.Pipeline, "_communicate_gen")
    )

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
            # send calls only buffer it (and write what they can if the buffer grows large).
            queued = pipeline.command_queue
            while queued:
                queued.popleft()()
            self._last_query = query
            yield from self._conn._prepared.maintain_gen(self._conn)
            return None


def cursor_factory() -> dict[str, Any]:
    """The ``cursor_factory`` connection argument for the store's own connections, if any."""
    return {"cursor_factory": BatchingCursor} if AVAILABLE else {}


def _pipeline(conn: Any) -> Any:
    """The connection's open pipeline, if the batching cursor is in use; else None."""
    return getattr(conn, "_pipeline", None) if AVAILABLE else None


def drain(conn: Any) -> None:
    """Send all that a pipelined transaction has buffered (reading meanwhile, so the server never
    waits on us), before a sync asks for results."""
    if _pipeline(conn) is not None:
        conn.wait(send(conn.pgconn))


def push(conn: Any) -> None:
    """:func:`drain`, then process what has come back without waiting for more: before
    ``COMMIT`` is queued, so that a server error or a connection found closed here is raised
    while the transaction is known not to have committed (``postgres._run_to_commit``;
    ``test_postgres_commit.py`` fails without it)."""
    drain(conn)
    pipeline = _pipeline(conn)
    if pipeline is not None:
        conn.wait(pipeline._communicate_gen())
