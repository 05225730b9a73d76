"""What a PostgreSQL worker transaction sends, read from libpq's own protocol trace: BEGIN goes
out with the first read, COMMIT with the last writes, so a reply batch that records, applies and
takes costs two round trips (a Sync each), and its dozen statements leave in a few writes to the
socket, not one each (store/pg_batching.py). And when something fails inside, nothing is written
and the pooled connection comes back clean."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from test_store import ME, Factory, q, room, run, states, submit

from stepwarden.store import Store, pg_batching
from stepwarden.store.postgres import PostgresStore


@pytest.fixture
def store_url(pg_url: str) -> str:
    return pg_url


@contextlib.contextmanager
def traced(store: Store, path: Path) -> Iterator[list[str]]:
    """Trace the protocol of every connection the store takes meanwhile; yields the messages the
    client sent (``Sync``, ``Parse``...), filled in when the block ends."""
    assert isinstance(store, PostgresStore)
    sent: list[str] = []
    original = store.pool.connection

    @contextlib.contextmanager
    def connection(*a: Any, **kw: Any) -> Iterator[Any]:
        with original(*a, **kw) as conn, path.open("a") as f:
            conn.pgconn.trace(f.fileno())
            conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
            try:
                yield conn
            finally:
                conn.pgconn.untrace()

    store.pool.connection = connection  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        store.pool.connection = original  # type: ignore[method-assign]
        for line in path.read_text().splitlines():
            parts = line.split("\t")
            if parts[0] == "F":
                sent.append(parts[2])


def _data_segments_out(conn: Any) -> int | None:
    """The TCP segments carrying data that the connection has sent (Linux's ``tcp_info``,
    ``tcpi_data_segs_out``, at byte 156): with libpq's TCP_NODELAY, one per write of a short
    message. None over a Unix socket or from a kernel too old to count them."""
    with socket.socket(fileno=os.dup(conn.pgconn.socket)) as s:
        if s.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
    return int(struct.unpack_from("I", info, 156)[0]) if len(info) >= 160 else None


@contextlib.contextmanager
def writes(store: Store, cursor: type[Any] | None = None) -> Iterator[list[int | None]]:
    """The socket writes of each connection the store takes meanwhile (filled in as they return),
    with ``cursor`` as the connections' cursor class if given."""
    assert isinstance(store, PostgresStore)
    counts: list[int | None] = []
    original = store.pool.connection

    @contextlib.contextmanager
    def connection(*a: Any, **kw: Any) -> Iterator[Any]:
        with original(*a, **kw) as conn:
            own = conn.cursor_factory
            if cursor is not None:
                conn.cursor_factory = cursor
            before = _data_segments_out(conn)
            try:
                yield conn
            finally:
                after = _data_segments_out(conn)
                counts.append(None if before is None or after is None else after - before)
                conn.cursor_factory = own

    store.pool.connection = connection  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        store.pool.connection = original  # type: ignore[method-assign]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's TCP_INFO")
def test_a_reply_batch_sends_its_statements_in_a_few_writes_not_one_each(
    store: Store, make_workflow: Factory, tmp_path: Path
) -> None:
    assert pg_batching.AVAILABLE, f"psycopg {psycopg.__version__}: the batching cursor is not in use"
    wf = make_workflow()
    for n in range(6):
        submit(store, wf, {"n": n})
    _, _, taken = run(store.schedule_and_take(ME, 50, {"svc": room(6)}))
    assert len(taken) == 6
    replies = [(m.id, "ok", None, None) for m in taken]

    # The same batch of 3 replies, once with psycopg's own cursor, once with the store's.
    with traced(store, tmp_path / "trace") as sent, writes(store, psycopg.Cursor) as plain:
        applied, _ = run(store.send_replies_and_take(ME, replies[:3], {"svc": room(3)}))
    assert applied is not None and applied.accepted == 3
    with writes(store) as batched:
        applied, _ = run(store.send_replies_and_take(ME, replies[3:], {"svc": room(3)}))
    assert applied is not None and applied.accepted == 3
    if None in plain + batched:
        pytest.skip("the store's connection is not one whose TCP writes Linux counts")

    statements = sent.count("Bind") + sent.count("Query")
    assert statements >= 10, sent
    assert len(plain) == 1 and plain[0] is not None and plain[0] >= statements, (plain, sent)
    # BEGIN and the reads; their Sync; the writes, pushed before COMMIT; COMMIT; its Sync; a flush.
    assert len(batched) == 1 and batched[0] is not None and batched[0] <= 8, batched


def test_a_reply_batch_records_applies_and_takes_in_two_round_trips(
    store: Store, make_workflow: Factory, tmp_path: Path
) -> None:
    wf = make_workflow()
    ids = [submit(store, wf, {"n": n}) for n in range(3)]
    _, _, taken = run(store.schedule_and_take(ME, 50, {"svc": room(3)}))
    assert len(taken) == 3
    with traced(store, tmp_path / "trace") as sent:
        applied, next_ = run(
            store.send_replies_and_take(ME, [(m.id, "ok", None, None) for m in taken], {"svc": room(3)})
        )
    assert applied is not None and applied.accepted == 3
    assert sorted(m.task_id for m in next_) == ids and {m.step_idx for m in next_} == {1}
    assert sent.count("Sync") == 2, sent


@pytest.mark.parametrize("failure", ["raised", "statement"])
def test_a_transaction_that_fails_inside_writes_nothing_and_leaves_the_connection_clean(
    store: Store, make_workflow: Factory, failure: str
) -> None:
    task_id = submit(store, make_workflow())

    def doomed(tx: Any) -> None:
        tx.put("finish_task", task_id=task_id, state="cancelled", error=None)  # pipelined, unread
        tx.one("task_by_key", key="k")  # a read: the write above has gone out
        if failure == "raised":
            raise ValueError("the transition's own code failed")
        tx.sql("SELECT 1 / 0")

    assert isinstance(store, PostgresStore)
    for _ in range(store.options.pool_size + 1):  # every pooled connection, and one more
        with pytest.raises((ValueError, psycopg.errors.DivisionByZero)):
            store.transact_sync(doomed)
    assert states(store, task_id)[0] == "pending"
    assert q(store, "SELECT COUNT(*) AS n FROM tasks WHERE state = 'cancelled'")[0]["n"] == 0
    for conn in list(store.pool._pool):  # idle in the pool, none left inside a transaction
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    _, claimed, _ = run(store.schedule_and_take(ME, 50, {}))
    assert claimed == 1


def test_the_steps_statement_reads_exactly_the_tasks_the_first_locked(
    store: Store, make_workflow: Factory, pg_url: str
) -> None:
    """The steps of a reply batch are read by a second statement, after the first has chosen the
    replies and locked their tasks. A reply committed in between (here with a lower id, so that it
    comes first) must neither change which tasks' steps come nor be locked by this batch."""
    wf = make_workflow()
    a, b, c = (submit(store, wf, {"n": n}) for n in range(3))
    _, _, taken = run(store.schedule_and_take(ME, 50, {"svc": room(3)}))
    by_task = {m.task_id: m for m in taken}
    run(store.send_replies(ME, [(by_task[t].id, "ok", None, None) for t in (a, b)], apply=False))

    def batch(tx: Any) -> tuple[set[int], set[int]]:
        replies = tx.all("new_replies_with_tasks", limit=2, own="[]", me=ME)
        with psycopg.connect(pg_url, autocommit=True) as other:
            other.execute(
                "INSERT INTO replies (id, request_id, task_id, step_idx, attempt, kind, outcome, sent_by,"
                " received_at) SELECT -1, id, task_id, step_idx, attempt, kind, 'ok', 'x', 0"
                " FROM requests WHERE id = %s",
                (by_task[c].id,),
            )
        steps = tx.all("steps_of_new_replies", limit=2, own="[]")
        with psycopg.connect(pg_url, autocommit=True) as other:  # not locked by this batch
            assert other.execute("SELECT id FROM replies WHERE id = -1 FOR UPDATE NOWAIT").fetchall() == [
                (-1,)
            ]
        return {r["task_id"] for r in replies}, {s["task_id"] for s in steps}

    chosen, with_steps = store.transact_sync(batch)
    assert chosen == {a, b}
    assert with_steps == {a, b}


def test_a_statement_larger_than_the_socket_buffers_then_a_read_does_not_stall(store: Store) -> None:
    """A write buffered by the store's cursor, bigger than the kernel takes at once, then a read:
    the read's sync must still send all of it before it waits for results, or the server, still
    reading the statement, never answers (the stall of psycopg issue #685; without the store's
    drain it stalled in 1 of 6 runs beside a busy core)."""
    assert isinstance(store, PostgresStore)
    big = "x" * (16 * 1024 * 1024)
    done: list[Any] = []

    def fn(tx: Any) -> Any:
        tx.conn.execute("SELECT length(%s)", (big,))  # queued, no result needed
        return tx.sql("SELECT 1 AS one")  # a read: syncs

    th = threading.Thread(target=lambda: done.append(store.transact_sync(fn)), daemon=True)
    th.start()
    th.join(timeout=30)
    assert done == [[{"one": 1}]], "the read's sync waited for a reply the server could not send"
