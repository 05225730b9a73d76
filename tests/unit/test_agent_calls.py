"""How one call of an operation runs, and what its attempt replies (AGT2, AGT4, AGT5, AGT7).

Each test pins down a way the agent once sent the wrong thing: a coroutine's text as a result, a
reply after complete-by, a worker ended by a handler's ``SystemExit``, a call started with no
time left, a queued plain call started after its complete-by, a hung service starving the next
calls. Agent deadlines are real time, so the store is on the real clock and the budgets short;
waits are on conditions, with deadlines.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from test_agent_role import ME, Dispatch, WrappedStore, finish, make_role, replies, request_states, until

from stepwarden.agent import Agent, AgentRole, AgentSettings, Request
from stepwarden.errors import Permanent, Transient
from stepwarden.policies import Backoff
from stepwarden.store import Store
from stepwarden.store import agents as sa
from stepwarden.workflow import Workflow

Factory = Callable[..., Workflow]


def run_requests(store: Store, agent: Agent, pulled: int = 1, timeout: float = 3.0, **kw: Any) -> AgentRole:
    """Pull ``pulled`` requests and wait for their tasks to end."""
    role = make_role(store, agent, **kw)

    async def body() -> None:
        assert await role.pull() == pulled
        await finish(role, timeout=timeout)

    asyncio.run(body())
    return role


def timed_replies(store: Store) -> list[dict[str, Any]]:
    """Each reply with when it was received and its request's complete-by (database clock)."""
    return store.transact_sync(
        lambda tx: tx.sql(
            "SELECT r.outcome, r.result, r.error, r.received_at, q.complete_by FROM replies r"
            " JOIN requests q ON q.id = r.request_id ORDER BY r.id"
        )
    )


def failures_total(store: Store) -> int:
    rows = store.transact_sync(lambda tx: tx.sql("SELECT failures_total FROM agent_instances"))
    return sum(int(r["failures_total"]) for r in rows)


# -- async or plain (AGT7) ------------------------------------------------------------------------------


def test_a_plain_decorator_around_an_async_operation_runs_it_and_replies_its_result(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """The wrapper returns the coroutine from a thread; it is awaited, not stored as its text."""
    dispatch_requests(rt_store)
    agent = Agent("svc")
    ran: list[int] = []

    def logged(f: Callable[[Request], Any]) -> Callable[[Request], Any]:
        def wrapper(req: Request) -> Any:
            return f(req)

        wrapper.__name__ = f.__name__
        return wrapper

    @agent.operation
    @logged
    async def do_s(req: Request) -> dict[str, bool]:
        ran.append(req.task_id)
        return {"charged": True}

    run_requests(rt_store, agent)
    assert len(ran) == 1
    assert [(r["outcome"], r["result"]) for r in replies(rt_store)] == [("ok", '{"charged":true}')]


def test_an_object_with_an_async_call_method_runs_on_the_event_loop(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(rt_store)
    agent = Agent("svc")
    threads: list[str] = []

    class Charge:
        async def __call__(self, req: Request) -> int:
            threads.append(threading.current_thread().name)
            await asyncio.sleep(0)
            return 7

    agent.operation(Charge(), name="do_s")
    run_requests(rt_store, agent)
    assert threads == [threading.main_thread().name]
    assert [(r["outcome"], r["result"]) for r in replies(rt_store)] == [("ok", "7")]


# -- hung plain functions: slots, threads and complete-by (AGT4, AGT6, AGT7) ------------------------


def test_a_hung_plain_handler_keeps_its_slot_until_its_thread_is_free(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """Past complete-by the thread still runs the hung call: the agent takes nothing more for
    it, and pulls again once the thread is free."""
    agent = Agent("svc", concurrency=2, breaker_threshold=100)
    gate = threading.Event()
    started: list[int] = []

    @agent.operation
    def do_s(req: Request) -> str:
        started.append(req.task_id)
        gate.wait(10)  # the service hangs
        return "late"

    async def body() -> None:
        role = make_role(rt_store, agent)
        dispatch_requests(rt_store, n=2, budget=0.2)
        assert await role.pull() == 2
        await finish(role, timeout=3.0)  # both silent at complete-by; their threads run on
        dispatch_requests(rt_store, n=2, budget=5.0)
        assert await role.pull() == 0, "no thread is free for them"
        assert role.inflight == {"svc": 2} and role.load() == {"svc": (2, 2)}
        gate.set()
        await until(lambda: role.inflight == {"svc": 0}, timeout=3.0)
        assert await role.pull() == 2
        await finish(role, timeout=3.0)

    asyncio.run(body())
    assert len(started) == 4
    assert [r["outcome"] for r in replies(rt_store)] == ["ok", "ok"]  # the two late results unsent


def test_a_plain_call_still_waiting_for_a_thread_at_complete_by_never_starts(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """One thread, two calls: the second waits behind the hung first. At complete-by it is
    dropped, so no handler starts after its request's complete-by, and a call that never
    started is no failure of the service."""
    agent = Agent("svc", concurrency=2, breaker_threshold=100)
    gate = threading.Event()
    starts: list[tuple[float, float]] = []  # (wall time at start, complete-by)

    @agent.operation
    def do_s(req: Request) -> str:
        starts.append((time.time(), req.complete_by))
        gate.wait(10)
        return "late"

    async def body() -> None:
        role = make_role(rt_store, agent, threads=1)
        dispatch_requests(rt_store, n=2, budget=0.3)
        assert await role.pull() == 2
        await finish(role, timeout=3.0)
        gate.set()
        pool = role.attempts.pools["svc"]
        # one thread: this runs after every job queued before it has run (or been dropped)
        await asyncio.wrap_future(pool.submit(lambda: None))
        await until(lambda: role.inflight == {"svc": 0}, timeout=3.0)

    asyncio.run(body())
    assert len(starts) == 1, starts
    assert all(at < complete_by for at, complete_by in starts)
    assert replies(rt_store) == []
    assert failures_total(rt_store) == 1  # the hang; not the call that never ran


def test_one_agents_hung_service_does_not_starve_another_agents_plain_calls(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    hung, other = Agent("hung", concurrency=2, breaker_threshold=100), Agent("other", concurrency=1)
    gate = threading.Event()

    @hung.operation
    def do_s(req: Request) -> str:
        gate.wait(10)
        return "late"

    def other_do_s(req: Request) -> str:
        return "fine"

    other.operation(other_do_s, name="do_s")

    async def body() -> None:
        role = AgentRole(rt_store, {"hung": hung, "other": other}, ME)
        for _ in range(2):  # the hung service's calls expire; then more of them come
            dispatch_requests(rt_store, n=2, budget=0.2, agent="hung")
            await role.pull()
            await finish(role, timeout=3.0)
        dispatch_requests(rt_store, n=1, budget=1.0, agent="other")
        assert await role.pull() == 1
        await finish(role, timeout=3.0)
        gate.set()

    asyncio.run(body())
    assert [(r["outcome"], r["result"]) for r in replies(rt_store)] == [("ok", '"fine"')]


# -- nothing is sent after complete-by (AGT4) -------------------------------------------------------------


@pytest.mark.parametrize("after_cancel", ["returns", "raises-permanent"])
def test_an_operation_that_swallows_the_cancel_at_complete_by_sends_nothing(
    rt_store: Store, dispatch_requests: Dispatch, after_cancel: str
) -> None:
    dispatch_requests(rt_store, budget=0.3)
    agent = Agent("svc", breaker_threshold=100)
    cancelled: list[float] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(time.monotonic())
            if after_cancel == "returns":
                return "late anyway"
            raise Permanent("aborted by the cancel") from None
        return "never"

    run_requests(rt_store, agent)
    assert len(cancelled) == 1
    assert replies(rt_store) == []
    assert request_states(rt_store) == ["taken"]


class SlowReports(WrappedStore):
    """The store, with every health report taking ``delay`` seconds longer (a busy database)."""

    def __init__(self, store: Store, delay: float) -> None:
        super().__init__(store)
        self.delay = delay

    async def transact(self, fn: Any, *args: Any, **kw: Any) -> Any:
        if fn is sa.report:
            await asyncio.sleep(self.delay)
        return await self.store.transact(fn, *args, **kw)


def test_a_slow_health_report_does_not_hold_back_an_answer_given_in_time(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """A success after a failure is written to the store at once (it resets the counts), but the
    reply does not wait for it: answered in time, it is received in time."""
    dispatch_requests(rt_store, budget=0.9, tries=2)
    agent = Agent("svc", breaker_threshold=100)
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise Transient("busy")
        return "done"

    run_requests(SlowReports(rt_store, 0.5), agent)  # type: ignore[arg-type]
    [rep] = timed_replies(rt_store)
    assert (rep["outcome"], rep["result"]) == ("ok", '"done"')
    assert rep["received_at"] < rep["complete_by"]


class SlowPulls(WrappedStore):
    """The store, with each pull's answer coming back ``delay`` seconds after its commit."""

    def __init__(self, store: Store, delay: float) -> None:
        super().__init__(store)
        self.delay = delay

    async def transact(self, fn: Any, *args: Any, **kw: Any) -> Any:
        out = await self.store.transact(fn, *args, **kw)
        if fn is sa.pull:
            await asyncio.sleep(self.delay)
        return out


def test_the_deadline_counts_from_before_the_pull_was_sent(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """A slow round trip shortens the call's time (as a lease's trust, LEAD2): the call is
    cancelled by complete-by on the database's clock, not a round trip after it."""
    dispatch_requests(rt_store, budget=0.6)
    agent = Agent("svc", breaker_threshold=100)
    late: list[float] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            late.append(time.time() - req.complete_by)  # SQLite's clock is the host's wall clock
            raise
        return "never"

    run_requests(SlowPulls(rt_store, 0.3), agent)  # type: ignore[arg-type]
    assert len(late) == 1 and late[0] < 0.1, late


def test_a_request_taken_with_no_time_left_is_not_called_and_counts_no_failure(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(rt_store, budget=0.3)
    agent = Agent("svc", breaker_threshold=100)
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(1)
        await asyncio.sleep(10)
        return "never"

    run_requests(SlowPulls(rt_store, 0.35), agent)  # type: ignore[arg-type]
    assert calls == []
    assert replies(rt_store) == []  # the supervisor's, at complete-by
    assert failures_total(rt_store) == 0


# -- in-attempt retries never start without time to answer (AGT2) ---------------------------------------


def test_a_retry_with_too_little_time_left_is_not_started_and_the_attempt_replies_retry(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """The service takes 0.3 s to fail; after the back-off only 0.25 s would be left. The second
    try would hang to complete-by and end silent (a breaker failure, a wait for the supervisor):
    the attempt replies ``retry`` at once instead."""
    fixed = Backoff(initial=0.45, maximum=0.45, jitter=0.0)
    dispatch_requests(rt_store, budget=1.0, tries=3, backoff=fixed)
    agent = Agent("svc", breaker_threshold=100)
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(1)
        await asyncio.sleep(0.3)
        raise ConnectionResetError("reset")

    run_requests(rt_store, agent)
    assert calls == [1]
    [rep] = timed_replies(rt_store)
    assert rep["outcome"] == "retry" and rep["error"] == "transient: ConnectionResetError: reset"
    assert rep["received_at"] < rep["complete_by"]


def test_a_back_off_longer_than_the_time_left_is_not_slept_the_attempt_replies_retry_at_once(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """AGT2 ("never past complete-by"), found by mutation: without the check of the back-off
    against the time left, the attempt slept its 5 s back-off past a 1 s complete-by and ended
    silent, its step waiting for the supervisor instead of being retried now."""
    dispatch_requests(rt_store, budget=1.0, tries=3, backoff=Backoff(initial=5.0, maximum=5.0, jitter=0.0))
    agent = Agent("svc", breaker_threshold=100)
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(1)
        raise ConnectionResetError("reset")

    run_requests(rt_store, agent)
    assert calls == [1]
    [rep] = timed_replies(rt_store)
    assert rep["outcome"] == "retry" and rep["error"] == "transient: ConnectionResetError: reset"
    assert rep["received_at"] < rep["complete_by"] - 0.5, rep  # at once, not after a sleep


# -- results and failures the store must be able to keep (AGT5) ------------------------------------------


def test_a_result_that_is_not_json_is_the_steps_error_not_its_text(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(rt_store)
    agent = Agent("svc")

    @agent.operation
    async def do_s(req: Request) -> Any:
        return {"ids": {1, 2}}

    run_requests(rt_store, agent)
    [rep] = replies(rt_store)
    assert rep["outcome"] == "error" and rep["result"] is None
    assert rep["error"] == (
        "the operation's result cannot be stored: not JSON (Object of type set is not JSON serializable)"
    )


def test_a_result_over_the_limit_is_the_steps_error(rt_store: Store, dispatch_requests: Dispatch) -> None:
    """Default 1 MiB, as the input limit (SUB4); ``AgentSettings.max_result_bytes`` sets it."""
    dispatch_requests(rt_store, n=2)
    agent = Agent("svc")

    @agent.operation
    async def do_s(req: Request) -> str:
        return "x" * (2 * 1024 * 1024 if req.input["n"] == 0 else 2000)

    run_requests(rt_store, agent, pulled=2)
    rows = replies(rt_store)
    assert [r["outcome"] for r in rows] == ["error", "ok"]
    assert "over the limit of 1048576 bytes" in rows[0]["error"]
    dispatch_requests(rt_store, n=1)
    run_requests(rt_store, agent, settings=AgentSettings(max_result_bytes=1000))
    assert replies(rt_store)[-1]["error"].endswith("bytes of JSON, over the limit of 1000 bytes")


class Custom(BaseException):
    """A BaseException of the author's own."""


@pytest.mark.parametrize("plain", [False, True], ids=["async", "plain"])
@pytest.mark.parametrize(
    ("raised", "error"),
    [
        (SystemExit(3), "SystemExit: 3"),
        (Custom("odd"), "Custom: odd"),
        (asyncio.CancelledError("by itself"), "CancelledError: by itself"),
        # Raised by an async operation on the main thread, it ended the worker (exit 130), then
        # each worker that ran the step after it (found by review).
        (KeyboardInterrupt("by itself"), "KeyboardInterrupt: by itself"),
    ],
    ids=["system-exit", "custom", "own-cancel", "keyboard-interrupt"],
)
def test_a_base_exception_from_an_operation_is_a_permanent_error_reply(
    rt_store: Store, dispatch_requests: Dispatch, plain: bool, raised: BaseException, error: str
) -> None:
    """Not the end of the worker, nor a request silent until complete-by: an error reply, and
    the call counted as the service's answer."""
    dispatch_requests(rt_store, tries=3)
    agent = Agent("svc")
    calls: list[int] = []

    def fail(req: Request) -> None:
        calls.append(1)
        raise raised

    async def fail_async(req: Request) -> None:
        fail(req)

    agent.operation(fail if plain else fail_async, name="do_s")
    role = run_requests(rt_store, agent)
    assert calls == [1]
    assert [(r["outcome"], r["error"]) for r in replies(rt_store)] == [("error", error)]
    assert role.health.instances["svc"].last_ok is not None  # reported: the service answered


# -- the author's classification (AGT5) ---------------------------------------------------------------------


def test_an_author_can_class_a_timeout_error_permanent(rt_store: Store, dispatch_requests: Dispatch) -> None:
    dispatch_requests(rt_store, tries=4)

    def classify(exc: BaseException) -> str:
        return "permanent" if isinstance(exc, TimeoutError) else "transient"

    agent = Agent("svc", classify=classify)
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        calls.append(1)
        raise TimeoutError("the upstream said: too slow, do not retry")

    run_requests(rt_store, agent)
    assert calls == [1]
    assert [(r["outcome"], r["error"]) for r in replies(rt_store)] == [
        ("error", "TimeoutError: the upstream said: too slow, do not retry")
    ]


def broken_classify(exc: BaseException) -> str:
    raise KeyError("status")


@pytest.mark.parametrize(
    ("classify", "says"),
    [
        (broken_classify, "classify raised KeyError: 'status'"),
        (lambda exc: "retry-later", "classify returned 'retry-later', not 'transient' or 'permanent'"),
    ],
    ids=["raises", "bad-value"],
)
def test_a_classify_that_fails_makes_the_failure_permanent_at_once(
    rt_store: Store, dispatch_requests: Dispatch, classify: Callable[[BaseException], str], says: str
) -> None:
    dispatch_requests(rt_store, tries=4)
    agent = Agent("svc", classify=classify)

    @agent.operation
    async def do_s(req: Request) -> None:
        raise ValueError("boom")

    run_requests(rt_store, agent)
    assert [(r["outcome"], r["error"]) for r in replies(rt_store)] == [
        ("error", f"{says} (judging ValueError: boom)")
    ]


class RefusesPoison(WrappedStore):
    """The store, refusing every reply transaction that holds a reply whose error says "poison"
    (as PostgreSQL refused text it could not store, on every try)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.sent: list[int] = []

    async def send_replies(self, me: str, items: Any, apply: bool = True) -> Any:
        self.sent.append(len(items))
        if any("poison" in (error or "") for *_, error in items):
            raise ValueError("the database refuses this text")
        return await self.store.send_replies(me, items, apply=apply)


def test_a_reply_the_store_refuses_does_not_drop_the_others_of_its_batch(
    rt_store: Store, dispatch_requests: Dispatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    dispatch_requests(rt_store, n=3)
    agent = Agent("svc", concurrency=3)

    @agent.operation
    async def do_s(req: Request) -> str:
        if req.input["n"] == 1:
            raise Permanent("poison")
        return "fine"

    spy = RefusesPoison(rt_store)
    # fewer tries: the refused reply is given up sooner (a try waits SEND_BACKOFF first: 0.1 s doubling)
    monkeypatch.setattr("stepwarden.agent_role.SEND_TRIES", 3)
    run_requests(spy, agent, pulled=3, timeout=10.0, settings=AgentSettings(reply_linger=1.0))  # type: ignore[arg-type]
    assert spy.sent[0] == 3  # one batch first
    assert [(r["outcome"], r["result"]) for r in replies(rt_store)] == [("ok", '"fine"'), ("ok", '"fine"')]
    assert request_states(rt_store) == ["replied", "taken", "replied"]


class FailsOnce(WrappedStore):
    """The store, losing the connection in the first reply transaction (before it commits)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.sent: list[int] = []

    async def send_replies(self, me: str, items: Any, apply: bool = True) -> Any:
        self.sent.append(len(items))
        if len(self.sent) == 1:
            raise ConnectionError("connection lost")
        return await self.store.send_replies(me, items, apply=apply)


def test_a_reply_batch_that_fails_once_is_sent_whole_again(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """One lost connection costs one more transaction, not one per reply of the batch."""
    dispatch_requests(rt_store, n=20)
    agent = Agent("svc", concurrency=20)

    @agent.operation
    async def do_s(req: Request) -> str:
        return "fine"

    spy = FailsOnce(rt_store)
    run_requests(spy, agent, pulled=20, timeout=10.0, settings=AgentSettings(reply_linger=1.0))  # type: ignore[arg-type]
    assert spy.sent == [20, 20]
    assert request_states(rt_store) == ["replied"] * 20


class RefusesPoisonApplied(WrappedStore):
    """As RefusesPoison, for a worker that applies its replies (``send_replies_and_take``)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.sent: list[int] = []

    async def send_replies_and_take(self, me: str, items: Any, take: Any, apply: bool = True) -> Any:
        self.sent.append(len(items))
        if any("poison" in (error or "") for *_, error in items):
            raise ValueError("the database refuses this text")
        return await self.store.send_replies_and_take(me, items, take, apply)


def test_a_batch_refused_twice_is_split_in_halves_down_to_the_reply_refused(
    rt_store: Store, dispatch_requests: Dispatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sent whole twice, then in halves, a failing half split again: the one reply the
    database refuses is singled out in about 2 log2(N) transactions, not N, and the others are
    applied."""
    ids = dispatch_requests(rt_store, n=16)
    agent = Agent("svc", concurrency=16)

    @agent.operation
    async def do_s(req: Request) -> str:
        if req.input["n"] == 5:
            raise Permanent("poison")
        return "fine"

    spy = RefusesPoisonApplied(rt_store)
    monkeypatch.setattr("stepwarden.agent_role.SEND_TRIES", 3)
    settings = AgentSettings(reply_linger=1.0, apply_replies=True)
    run_requests(spy, agent, pulled=16, timeout=10.0, settings=settings)  # type: ignore[arg-type]
    # two whole tries, both halves of each level (8, 4, 2, 1), then the refused one's last try
    assert spy.sent[:2] == [16, 16] and sorted(spy.sent[2:]) == [1, 1, 1, 2, 2, 4, 4, 8, 8], spy.sent
    assert request_states(rt_store) == ["replied"] * 5 + ["taken"] + ["replied"] * 10
    tasks = rt_store.transact_sync(lambda tx: tx.sql("SELECT id, state FROM tasks ORDER BY id"))
    assert [(r["id"], r["state"]) for r in tasks] == [
        (i, "processing" if n == 5 else "processed") for n, i in enumerate(ids)
    ]
