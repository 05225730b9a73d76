"""Reply queues on every store (SCH8): positions in commit order, durable cursors, the messages of
operator retries and cancels (OPS2, OPS3), and waiting for a task's result.

Each test gets ``store`` on SQLite AND PostgreSQL with the database clock on a FakeClock; the
transitions are driven by hand (claim, take, reply, apply) as in ``test_store.py``.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from stepwarden.clock import FakeClock
from stepwarden.errors import InputError, NotFound
from stepwarden.replies import Replies, ReplyMessage, TaskResult, ack, read, wait_for_result
from stepwarden.replies import wait_for_result_sync as wait_sync
from stepwarden.store import Store, open_store
from stepwarden.store import transitions as t
from stepwarden.workflow import Workflow, encode_input

ME = "sched-1:1:aaa"
AGENT = "agent-1:1:bbb"
SUP = "sup-1:1:ccc"
Factory = Callable[..., Workflow]


def submit(store: Store, wf: Workflow, reply_to: str | None = "web-1", correlation_id: str = "o-1") -> int:
    return store.transact_sync(
        t.submit,
        wf,
        encode_input({"order": correlation_id}),
        correlation_id=correlation_id,
        idempotency_key=None,
        priority=0,
        reply_to=reply_to,
    )[0]


def claim(store: Store) -> int:
    return store.transact_sync(t.claim_and_dispatch, ME, 10)


def reply_all(store: Store, outcome: str = "ok", error: str | None = None) -> None:
    """Every queued request gets ``outcome`` from the agent, and the scheduler applies the replies."""
    for req in asyncio.run(store.claim_requests(AGENT, ["svc"], 100)):
        asyncio.run(store.send_reply(AGENT, req.id, outcome, {"step": req.step_idx}, error))
    store.transact_sync(t.apply_replies, ME, 100, random.Random(0))


def run_to_end(store: Store, outcome: str = "ok") -> None:
    for _ in range(10):
        claim(store)
        reply_all(store, outcome, None if outcome == "ok" else "refused")


def queue(store: Store, name: str = "web-1", consumer: str | None = None, after: int | None = 0) -> list[Any]:
    return store.transact_sync(read, name, consumer, after, 1000)[1]


def kinds(msgs: list[ReplyMessage]) -> list[tuple[int, str, str | None]]:
    return [(m.task_id, m.kind, m.step) for m in msgs]


def consume(store: Store, name: str, consumer: str | None, n: int, **kw: Any) -> list[ReplyMessage]:
    """Take ``n`` messages with the async iterator (auto-acknowledged as the loop moves on)."""

    async def go() -> list[ReplyMessage]:
        out: list[ReplyMessage] = []
        r = Replies(store, name, consumer, listen=False, poll_interval=0.005, idle_poll_max=0.01, **kw)
        async for msg in r:
            out.append(msg)
            if len(out) == n:
                break
        await r.aclose()
        return out

    return asyncio.run(go())


# -- positions and cursors --------------------------------------------------------------------------


@pytest.mark.parametrize("correlation_id", ["plain", 'ö "quoted"\n€', None])
def test_every_message_body_is_written_in_one_text_format_on_every_store(
    store: Store, make_workflow: Factory, correlation_id: str | None
) -> None:
    """A consumer that reads the rows (or compares bodies as text) sees one format: PostgreSQL
    wrote the `received` message with json_build_object (`{"task_id" : 1, ...}`, non-ASCII as
    is) while every other message, and SQLite's, came from Python's encoder."""
    wf = make_workflow("a")
    tid = store.transact_sync(
        t.submit, wf, encode_input({}), correlation_id=correlation_id, idempotency_key=None, priority=0,
        reply_to="fmt",
    )[0]  # fmt: skip
    run_to_end(store)
    msgs = queue(store, "fmt")
    assert [m.kind for m in msgs] == ["received", "step_completed", "processed"]
    received = msgs[0]
    assert received.raw == json.dumps({"task_id": tid, "correlation_id": correlation_id, "kind": "received"})
    assert received.body == {"task_id": tid, "correlation_id": correlation_id, "kind": "received"}
    for m in msgs:  # the others already were: the same encoder, the same key order
        assert m.raw == json.dumps(m.body), m.raw


def test_messages_get_positions_in_order_and_a_named_cursor_resumes(
    store: Store, make_workflow: Factory
) -> None:
    wf = make_workflow("a", "b")
    one = submit(store, wf, correlation_id="o-1")
    two = submit(store, wf, correlation_id="o-2")
    submit(store, wf, reply_to="elsewhere", correlation_id="o-3")
    run_to_end(store)
    msgs = queue(store)
    assert [m.seq for m in msgs] == list(range(1, len(msgs) + 1))
    assert [m.id for m in msgs] == sorted(m.id for m in msgs)
    for tid, corr in ((one, "o-1"), (two, "o-2")):
        mine = [m for m in msgs if m.task_id == tid]
        assert kinds(mine) == [
            (tid, "received", None),
            (tid, "step_completed", "a"),
            (tid, "step_completed", "b"),
            (tid, "processed", None),
        ]
        assert {m.correlation_id for m in mine} == {corr} == {m.body["correlation_id"] for m in mine}
        assert mine[-1].body["results"] == {"a": {"step": 0}, "b": {"step": 1}}
    assert {m.queue for m in msgs} == {"web-1"}

    first = consume(store, "web-1", "app", 3)
    assert [m.seq for m in first] == [1, 2, 3]
    # the third was delivered but never acknowledged (the loop stopped inside its body): it comes again
    again = consume(store, "web-1", "app", len(msgs) - 2)
    assert [m.seq for m in again] == list(range(3, len(msgs) + 1))
    # a second name reads the same queue from its beginning, independently
    assert [m.seq for m in consume(store, "web-1", "audit", 2)] == [1, 2]
    assert queue(store, "web-1", "app", None)[0].seq == len(msgs)  # only the last is unacknowledged


def test_acknowledgements_are_cumulative_and_never_move_back(store: Store, make_workflow: Factory) -> None:
    submit(store, make_workflow("a"))
    run_to_end(store)
    assert len(queue(store)) == 3  # received, step_completed, processed
    store.transact_sync(ack, "web-1", "c", 2)
    store.transact_sync(ack, "web-1", "c", 1)
    assert [m.seq for m in queue(store, "web-1", "c", None)] == [3]

    async def manual() -> list[int]:
        r = Replies(store, "web-1", "m", auto_ack=False, listen=False, poll_interval=0.005)
        got = [await r.__anext__(), await r.__anext__(), await r.__anext__()]
        await r.ack(got[1])  # acknowledges the first two
        await r.aclose()
        return [m.seq for m in got]

    assert asyncio.run(manual()) == [1, 2, 3]
    assert [m.seq for m in queue(store, "web-1", "m", None)] == [3]


def test_ack_of_a_message_not_delivered_by_this_reader_is_refused_and_moves_nothing(
    store: Store, make_workflow: Factory
) -> None:
    """An acknowledgement moves the consumer's durable position: a message of another queue
    (its seq further on) skipped this queue's unread messages for good, and a wrong type was an
    AttributeError. Each is an InputError now, and the position stays."""
    wf = make_workflow("a")
    submit(store, wf, reply_to="q1")
    submit(store, wf, reply_to="q2", correlation_id="o-2")
    submit(store, wf, reply_to="q2", correlation_id="o-3")
    run_to_end(store)
    foreign = queue(store, "q2", None, None)[-1]
    assert foreign.seq > 3

    async def misuse() -> list[int]:
        r = Replies(store, "q1", "c", auto_ack=False, listen=False, poll_interval=0.005)
        first = await r.__anext__()
        with pytest.raises(InputError, match=r"of reply queue 'q2', not 'q1'"):
            await r.ack(foreign)
        undelivered = ReplyMessage(
            queue="q1",
            seq=first.seq + 1,
            id=first.id,
            task_id=first.task_id,
            correlation_id=None,
            kind="received",
            body={},
            created_at=0.0,
        )
        with pytest.raises(InputError, match=r"has not been delivered by this reader"):
            await r.ack(undelivered)
        with pytest.raises(InputError, match=r"ack takes a ReplyMessage"):
            await r.ack(first.seq)  # type: ignore[arg-type]
        await r.ack(first)
        await r.aclose()
        return [first.seq]

    assert asyncio.run(misuse()) == [1]
    # Only the first was acknowledged: the rest of q1 is still there for consumer "c".
    assert [m.seq for m in queue(store, "q1", "c", None)] == [2, 3]

    async def again() -> None:  # a reader made again acknowledges what the last one had: no error
        r = Replies(store, "q1", "c", auto_ack=False, listen=False, poll_interval=0.005)
        await r.ack(first_of_q1)
        with pytest.raises(InputError, match=r"has not been delivered by this reader"):
            await r.ack(queue(store, "q1", None, None)[-1])  # seq 3: further than "c" acknowledged
        await r.aclose()

    first_of_q1 = queue(store, "q1", None, None)[0]
    asyncio.run(again())
    assert [m.seq for m in queue(store, "q1", "c", None)] == [2, 3]


def test_an_unnamed_reader_reads_from_the_beginning_and_keeps_no_cursor(
    store: Store, make_workflow: Factory
) -> None:
    submit(store, make_workflow("a"))
    assert [m.kind for m in consume(store, "web-1", None, 1)] == ["received"]
    assert [m.kind for m in consume(store, "web-1", None, 1)] == ["received"]
    assert store.transact_sync(lambda tx: tx.sql("SELECT COUNT(*) AS n FROM reply_cursors"))[0]["n"] == 0


def test_the_iterator_waits_for_new_messages_and_ends_when_stopped(
    store: Store, make_workflow: Factory
) -> None:
    wf = make_workflow("a")

    async def go() -> list[str]:
        stop = asyncio.Event()
        out: list[str] = []

        async def produce() -> None:
            await asyncio.sleep(0.05)
            await asyncio.to_thread(submit, store, wf)
            await asyncio.to_thread(run_to_end, store)

        producer = asyncio.create_task(produce())
        async for msg in Replies(store, "web-1", "w", stop=stop, listen=False, poll_interval=0.005):
            out.append(msg.kind)
            if msg.kind == "processed":
                stop.set()
        await producer
        return out

    assert asyncio.run(go()) == ["received", "step_completed", "processed"]
    # the last one was acknowledged on the way out: the loop asked for the next message first
    assert queue(store, "web-1", "w", None) == []


class FailingAcks:
    """The store as a consumer sees it, with its acknowledgements failing while ``down`` is true
    (a database restart between two messages): every other transaction goes through."""

    def __init__(self, store: Store, failures: int | None) -> None:
        self.store, self.failures, self.tried = store, failures, 0
        self.real = store.transact

    async def transact(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn is ack and (self.failures is None or self.tried < self.failures):
            self.tried += 1
            raise OSError("server closed the connection unexpectedly")
        return await self.real(fn, *args, **kwargs)


def test_a_failed_automatic_acknowledgement_is_tried_again_before_the_next_message(
    store: Store, make_workflow: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The promise: a consumer that stops gets again only the message it was handling. Moving on
    past a failed acknowledgement broke it: message 1 stayed unacknowledged under message 2, and
    a stop while handling 2 brought both back."""
    submit(store, make_workflow("a"))
    run_to_end(store)
    acks = FailingAcks(store, failures=2)
    monkeypatch.setattr(store, "transact", acks.transact)
    first = consume(store, "web-1", "app", 2)  # stops while handling message 2 (not acknowledged)
    assert [m.kind for m in first] == ["received", "step_completed"] and acks.tried == 2
    monkeypatch.setattr(store, "transact", acks.real)
    again = consume(store, "web-1", "app", 2)
    assert [m.kind for m in again] == ["step_completed", "processed"], "message 1 came again"


def test_an_acknowledgement_still_owed_at_a_stop_is_tried_once_more_before_the_loop_ends(
    store: Store, make_workflow: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is down while the loop asks for message 2, and the consumer is told to stop:
    nothing more is delivered, and the finished message 1 is acknowledged on the way out (the
    retry that follows the stop) once the store answers again."""
    submit(store, make_workflow("a"))
    run_to_end(store)
    acks = FailingAcks(store, failures=None)
    monkeypatch.setattr(store, "transact", acks.transact)

    async def go() -> list[str]:
        stop = asyncio.Event()
        out: list[str] = []
        r = Replies(store, "web-1", "app", stop=stop, listen=False, poll_interval=0.005, idle_poll_max=0.01)
        async for msg in r:
            out.append(msg.kind)
            asyncio.get_running_loop().call_later(0.05, stop.set)  # a shutdown, mid-outage
            asyncio.get_running_loop().call_later(0.05, lambda: setattr(acks, "failures", 0))
        return out

    assert asyncio.run(go()) == ["received"] and acks.tried >= 2
    monkeypatch.setattr(store, "transact", acks.real)
    assert [m.kind for m in consume(store, "web-1", "app", 2)] == ["step_completed", "processed"]


def test_a_close_from_another_task_ends_a_loop_waiting_out_a_store_that_is_down(
    store: Store, make_workflow: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``stop`` event: the application ends the consumer with ``aclose()`` from elsewhere while
    the store is down. The loop, retrying its acknowledgement and then its reads, must end, not
    poll for ever (and deliver nothing after the close if the store came back)."""
    submit(store, make_workflow("a"))
    run_to_end(store)
    real = store.transact
    down = {"on": False}

    async def transact(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if down["on"]:
            raise OSError("server closed the connection unexpectedly")
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(store, "transact", transact)

    async def go() -> list[str]:
        r = Replies(store, "web-1", "app", listen=False, poll_interval=0.005, idle_poll_max=0.02)
        out: list[str] = []
        async for msg in r:
            out.append(msg.kind)
            down["on"] = True
            asyncio.get_running_loop().call_later(0.1, lambda: asyncio.ensure_future(r.aclose()))
        return out

    assert asyncio.run(asyncio.wait_for(go(), 5)) == ["received"]


def test_bad_queue_and_consumer_names_are_refused(store: Store) -> None:
    with pytest.raises(InputError):
        Replies(store, "q1' OR '1'='1")
    with pytest.raises(InputError):
        Replies(store, "web-1", "bad name")


def test_a_message_committed_late_with_a_lower_id_is_not_skipped(pg_url: str, make_workflow: Factory) -> None:
    """PostgreSQL hands out ids before commit: a transaction holding id N may commit after one with
    N+1 was read. Positions are given at read time, in commit order, so nothing is passed over."""
    store = open_store(pg_url)
    try:
        wf = make_workflow("a")
        early = submit(store, wf, reply_to="other")  # just a task whose row a message can name
        slow = store.connect()
        try:
            tx = store.tx_on(slow)
            task = {"id": early, "reply_to": "web-1", "correlation_id": "slow"}
            t.message(tx, task, "received")
            tx.flush()  # written now: it takes the lower id, but is not committed yet
            fast = submit(store, wf, correlation_id="fast")  # a higher id, committed first
            got = consume(store, "web-1", "app", 1)
            assert [(m.task_id, m.seq) for m in got] == [(fast, 1)]
            store.commit(slow, tx)
        finally:
            slow.close()
        rest = consume(store, "web-1", "app", 2)
        assert [(m.task_id, m.seq) for m in rest] == [(fast, 1), (early, 2)]  # the first unacknowledged
        assert rest[1].id < rest[0].id
    finally:
        store.close()


def test_a_message_pruned_while_positions_are_given_leaves_a_gap_not_a_jammed_queue(
    pg_url: str, make_workflow: Factory
) -> None:
    """A message deleted (by the leader's prune) while the reader waits for its row lock is passed
    over by the positioning, which gives the others their positions with a gap. The queue's last
    position is the highest one given, so the next message gets a free one: before, it was base +
    the rows positioned, a position already taken, and every later read failed on the unique
    index while the reader retried, delivering nothing."""
    import psycopg

    from stepwarden.testing.postgres import wait_for_lock_waiter

    store = open_store(pg_url)
    try:
        wf = make_workflow("a")
        ids = [submit(store, wf, correlation_id=f"o-{i}") for i in range(3)]
        with psycopg.connect(pg_url) as pruner:
            middle = pruner.execute("SELECT id FROM messages WHERE task_id = %s", (ids[1],)).fetchone()
            assert middle is not None
            pruner.execute("SELECT id FROM messages WHERE id = %s FOR UPDATE", middle)
            got: list[list[ReplyMessage]] = []
            reader = threading.Thread(target=lambda: got.append(queue(store)))
            reader.start()
            wait_for_lock_waiter(pg_url)  # the reader waits for the row
            pruner.execute("DELETE FROM messages WHERE id = %s", middle)
            pruner.commit()
            reader.join(timeout=10)
        assert [(m.task_id, m.seq) for m in got[0]] == [(ids[0], 1), (ids[2], 3)]
        later = submit(store, wf, correlation_id="o-later")
        assert [(m.task_id, m.seq) for m in queue(store)] == [(ids[0], 1), (ids[2], 3), (later, 4)]
    finally:
        store.close()


def test_an_idle_consumer_on_sqlite_does_not_wait_for_the_write_lock(
    tmp_path: Any, make_workflow: Factory
) -> None:
    """An idle consumer's poll asks first, in a transaction that takes no write lock, whether
    there is anything to read: it neither waits for a long write of the workers' nor makes them
    wait for it. Before, every poll was a write transaction, and with a write held elsewhere the
    consumer sat in it (up to the busy timeout, 30 s), deaf to its stop."""
    import sqlite3

    path = tmp_path / "replies.db"
    store = open_store(f"sqlite:///{path}")
    try:
        first = submit(store, make_workflow("a"), reply_to="q")

        async def go() -> tuple[list[int], float]:
            stop = asyncio.Event()
            r = Replies(store, "q", "app", stop=stop, listen=False, poll_interval=0.01, idle_poll_max=0.02)
            seen = [(await r.__anext__()).task_id]
            await r.ack()  # acknowledged (a write) before the lock is taken: from here on it only polls
            writer = sqlite3.connect(path, isolation_level=None)
            writer.execute("BEGIN IMMEDIATE")  # a long write of someone else's holds the lock
            try:
                loop = asyncio.get_running_loop()
                loop.call_later(0.3, stop.set)
                began = loop.time()
                async for msg in r:
                    seen.append(msg.task_id)
                return seen, loop.time() - began
            finally:
                writer.execute("ROLLBACK")
                writer.close()

        seen, took = asyncio.run(go())
        assert seen == [first]
        assert took < 2.0, f"the idle consumer waited {took:.1f}s for the write lock"
        later = submit(store, make_workflow("b"), reply_to="q")  # and it still reads what comes
        assert [m.task_id for m in consume(store, "q", "app", 1)] == [later]
    finally:
        store.close()


# -- operators: retry and cancel (OPS2, OPS3) --------------------------------------------------------


def test_retry_of_an_errored_task_tells_the_reply_queue(store: Store, make_workflow: Factory) -> None:
    tid = submit(store, make_workflow("a", "b"))
    claim(store)
    reply_all(store)  # a completed, b dispatched
    reply_all(store, "error", "card declined")  # b fails for good: error
    assert [m.kind for m in queue(store)][-1] == "error"
    assert queue(store)[-1].body["step"] == "b" and "card declined" in queue(store)[-1].body["error"]
    store.transact_sync(t.retry_task, tid, None, "operator")
    run_to_end(store)
    assert kinds(queue(store)) == [
        (tid, "received", None),
        (tid, "step_completed", "a"),
        (tid, "error", "b"),
        (tid, "retried", "b"),
        (tid, "step_completed", "b"),
        (tid, "processed", None),
    ]


def test_cancel_of_a_running_task_tells_the_reply_queue(store: Store, make_workflow: Factory) -> None:
    tid = submit(store, make_workflow("a", "b", "c"))
    claim(store)
    reply_all(store)  # a completed, b running
    assert store.transact_sync(t.cancel_task, tid, "operator") == "processing"
    run_to_end(store)  # b's reply comes, then b and a are undone
    got = kinds(queue(store))
    assert got == [
        (tid, "received", None),
        (tid, "step_completed", "a"),
        (tid, "step_completed", "b"),
        (tid, "compensating", None),
        (tid, "step_compensated", "b"),
        (tid, "step_compensated", "a"),
        (tid, "cancelled", None),
    ]
    assert queue(store)[3].body["reason"] == "cancel requested"


def test_cancel_of_an_errored_task_tells_the_reply_queue(store: Store, make_workflow: Factory) -> None:
    tid = submit(store, make_workflow("a", "b"))
    claim(store)
    reply_all(store)
    reply_all(store, "error", "refused")
    assert store.transact_sync(t.cancel_task, tid, "operator") == "compensating"
    # while it is undone, `task show` must not give it the end time and error of its failure
    cols = "state, finished_at, last_error, complete_by"
    row = store.transact_sync(lambda tx: tx.sql(f"SELECT {cols} FROM tasks WHERE id = ?", (tid,)))[0]
    assert dict(row) == dict(state="compensating", finished_at=None, last_error=None, complete_by=None)
    run_to_end(store)
    assert [m.kind for m in queue(store)] == [
        "received",
        "step_completed",
        "error",
        "compensating",
        "step_compensated",  # b failed, but it started: its effect may exist
        "step_compensated",
        "cancelled",
    ]


# -- waiting for a result ------------------------------------------------------------------------------


def test_wait_for_result_reads_the_task_messages(store: Store, make_workflow: Factory) -> None:
    wf = make_workflow("a")
    tid = submit(store, wf, correlation_id="o-9")
    with pytest.raises(TimeoutError, match="still pending"):
        wait_sync(store, tid, 0.05)
    run_to_end(store)
    r = wait_sync(store, tid, 1)
    assert isinstance(r, TaskResult) and r.ok and r.state == "processed"
    assert r.results == {"a": {"step": 0}} and r.error is None and r.correlation_id == "o-9"
    assert [m.kind for m in r.messages] == ["received", "step_completed", "processed"]
    assert asyncio.run(wait_for_result(store, tid, 1)) == r
    with pytest.raises(NotFound):
        wait_sync(store, 987654, 1)


def test_wait_for_result_of_an_errored_and_retried_task(store: Store, make_workflow: Factory) -> None:
    tid = submit(store, make_workflow("a"))
    claim(store)
    reply_all(store, "error", "card declined")
    r = wait_sync(store, tid, 1)
    assert r.state == "error" and not r.ok and "card declined" in (r.error or "") and r.results is None
    store.transact_sync(t.retry_task, tid, None, "operator")
    with pytest.raises(TimeoutError):  # retried: no longer final
        wait_sync(store, tid, 0.05)

    async def wait_while_it_runs() -> TaskResult:
        waiting = asyncio.create_task(wait_for_result(store, tid, 5))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(run_to_end, store)
        return await waiting

    r = asyncio.run(wait_while_it_runs())
    assert r.state == "processed" and r.results == {"a": {"step": 0}}


def test_wait_for_result_without_a_reply_queue_reads_the_rows(store: Store, make_workflow: Factory) -> None:
    tid = submit(store, make_workflow("a", "b"), reply_to=None)
    run_to_end(store)
    r = wait_sync(store, tid, 1)
    assert (r.state, r.results, r.messages) == ("processed", {"a": {"step": 0}, "b": {"step": 1}}, ())
    bad = submit(store, make_workflow("a", name="wf2"), reply_to=None)
    claim(store)
    reply_all(store, "error", "card declined")
    r = wait_sync(store, bad, 1)
    assert r.state == "error" and "card declined" in (r.error or "")


def test_waiting_measures_its_timeout_on_the_clock_it_is_given(
    store: Store, clock: FakeClock, make_workflow: Factory
) -> None:
    """The async wait measures its timeout on the app's clock."""
    tid = submit(store, make_workflow("a"))

    async def go() -> None:
        waiting = asyncio.create_task(wait_for_result(store, tid, 10, clock=clock))
        real_end = time.monotonic() + 10
        while not waiting.done() and time.monotonic() < real_end:
            await asyncio.sleep(0.001)
            clock.advance(0.25)
        with pytest.raises(TimeoutError):
            await waiting

    asyncio.run(go())
