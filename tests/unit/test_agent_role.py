"""The agent role against the real store: in-attempt retries, classification, deadlines, threads,
circuit breaking and capacity (AGT1-AGT7).

Agent deadlines are real time (``asyncio.timeout``), so these tests use a store on the system
clock and short budgets; the breaker's cool-off test drives the role's clock by hand instead.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import pytest

from stepwarden.agent import Agent, AgentRole, AgentSettings, Request, default_classify
from stepwarden.agent_health import AgentHealth
from stepwarden.clock import SYSTEM_CLOCK, FakeClock
from stepwarden.errors import Permanent, Transient
from stepwarden.policies import Backoff
from stepwarden.stop_writes import StopWrites
from stepwarden.store import Store
from stepwarden.store import agents as sa
from stepwarden.store import transitions as t
from stepwarden.workflow import Workflow

ME = "agent-1:1:abc"
Factory = Callable[..., Workflow]
Dispatch = Callable[..., list[int]]  # the dispatch_requests fixture (tests/conftest.py)


def replies(store: Store) -> list[dict[str, Any]]:
    return store.transact_sync(
        lambda tx: tx.sql("SELECT task_id, attempt, outcome, result, error, sent_by FROM replies ORDER BY id")
    )


def request_states(store: Store) -> list[str]:
    return [
        r["state"] for r in store.transact_sync(lambda tx: tx.sql("SELECT state FROM requests ORDER BY id"))
    ]


def kinds(store: Store) -> list[str]:
    return [e["kind"] for e in store.transact_sync(lambda tx: tx.sql("SELECT kind FROM events ORDER BY id"))]


def make_role(store: Store, agent: Agent, **kw: Any) -> AgentRole:
    return AgentRole(store, {agent.name: agent}, ME, **kw)


async def finish(role: AgentRole, timeout: float = 2.0) -> None:
    """Wait for every request the role took to be done (replied, or given up silently)."""
    if role.tasks:
        done, pending = await asyncio.wait(set(role.tasks), timeout=timeout)
        assert not pending, "requests still running"
        for d in done:
            d.result()


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


async def until(pred: Callable[[], bool], timeout: float = 2.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not met in time"
        await asyncio.sleep(0.001)


# -- classification (AGT5) ----------------------------------------------------------------------------


def _http_error(code: int) -> httpx.HTTPStatusError:
    req = httpx.Request("POST", "http://svc/charge")
    return httpx.HTTPStatusError("x", request=req, response=httpx.Response(code, request=req))


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (Permanent("declined"), "permanent"),
        (Transient("busy"), "transient"),
        (TimeoutError(), "transient"),
        (ConnectionResetError(), "transient"),
        (httpx.ConnectError("refused"), "transient"),
        (_http_error(503), "transient"),
        (_http_error(429), "transient"),
        (_http_error(402), "permanent"),
        (_http_error(404), "permanent"),
        (ValueError("a bug"), "permanent"),
    ],
)
def test_default_classification(exc: BaseException, kind: str) -> None:
    assert default_classify(exc) == kind


# -- one attempt ---------------------------------------------------------------------------------------


def test_transient_failures_are_retried_in_the_attempt_then_one_ok_reply(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    [task_id] = dispatch_requests(rt_store, tries=4)
    agent = Agent("svc")
    seen: list[Request] = []

    @agent.operation
    async def do_s(req: Request) -> dict[str, int]:
        seen.append(req)
        if len(seen) < 3:
            raise Transient("503 from upstream")
        return {"charged": len(seen)}

    async def body() -> None:
        role = make_role(rt_store, agent)
        assert await role.pull() == 1
        await finish(role)

    run(body())
    assert len(seen) == 3
    assert {(r.task_id, r.attempt, r.kind, r.idempotency_key) for r in seen} == {
        (task_id, 1, "do", f"{task_id}:s")
    }
    assert seen[0].input == {"n": 0} and seen[0].payload == {"input": {"n": 0}, "results": {}}
    [rep] = replies(rt_store)
    assert (rep["task_id"], rep["attempt"], rep["outcome"], rep["result"], rep["sent_by"]) == (
        task_id,
        1,
        "ok",
        '{"charged":3}',
        ME,
    )
    assert request_states(rt_store) == ["replied"]
    # and the scheduler accepts it
    rt_store.transact_sync(t.apply_replies, "sched", 10, random.Random(0))
    assert rt_store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks"))[0]["state"] == "processed"


def test_transient_tries_used_up_send_a_retry_reply(rt_store: Store, dispatch_requests: Dispatch) -> None:
    dispatch_requests(rt_store, tries=3)
    agent = Agent("svc", breaker_threshold=100)
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        calls.append(1)
        raise ConnectionError(f"reset #{len(calls)}")

    async def body() -> None:
        role = make_role(rt_store, agent)
        await role.pull()
        await finish(role)

    run(body())
    assert len(calls) == 3
    [rep] = replies(rt_store)
    assert (rep["outcome"], rep["result"]) == ("retry", None)
    assert rep["error"] == "transient: ConnectionError: reset #3"


def test_permanent_failure_sends_an_error_reply_at_once(rt_store: Store, dispatch_requests: Dispatch) -> None:
    dispatch_requests(rt_store, tries=5)
    agent = Agent("svc")
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        calls.append(1)
        raise Permanent("card declined")

    async def body() -> None:
        role = make_role(rt_store, agent)
        await role.pull()
        await finish(role)

    run(body())
    assert calls == [1]
    [rep] = replies(rt_store)
    assert (rep["outcome"], rep["error"]) == ("error", "card declined")


def test_a_request_for_an_operation_this_worker_lacks_is_left_to_a_worker_that_has_it(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """A rolling deploy: an old worker's agent lacks the new operation. Its pulls and the takes
    of its reservations leave such requests queued; one taken anyway (by a worker of an older
    version, whose takes did not look at operations) is handed back uncounted, without a word to
    the agent's health or breaker. A worker that has the operation runs it."""
    [task_id] = dispatch_requests(rt_store, tries=4)
    old = Agent("svc")

    @old.operation
    async def other(req: Request) -> None: ...

    new = Agent("svc")

    @new.operation
    async def do_s(req: Request) -> str:
        return "done"

    async def body() -> None:
        role = make_role(rt_store, old)
        assert await role.pull() == 0
        [msg] = await rt_store.claim_requests(ME, ["svc"], 1)  # as an older worker's take would
        role.accept([msg], {})
        await finish(role)
        [rep] = replies(rt_store)
        assert rep["outcome"] == "released" and f"no operation 'do_s' in worker {ME}" in rep["error"]
        rt_store.transact_sync(t.apply_replies, "sched", 10, random.Random(0))
        assert rt_store.transact_sync(t.claim_and_dispatch, "sched", 10) == 1
        assert await role.pull() == 0
        newer = AgentRole(rt_store, {"svc": new}, "agent-2:2:def")
        assert await newer.pull() == 1
        await finish(newer)

    run(body())
    assert [(r["attempt"], r["outcome"]) for r in replies(rt_store)] == [(1, "released"), (2, "ok")]
    failures = rt_store.transact_sync(lambda tx: tx.sql("SELECT failures_total FROM agent_instances"))
    assert [r["failures_total"] for r in failures] == [0, 0]
    rt_store.transact_sync(t.apply_replies, "sched", 10, random.Random(0))
    tasks = rt_store.transact_sync(lambda tx: tx.sql("SELECT id, state, failure_count FROM tasks"))
    assert [(r["id"], r["state"], r["failure_count"]) for r in tasks] == [(task_id, "processed", 0)]


def test_the_take_of_a_reservation_leaves_the_operations_this_worker_lacks(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """A reply batch or a scheduler round takes requests for the worker's own slots, as a pull
    does: only for the operations it has. A take of any of the agent's requests gave an old
    worker the new operation's requests, to hand back, again and again."""
    dispatch_requests(rt_store, 2)  # svc.do_s
    old = Agent("svc", concurrency=4)

    @old.operation
    async def other(req: Request) -> None: ...

    new = Agent("svc", concurrency=4)

    @new.operation
    async def do_s(req: Request) -> None: ...

    async def body() -> None:
        for agent, expected in ((old, 0), (new, 2)):
            role = make_role(rt_store, agent)
            await role._register()
            reserved = role.reserve()
            assert reserved["svc"].room == 4
            _, taken = await rt_store.send_replies_and_take(ME, [], reserved, apply=False)
            role.accept([], reserved)
            assert len(taken) == expected, agent.operations
        assert request_states(rt_store) == ["taken", "taken"]

    run(body())


# -- complete-by (AGT4) ------------------------------------------------------------------------------


def test_an_async_handler_running_at_complete_by_is_cancelled_and_sends_nothing(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(rt_store, budget=0.3, tries=4)
    agent = Agent("svc")
    marks: dict[str, float] = {}

    async def body() -> None:
        cancelled = asyncio.Event()

        @agent.operation
        async def do_s(req: Request) -> str:
            marks["start"] = time.monotonic()
            marks["deadline"] = req.deadline
            try:
                await asyncio.Event().wait()  # the remote service hangs
            except asyncio.CancelledError:
                marks["cancelled"] = time.monotonic()
                cancelled.set()
                raise
            return "never"

        role = make_role(rt_store, agent)
        assert await role.pull() == 1
        await asyncio.wait_for(cancelled.wait(), timeout=2.0)
        await finish(role)
        assert role.inflight["svc"] == 0

    run(body())
    assert marks["cancelled"] >= marks["deadline"] - 0.01  # at complete-by, not before
    assert marks["cancelled"] - marks["start"] == pytest.approx(0.3, abs=0.15)
    assert replies(rt_store) == []  # no result, no error: the supervisor decides
    assert request_states(rt_store) == ["taken"]


def test_a_plain_function_past_complete_by_has_its_late_result_discarded(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(rt_store, budget=0.3, tries=4)
    agent = Agent("svc")
    release, returned = threading.Event(), threading.Event()

    @agent.operation
    def do_s(req: Request) -> str:
        release.wait(5)
        returned.set()
        return "late"

    async def body() -> None:
        role = make_role(rt_store, agent)
        await role.pull()
        await finish(role)  # the role gives up at complete-by while the thread runs on
        assert not returned.is_set()
        release.set()
        assert await asyncio.to_thread(returned.wait, 2)
        await asyncio.sleep(0)

    run(body())
    assert replies(rt_store) == []


def test_plain_function_handlers_run_in_threads(rt_store: Store, dispatch_requests: Dispatch) -> None:
    dispatch_requests(rt_store, n=2, tries=4)
    agent = Agent("svc")
    both = threading.Barrier(2, timeout=2)  # passes only if the two calls run at the same time
    threads: list[str] = []

    @agent.operation
    def do_s(req: Request) -> int:
        threads.append(threading.current_thread().name)
        both.wait()
        return req.input["n"] * 10  # type: ignore[no-any-return]

    async def body() -> None:
        role = make_role(rt_store, agent)
        assert await role.pull() == 2
        await finish(role, timeout=3)

    run(body())
    assert len(threads) == 2 and all(n.startswith("stepwarden-agent") for n in threads)
    assert threading.main_thread().name not in threads
    assert sorted((r["outcome"], r["result"]) for r in replies(rt_store)) == [("ok", "0"), ("ok", "10")]


# -- circuit breaker and capacity (AGT3, AGT6) -----------------------------------------------------


def test_the_breaker_opens_after_repeated_failures_and_the_role_stops_pulling(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(rt_store, tries=5)
    agent = Agent("svc", breaker_threshold=2, breaker_cool_off=60.0)
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(1)
        if len(calls) <= 2:
            raise Transient("down")
        return "up"

    async def body() -> None:
        role = make_role(rt_store, agent)
        await role.pull()
        await finish(role)
        # two failures opened the breaker: the remaining three tries failed fast, without calls
        assert len(calls) == 2
        assert role.breakers["svc"].state == "open"
        [rep] = replies(rt_store)
        assert rep["outcome"] == "retry" and "circuit breaker" in rep["error"]
        # operators can see it
        await until(lambda: "breaker_opened" in kinds(rt_store), timeout=2.0)
        # the breaker is shared through the store: no instance of the agent pulls its requests
        dispatch_requests(rt_store, n=2, tries=4)
        assert await role.pull() == 0
        other = AgentRole(rt_store, {"svc": agent}, "agent-2:2:def")
        assert await other.pull() == 0
        assert other.breakers["svc"].state == "open"
        assert request_states(rt_store) == ["replied", "queued", "queued"]

    run(body())
    assert [r["outcome"] for r in replies(rt_store)] == ["retry"]


def test_attempts_refused_by_an_open_breaker_end_at_once_so_the_instance_can_take_the_trial(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """An attempt whose tries the open breaker refuses, on an instance with every slot taken,
    ends now, as a retry. It used to go on with its tries (100 here, 10 s apart on the fake
    clock), each refused, holding its slot: with every slot so held the instance never pulled,
    never took the half-open trial, and the breaker stayed open until the attempts ran out of
    time (19 s of a 1 s cool-off, measured). With a slot free, the attempt goes on (see
    test_breaker_trial_outcome: it calls again once the trial closes the breaker)."""
    backoff = Backoff(initial=10.0, maximum=10.0, jitter=0)
    dispatch_requests(store, n=2, tries=100, budget=600.0, backoff=backoff)
    agent = Agent("svc", concurrency=1, breaker_threshold=1, breaker_cool_off=1.0)
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(req.task_id)
        if len(calls) == 1:
            raise ConnectionError("refused")
        return "up"

    async def body() -> None:
        role = make_role(store, agent, clock=clock)
        assert await role.pull() == 1  # the one slot; its call fails and opens the breaker
        await finish(role)  # no 10 s sleep on the fake clock before a refused try: it replied
        assert str(role.breakers["svc"].state) == "open"
        [rep] = replies(store)
        assert rep["outcome"] == "retry" and "circuit breaker" in rep["error"], rep
        assert "ConnectionError: refused" in rep["error"], rep
        clock.advance(1.0)
        assert await role.pull() == 1  # the slots are free: the trial is taken after the cool-off
        await finish(role)
        assert role.breakers["svc"].state == "closed"

    run(body())
    assert len(calls) == 2


def test_a_held_attempt_goes_on_when_the_last_slot_runs_this_instances_own_trial(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """Found by review of the rule above: with one slot free, an attempt refused by the open
    breaker goes on; this instance then takes the trial into that slot, so every slot is taken.
    Ending the attempt then frees nothing the trial needs (it runs already) and cost its step a
    failure; it goes on, and calls again once the trial closes the breaker."""
    backoff = Backoff(initial=10.0, maximum=10.0, jitter=0)
    agent = Agent("svc", concurrency=2, breaker_threshold=1, breaker_cool_off=1.0)
    calls: list[int] = []
    slow = asyncio.Event()

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(req.task_id)
        if len(calls) == 1:
            raise ConnectionError("refused")  # opens the breaker (threshold 1)
        if len(calls) == 2:
            await slow.wait()  # the trial call, slow
        return "up"

    async def body() -> None:
        dispatch_requests(store, n=1, tries=100, budget=600.0, backoff=backoff)
        role = make_role(store, agent, clock=clock)
        assert await role.pull() == 1
        await until(lambda: role.breakers["svc"].state == "open")
        dispatch_requests(store, n=1, tries=100, budget=600.0, backoff=backoff)
        clock.advance(1.0)
        assert await role.pull() == 1  # the trial, into the free slot: both slots taken
        await until(lambda: len(calls) == 2)
        clock.advance(10.0)  # the held attempt's back-off ends while the trial call runs
        await until(lambda: role.breakers["svc"].state == "half_open" or len(replies(store)) > 0)
        for _ in range(20):  # let the held attempt run its refused try, if it is to end
            await asyncio.sleep(0.005)
        assert replies(store) == [], "the held attempt ended while its instance's own trial ran"
        slow.set()  # the trial succeeds: the breaker closes
        await until(lambda: len(replies(store)) == 1)
        # The held attempt's next try calls, and succeeds: the fake clock moved on until it has
        # (its back-off may have begun before or after the last advance, as the loop ran it).
        deadline = time.monotonic() + 10
        while len(replies(store)) < 2:
            assert time.monotonic() < deadline, replies(store)
            clock.advance(10.0)
            await asyncio.sleep(0.02)
        await finish(role)

    run(body())
    assert [r["outcome"] for r in replies(store)] == ["ok", "ok"]
    assert calls == [1, 2, 1]


def down_once(slow: asyncio.Event | None = None, cool_off: float = 10.0) -> tuple[Agent, list[int]]:
    """Agent ``svc`` (breaker after 1 failure, 10 s cool-off by default) whose service is down for
    its first call and up after (each later call answering once ``slow`` is set, if given); the
    list counts the calls."""
    agent = Agent("svc", breaker_threshold=1, breaker_cool_off=cool_off)
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise Transient("down")
        if slow is not None:
            await slow.wait()
        return "up"

    return agent, calls


async def open_breaker(role: AgentRole) -> None:
    """The first request fails its one try, which opens the breaker."""
    await role.pull()
    await finish(role)
    assert role.breakers["svc"].state == "open"


def test_after_the_cool_off_a_trial_request_reaches_the_service_and_closes_the_breaker(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(store, tries=1, budget=60.0)
    agent, calls = down_once()

    async def body() -> None:
        role = make_role(store, agent, clock=clock)
        await open_breaker(role)
        dispatch_requests(store, tries=1, budget=60.0)
        assert await role.pull() == 0
        clock.advance(10.0)
        assert await role.pull() == 1  # the half-open trial
        await finish(role)
        assert len(calls) == 2, "the trial request must reach the service"
        assert role.breakers["svc"].state == "closed"

    run(body())
    assert [r["outcome"] for r in replies(store)] == ["retry", "ok"]


def test_after_the_cool_off_only_one_trial_request_is_taken(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(store, tries=1, budget=60.0)

    async def body() -> None:
        gate = asyncio.Event()
        agent, calls = down_once(slow=gate)  # the trial call is slow
        role = make_role(store, agent, clock=clock)
        await role.pull()
        await finish(role)
        dispatch_requests(store, n=3, tries=1, budget=60.0)
        clock.advance(10.0)
        taken = [await role.pull(), await role.pull()]  # what run() does after a successful pull
        await until(lambda: len(calls) == 2)
        gate.set()
        await finish(role)
        assert taken == [1, 0], "a half-open breaker lets a single trial request through"

    run(body())
    assert [r["outcome"] for r in replies(store)] == ["retry", "ok"]
    assert request_states(store).count("queued") == 2


def test_an_unhealthy_instance_left_alone_with_the_service_down_counts_its_failures_and_escalates(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """This instance fails while another succeeds (unhealthy); then the other leaves and the
    service is down. Each probe used to be handed back uncounted ("unhealthy"), re-dispatched
    with a fresh complete-by, probed again: 22 attempts in 6 s, FailureCount 1, the task stuck in
    processing for as long as the service stayed down. Now the probe's failure is the service's:
    replied as a retry, counted, and the task escalates at max_failures."""
    other = "agent-2:2:def"
    agent = Agent("svc", breaker_threshold=100, breaker_cool_off=1.0)
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(req.attempt)
        raise ConnectionError("no route to the service")

    async def body() -> None:
        role = make_role(store, agent, clock=clock, settings=AgentSettings(unhealthy_after=1))
        store.transact_sync(sa.register, other, [sa.InstanceSpec("svc", 4, 100, 1.0)])
        dispatch_requests(store, tries=1, budget=600.0)
        clock.advance(0.1)
        rules = sa.HealthRules(unhealthy_after=1, probe_after=1.0)
        store.transact_sync(sa.report, other, sa.Report("svc", True), 100, 1.0, rules)  # the other succeeds
        assert await role.pull() == 1
        await finish(role)
        assert not role.health.healthy("svc")
        assert [r["outcome"] for r in replies(store)] == ["released"]  # handed back: its own fault
        store.transact_sync(sa.stop, other)  # the other leaves; the service is down for all
        rng = random.Random(0)
        for _ in range(3):
            store.transact_sync(t.apply_replies, "sched", 10, rng)
            clock.advance(60.0)  # past the step's back-off and the probe's cool-off
            store.transact_sync(t.claim_and_dispatch, "sched", 10)
            assert await role.pull() == 1
            await finish(role)
        store.transact_sync(t.apply_replies, "sched", 10, rng)

    run(body())
    assert [r["outcome"] for r in replies(store)] == ["released", "retry", "retry", "retry"]
    assert "instance_healthy" in kinds(store)
    [step] = store.transact_sync(lambda tx: tx.sql("SELECT failure_count, state FROM steps"))
    assert step["failure_count"] == 3 and step["state"] == "failed", step


def test_an_unhealthy_instance_left_alone_probes_with_the_trial_and_closes_the_breaker(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """This instance fails on its own path while another succeeds (unhealthy), then the service
    fails the other too (the breaker opens) and the other leaves. Its probe, once due, is the
    trial: before, an unhealthy instance never asked for the trial and an open breaker gave its
    probe nothing, so with no healthy instance left no call ever reached the service again and
    the agent's requests waited until they expired."""
    other = "agent-2:2:def"
    agent, calls = down_once()  # its first call fails on this instance's own path

    async def body() -> None:
        role = make_role(store, agent, clock=clock, settings=AgentSettings(unhealthy_after=1))
        store.transact_sync(sa.register, other, [sa.InstanceSpec("svc", 4, 1, 10.0)])
        rules = sa.HealthRules(unhealthy_after=1, probe_after=10.0)
        store.transact_sync(sa.report, other, sa.Report("svc", True), 1, 10.0, rules)  # the other succeeds
        dispatch_requests(store, tries=1, budget=600.0)
        assert await role.pull() == 1
        await finish(role)
        assert not role.health.healthy("svc") and role.breakers["svc"].state == "closed"
        opened = store.transact_sync(sa.report, other, sa.Report("svc", False, "down"), 1, 10.0, rules)
        assert opened.opened  # the service fails the other too
        store.transact_sync(sa.stop, other)  # ... and the other leaves
        dispatch_requests(store, n=2, tries=1, budget=600.0)
        assert await role.pull() == 0  # probing not due yet, and the breaker is open
        clock.advance(10.0)
        assert await role.pull() == 1  # the probe, as the trial
        await finish(role)
        assert len(calls) == 2
        assert role.breakers["svc"].state == "closed" and role.health.healthy("svc")
        assert await role.pull() == 1  # the rest flows again
        await finish(role)

    run(body())
    assert "breaker_closed" in kinds(store) and "instance_healthy" in kinds(store)


def test_an_unhealthy_instance_takes_the_trial_a_live_healthy_one_leaves_untaken_for_a_cool_off(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """The other instance stays live and healthy (it beats) but never takes the trial: its slots
    held by calls that never end, say, or its version lacking the operation. The trial was the
    healthy instance's alone, so the breaker stayed open for as long as that lasted. Now, once
    the trial has been due for a cool-off with nobody taking it, this instance's probe takes it."""
    other = "agent-2:2:def"
    agent, calls = down_once()

    async def body() -> None:
        role = make_role(store, agent, clock=clock, settings=AgentSettings(unhealthy_after=1))
        store.transact_sync(sa.register, other, [sa.InstanceSpec("svc", 4, 1, 10.0)])
        rules = sa.HealthRules(unhealthy_after=1, probe_after=10.0)
        store.transact_sync(sa.report, other, sa.Report("svc", True), 1, 10.0, rules)
        dispatch_requests(store, tries=1, budget=600.0)
        assert await role.pull() == 1
        await finish(role)
        assert not role.health.healthy("svc")
        opened = store.transact_sync(sa.report, other, sa.Report("svc", False, "down"), 1, 10.0, rules)
        assert opened.opened
        dispatch_requests(store, n=2, tries=1, budget=600.0)
        taken = []
        for _ in range(4):  # the trial falls due at 10 s; the healthy instance leaves it untaken
            clock.advance(5.0)
            store.transact_sync(sa.beat, other, {"svc": (4, 4)})  # live, its slots all held
            taken.append(await role.pull())
        assert taken == [0, 0, 0, 1], "the probe takes the trial a cool-off after it fell due"
        await finish(role)
        assert len(calls) == 2
        assert role.breakers["svc"].state == "closed" and role.health.healthy("svc")

    run(body())
    assert "breaker_closed" in kinds(store)


@pytest.mark.parametrize("cool_off", [10.0, 100.0])
def test_a_trial_call_slower_than_trial_ttl_keeps_its_claim_and_closes_the_breaker(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch, cool_off: float
) -> None:
    """The trial's claim lasts trial_ttl; a trial call slower than that (within complete-by) lost
    it, another instance took a second trial beside it, and the first call's success closed
    nothing: a slow service that answered every trial kept its breaker open. The holder now
    renews its claim while the call runs: every third of trial_ttl, by trial_ttl, whatever the
    cool-off (one longer than trial_ttl once set both, and the claim lapsed first)."""
    dispatch_requests(store, tries=1, budget=600.0)
    gate = asyncio.Event()
    agent, calls = down_once(slow=gate, cool_off=cool_off)  # the trial call takes minutes

    def renewed() -> bool:
        """The trial's claim runs trial_ttl (30 s) from now: renewed at this moment."""
        retry_in = float(store.transact_sync(sa.list_agents)["breakers"][0]["retry_in"])
        return 29.99 <= retry_in <= 30.0

    async def body() -> None:
        settings = AgentSettings(trial_ttl=30.0)
        role = make_role(store, agent, clock=clock, settings=settings)
        other = AgentRole(store, {"svc": agent}, "agent-2:2:def", clock=clock, settings=settings)
        await open_breaker(role)
        dispatch_requests(store, n=3, tries=1, budget=600.0)
        clock.advance(cool_off)
        assert await role.pull() == 1  # the trial
        await until(lambda: len(calls) == 2)
        holding = role.health._holding["svc"]
        for _ in range(9):  # 90 s: three times trial_ttl
            await until(lambda: any(t > clock.monotonic() for t, _ in clock._sleepers))  # it waits
            clock.advance(10.0)
            await until(renewed)
            assert await other.pull() == 0, "a second trial while the first call runs"
            assert not holding.done()
        gate.set()
        await finish(role)
        assert role.breakers["svc"].state == "closed"
        assert len(calls) == 2

    run(body())
    assert "breaker_closed" in kinds(store)


def test_capacity_limits_how_many_requests_an_instance_takes(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(rt_store, n=5, tries=4)
    agent = Agent("svc", concurrency=2)
    running: list[int] = []
    peak: list[int] = [0]

    async def body() -> None:
        gate = asyncio.Event()

        @agent.operation
        async def do_s(req: Request) -> int:
            running.append(1)
            peak[0] = max(peak[0], len(running))
            await gate.wait()
            running.pop()
            return 1

        role = make_role(rt_store, agent)
        assert await role.pull() == 2
        await until(lambda: len(running) == 2)
        assert await role.pull() == 0  # full
        assert sorted(request_states(rt_store)) == ["queued"] * 3 + ["taken"] * 2
        gate.set()
        await finish(role)
        assert await role.pull() == 2
        await finish(role)
        assert await role.pull() == 1
        await finish(role)

    run(body())
    assert peak[0] == 2
    assert len(replies(rt_store)) == 5


def test_the_role_loop_serves_requests_until_stopped(rt_store: Store, dispatch_requests: Dispatch) -> None:
    agent = Agent("svc", concurrency=4)

    @agent.operation
    async def do_s(req: Request) -> int:
        return int(req.input["n"])

    async def body() -> None:
        stop = asyncio.Event()
        role = make_role(rt_store, agent, settings=AgentSettings(poll_interval=0.01, idle_poll_max=0.02))
        loop_task = asyncio.create_task(role.run(stop))
        await asyncio.to_thread(dispatch_requests, rt_store, 6, tries=4)
        end = time.monotonic() + 3
        while len(replies(rt_store)) < 6:
            assert time.monotonic() < end, "the role did not serve all requests"
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(loop_task, 2)
        assert role.completed == 6

    run(body())
    assert sorted(r["result"] for r in replies(rt_store)) == [str(i) for i in range(6)]


class WrappedStore:
    """The store, with the methods a test defines in a subclass in place of its own."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class LostCommits(WrappedStore):
    """The store, except that the first ``fail`` calls of ``method`` (those ``when`` picks) are
    lost with the connection: before they commit or, with ``committed``, after (COMMIT's answer
    lost on its way back, which leaves the caller not knowing what was written)."""

    def __init__(
        self,
        store: Store,
        method: str,
        fail: int,
        *,
        committed: bool = False,
        when: Callable[..., bool] = lambda *args, **kw: True,
    ) -> None:
        super().__init__(store)
        self.method, self.fail, self.committed, self.when = method, fail, committed, when
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(self.store, name)
        if name != self.method:
            return real

        async def lossy(*args: Any, **kw: Any) -> Any:
            if not self.when(*args, **kw):
                return await real(*args, **kw)
            self.calls += 1
            if self.calls > self.fail:
                return await real(*args, **kw)
            if self.committed:
                await real(*args, **kw)
                raise ConnectionError("server closed the connection unexpectedly (during COMMIT)")
            raise ConnectionError("server closed the connection unexpectedly")

        return lossy


def test_a_reply_batch_refills_the_slots_it_frees_and_a_lost_one_gives_its_reservation_back(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """A worker that is also a scheduler: its reply transaction takes the next queued requests
    for the slots the replies free (no pull of its own). When that transaction is lost, the slots
    it reserved are given back, the batch is sent again, and nothing is taken twice or left behind."""
    ids = dispatch_requests(rt_store, 4, tries=4)
    agent = Agent("svc", concurrency=2)
    ran: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        ran.append(req.task_id)

    flaky = LostCommits(rt_store, "send_replies_and_take", fail=1)

    async def body() -> None:
        role = make_role(flaky, agent, settings=AgentSettings(apply_replies=True))  # type: ignore[arg-type]
        assert await role.pull() == 2  # capacity 2: two of the four
        await until(lambda: len(ran) == 4 and not role.tasks and not role._outbox, timeout=10)
        assert role.inflight == {"svc": 0}  # no reservation leaked by the lost batch
        assert flaky.calls >= 2

    run(body())
    assert sorted(ran) == ids  # each request ran once: the lost batch took nothing
    states = rt_store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks ORDER BY id"))
    assert [s["state"] for s in states] == ["processed"] * 4
    taken = rt_store.transact_sync(lambda tx: tx.sql("SELECT taken_by FROM requests ORDER BY id"))
    assert {r["taken_by"] for r in taken} == {ME}


class CountingTakes(WrappedStore):
    """The store, recording each reply batch: (replies sent, slots offered for the take, requests
    this worker holds once the batch has committed: taken and not yet replied to)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.batches: list[tuple[int, int, int]] = []

    async def send_replies_and_take(self, me: str, replies: Any, take: Any, apply: bool = True) -> Any:
        out = await self.store.send_replies_and_take(me, replies, take, apply)
        held = self.store.transact_sync(
            lambda tx: tx.sql(
                "SELECT count(*) AS n FROM requests WHERE state = 'taken' AND taken_by = ?", (me,)
            )
        )[0]["n"]
        self.batches.append((len(replies), sum(w.room for w in take.values()), int(held)))
        return out


def test_a_committed_reply_batch_frees_its_slots_before_the_calls_resume(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """Operations that return at once reply within the loop iteration that started them, so the
    next batch is formed before the previous batch's calls have run their last lines. Its slots
    were given back at its commit: the next batch refills all of them, from one pull to the last
    request, and the instance never holds more requests than its capacity (AGT6)."""
    ids = dispatch_requests(rt_store, 24, tries=4)
    agent = Agent("svc", concurrency=4)
    ran: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        ran.append(req.task_id)

    spy = CountingTakes(rt_store)

    async def body() -> None:
        role = make_role(spy, agent, settings=AgentSettings(apply_replies=True))  # type: ignore[arg-type]
        assert await role.pull() == 4  # the only pull: every later request comes with a reply batch
        await until(lambda: len(ran) == 24 and not role.tasks and not role._outbox, timeout=10)
        assert role.inflight == {"svc": 0}
        assert role._held == {}

    run(body())
    assert sorted(ran) == ids
    # every batch offers at least the slots its replies free, and holding never passes capacity
    assert all(take >= sent for sent, take, _ in spy.batches), spy.batches
    assert max(held for *_, held in spy.batches) <= 4
    states = rt_store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks ORDER BY id"))
    assert [s["state"] for s in states] == ["processed"] * len(ids)


def test_a_stopping_agent_takes_nothing_more_and_waits_for_what_it_started(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """Drain: the reply batches of the calls still running commit, but take no new requests, and
    when the role returns nothing of it runs and nothing stays taken by it."""
    dispatch_requests(rt_store, 12, tries=4)
    agent = Agent("svc", concurrency=2)
    started: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> None:
        started.append(req.task_id)
        await asyncio.sleep(0.2)  # still running when the stop reaches the role

    async def body() -> None:
        stop = asyncio.Event()
        role = make_role(rt_store, agent, settings=AgentSettings(apply_replies=True, poll_interval=0.01))
        loop_task = asyncio.create_task(role.run(stop))
        await until(lambda: len(started) == 2, timeout=10)
        stop.set()
        await asyncio.wait_for(loop_task, 5)
        assert not role.tasks
        assert role.inflight == {"svc": 0}

    run(body())
    assert len(started) == 2  # the two calls running at the stop, and no more
    assert sorted(request_states(rt_store)) == ["queued"] * 10 + ["replied"] * 2


def test_a_call_that_swallows_the_stop_does_not_reply_after_it_was_released(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """An operation that catches the cancellation of a stop and returns anyway: the call still
    ends as cancelled, so the attempt is released (handed back uncounted) and no ok reply follows."""
    dispatch_requests(rt_store, 1, tries=4)
    agent = Agent("svc", concurrency=1)
    entered = asyncio.Event()

    @agent.operation
    async def do_s(req: Request) -> str:
        entered.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "finished anyway"
        return "finished"

    async def body() -> None:
        stop = asyncio.Event()
        role = make_role(rt_store, agent, settings=AgentSettings(shutdown_grace=0.1, poll_interval=0.01))
        loop_task = asyncio.create_task(role.run(stop))
        await asyncio.wait_for(entered.wait(), 5)
        stop.set()
        await asyncio.wait_for(loop_task, 5)
        assert role.inflight == {"svc": 0}

    run(body())
    assert [r["outcome"] for r in replies(rt_store)] == ["released"]


def test_a_stop_while_a_replied_call_waits_for_its_health_report_hands_nothing_back(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    """A call whose ok reply committed, and whose end still waits for its health report (the
    store must count it: a success after failures), when the grace period ends: the stop cancels
    that wait, and must not release the attempt too; the release would be recorded as a stale
    reply (an interrupted demo made 113-159 of them)."""
    dispatch_requests(rt_store, 1, tries=4)
    agent = Agent("svc", concurrency=1)

    @agent.operation
    async def do_s(req: Request) -> str:
        return "done"

    async def body() -> None:
        stop = asyncio.Event()
        settings = AgentSettings(apply_replies=True, shutdown_grace=0.1, poll_interval=0.01)
        role = make_role(rt_store, agent, settings=settings)
        held = asyncio.Event()

        def slow_report(agent: str, ok: bool, error: str | None = None, trial: bool = False) -> Any:
            async def report() -> None:
                held.set()
                await asyncio.sleep(30)  # a store slow to count it

            return asyncio.create_task(report())

        role.health.report_soon = slow_report  # type: ignore[method-assign]
        loop_task = asyncio.create_task(role.run(stop))
        await asyncio.wait_for(held.wait(), 5)
        await until(lambda: role.completed == 1, timeout=5)  # the reply committed; the call's end waits
        assert role.tasks, "the call's end should still be waiting for its report"
        stop.set()
        await asyncio.wait_for(loop_task, 5)

    run(body())
    assert [r["outcome"] for r in replies(rt_store)] == ["ok"]
    assert request_states(rt_store) == ["replied"]


@pytest.mark.parametrize("when", ["during the drain", "before the drain"])
def test_hurry_skips_the_rest_of_the_grace_period_and_hands_the_calls_back(
    rt_store: Store, dispatch_requests: Dispatch, when: str
) -> None:
    """A second stop signal (``hurry``): with 30 s of grace left, the running call is cancelled
    and its attempt released at once, not counted as a failure; hurried before the drain began,
    the drain waits for nothing. A second hurry says it changed nothing."""
    dispatch_requests(rt_store, 1, tries=4)
    agent = Agent("svc", concurrency=1)
    entered = asyncio.Event()

    @agent.operation
    async def do_s(req: Request) -> None:
        entered.set()
        await asyncio.sleep(60)

    async def body() -> None:
        stop = asyncio.Event()
        settings = AgentSettings(shutdown_grace=30.0, poll_interval=0.01)
        role = make_role(rt_store, agent, settings=settings)
        loop_task = asyncio.create_task(role.run(stop))
        await asyncio.wait_for(entered.wait(), 5)
        if when == "before the drain":
            assert role.hurry()
        stop.set()
        if when == "during the drain":
            await until(lambda: role._stopping, timeout=5)
            assert role.hurry()
        started = time.monotonic()
        await asyncio.wait_for(loop_task, 5)
        assert time.monotonic() - started < 3.0, "the grace period was waited out"
        assert not role.hurry()
        assert role.inflight == {"svc": 0}

    run(body())
    assert [r["outcome"] for r in replies(rt_store)] == ["released"]
    failures = rt_store.transact_sync(lambda tx: tx.sql("SELECT failure_count FROM steps"))
    assert [r["failure_count"] for r in failures] == [0]


@pytest.mark.parametrize("plain", [False, True], ids=["async", "plain"])
def test_a_trial_call_cut_short_by_a_stop_counts_as_failed_not_unrun(
    rt_store: Store, dispatch_requests: Dispatch, plain: bool
) -> None:
    """A stop past the grace period cancels the running trial call. Its call began (a plain
    function's thread runs on), so the trial is counted failed and the breaker waits another
    cool-off; it was given back unrun, and another instance would have tried the service at once,
    beside the call still running."""
    dispatch_requests(rt_store, 2, tries=1, budget=60.0)
    agent = Agent("svc", concurrency=1, breaker_threshold=1, breaker_cool_off=0.2)
    calls: list[int] = []
    entered, release = threading.Event(), threading.Event()

    def slow_trial() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise Transient("down")
        entered.set()
        release.wait(10)

    async def slow_trial_async(req: Request) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise Transient("down")
        entered.set()
        await asyncio.sleep(60)

    if plain:
        agent.operation(lambda req: slow_trial(), name="do_s")
    else:
        agent.operation(slow_trial_async, name="do_s")

    async def body() -> None:
        stop = asyncio.Event()
        settings = AgentSettings(shutdown_grace=0.1, poll_interval=0.01)
        role = make_role(rt_store, agent, settings=settings)
        loop_task = asyncio.create_task(role.run(stop))
        try:
            await until(entered.is_set, timeout=10)  # the trial call, after the cool-off
            assert role.breakers["svc"].trial
            stop.set()
            await asyncio.wait_for(loop_task, 10)
        finally:
            release.set()
            stop.set()
            await asyncio.wait_for(loop_task, 10)

    run(body())
    assert len(calls) == 2
    seen = kinds(rt_store)
    assert "breaker_trial" in seen and "breaker_reopened" in seen
    assert "breaker_trial_returned" not in seen
    [b] = rt_store.transact_sync(sa.list_agents)["breakers"]
    assert b["state"] == "open" and b["trial_by"] is None


def test_bookkeeping_that_fails_after_a_commit_does_not_send_the_batch_again(
    rt_store: Store, dispatch_requests: Dispatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The replies are committed: an error in what follows (a metrics callback) is logged, the
    batch is not retried (it would be recorded again, as stale), and the calls are released."""
    dispatch_requests(rt_store, 2, tries=4)
    agent = Agent("svc", concurrency=2)

    @agent.operation
    async def do_s(req: Request) -> None:
        return None

    spy = CountingTakes(rt_store)

    def broken(applied: Any) -> None:
        raise RuntimeError("a metrics callback failed")

    async def body() -> None:
        role = make_role(spy, agent, settings=AgentSettings(apply_replies=True), on_applied=broken)  # type: ignore[arg-type]
        assert await role.pull() == 2
        await until(lambda: not role.tasks and not role._outbox, timeout=10)
        assert role.inflight == {"svc": 0}
        assert role.completed == 2

    run(body())
    assert sum(sent for sent, *_ in spy.batches) == 2  # each reply sent once
    assert sorted(r["outcome"] for r in replies(rt_store)) == ["ok", "ok"]
    assert "after a reply batch committed" in caplog.text


class SilentStore(WrappedStore):
    """The store, except that its reply transactions never answer (a partitioned database)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.release_tries = 0

    async def send_replies(self, *args: Any, **kw: Any) -> Any:
        self.release_tries += 1
        await asyncio.Event().wait()


def test_a_stop_with_the_database_not_answering_ends_within_its_bound(
    rt_store: Store,
    dispatch_requests: Dispatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DEP4 with the database gone quiet: the release of the unfinished attempt is tried once and
    given up after its bound, the role returns, and the attempt is left to expire at complete-by."""
    dispatch_requests(rt_store, 1, tries=4)
    agent = Agent("svc", concurrency=1)
    entered = asyncio.Event()

    @agent.operation
    async def do_s(req: Request) -> None:
        entered.set()
        await asyncio.sleep(30)

    silent = SilentStore(rt_store)

    async def body() -> None:
        stop = asyncio.Event()
        role = make_role(silent, agent, settings=AgentSettings(shutdown_grace=0.1, poll_interval=0.01))  # type: ignore[arg-type]
        role.stop_writes = StopWrites(full=0.2, brief=0.2)
        loop_task = asyncio.create_task(role.run(stop))
        await asyncio.wait_for(entered.wait(), 5)
        stop.set()
        began = time.monotonic()
        await asyncio.wait_for(loop_task, 10)
        assert time.monotonic() - began < 5  # grace 0.1 + cancel + release bound 0.2 + stop record 0.2
        assert role.inflight == {"svc": 0}

    run(body())
    assert silent.release_tries == 1
    assert "could not release them (they will expire)" in caplog.text
    assert request_states(rt_store) == ["taken"]


# -- health reports ---------------------------------------------------------------------------------


class SlowFailures(WrappedStore):
    """The store, writing a failed call's report only after a while; records the reports' order
    of commit (``ok`` of each)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.written: list[bool] = []

    async def transact(self, fn: Any, *args: Any, **kw: Any) -> Any:
        if fn is not sa.report:
            return await self.store.transact(fn, *args, **kw)
        report: sa.Report = args[1]
        if not report.ok:
            await asyncio.sleep(0.05)
        out = await self.store.transact(fn, *args, **kw)
        self.written.append(report.ok)
        return out


def test_a_plain_success_is_counted_without_a_task_and_written_later(rt_store: Store) -> None:
    """The common case, on the path of every reply: nothing in the store depends on it, so it
    is only counted (no task to create and wait for), and written with the next ones."""
    agent = Agent("svc")
    spy = SlowFailures(rt_store)

    async def body() -> None:
        health = AgentHealth(spy, ME, {"svc": agent}, SYSTEM_CLOCK, AgentSettings(success_every=60.0))  # type: ignore[arg-type]
        await health.register({"svc": 1})
        health.instances["svc"].written_at = time.monotonic()  # written just now
        assert health.report_soon("svc", True) is None
        assert health.report_soon("svc", True) is None
        assert health.instances["svc"].unsent == 2 and not health._background
        failed = health.report_soon("svc", False, "down")
        assert failed is not None  # a failure is written at once, in the background
        await failed
        assert spy.written == [False]

    run(body())


def test_a_success_is_not_written_before_an_earlier_failure(rt_store: Store) -> None:
    """A success written first would reset the breaker's count of failures in a row, and the
    failure written after it would count as the first of a new streak: one agent's reports are
    written in the order its calls ended."""
    agent = Agent("svc")
    spy = SlowFailures(rt_store)

    async def body() -> None:
        health = AgentHealth(spy, ME, {"svc": agent}, SYSTEM_CLOCK, AgentSettings(success_every=0.0))  # type: ignore[arg-type]
        await health.register({"svc": 1})
        failed = health.report_soon("svc", False, "down")
        ok = health.report_soon("svc", True)
        assert failed is not None and ok is not None  # the success waits for the failure's report
        await asyncio.wait_for(asyncio.gather(failed, ok), 5)
        await health.stop()
        assert spy.written == [False, True]
        assert health.instances["svc"].failures == 0 and health.instances["svc"].unsent == 0

    run(body())


def test_a_trial_that_ends_without_calling_the_service_is_given_back(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trial's request was taken with too little time left to try (see MIN_TRY_LEFT): it
    says nothing about the service, so the trial is given back unrun, not counted failed, and
    the next request may be the trial at once, without another cool-off."""
    dispatch_requests(store, tries=1, budget=60.0)
    agent, calls = down_once()

    async def body() -> None:
        role = make_role(store, agent, clock=clock)
        await open_breaker(role)
        dispatch_requests(store, tries=1, budget=10.5)  # 0.5 s left after the cool-off
        clock.advance(10.0)
        monkeypatch.setattr("stepwarden.agent_attempt.MIN_TRY_LEFT", 1.0)  # too little to try
        assert await role.pull() == 1  # the trial
        await finish(role)
        assert len(calls) == 1, "no time to try: the service was not called"
        [b] = store.transact_sync(sa.list_agents)["breakers"]
        assert (b["state"], b["trial_by"], b["failures"]) == ("open", None, 1)  # given back, unrun
        monkeypatch.undo()
        dispatch_requests(store, tries=1, budget=60.0)
        assert await role.pull() == 1  # the next trial, with no cool-off
        await finish(role)
        assert len(calls) == 2
        assert role.breakers["svc"].state == "closed"

    run(body())
    assert [r["outcome"] for r in replies(store)] == ["retry", "ok"]


class ReportsDown:
    """The store, refusing the agents' reports while ``down`` (a full disk, an outage)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.down = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def transact(self, fn: Any, *args: Any, **kw: Any) -> Any:
        if fn is sa.report and self.down:
            raise sqlite3.OperationalError("database or disk is full")
        return await self.store.transact(fn, *args, **kw)


def test_outcomes_that_cannot_be_recorded_are_said_once_per_outage(
    rt_store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Each call that ended while the store refused its report logged a warning of its own (seven
    in a review's 18 s full disk). Now one warning, and one line when outcomes are recorded again."""
    caplog.set_level(logging.INFO, logger="stepwarden")
    agent = Agent("svc")
    store = ReportsDown(rt_store)

    async def body() -> None:
        health = AgentHealth(store, ME, {"svc": agent}, SYSTEM_CLOCK, AgentSettings(success_every=0.0))  # type: ignore[arg-type]
        await health.register({"svc": 1})
        store.down = True
        for _ in range(5):
            sent = health.report_soon("svc", False, "down")
            assert sent is not None
            await sent
        store.down = False
        sent = health.report_soon("svc", False, "down")
        assert sent is not None
        await sent
        await health.stop()

    run(body())
    warned = [r.getMessage() for r in caplog.records if "could not record a call's outcome" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "disk is full" in warned[0]
    assert [r.getMessage() for r in caplog.records if "outcomes recorded again" in r.getMessage()] == [
        "agent svc: outcomes recorded again (5 were not)"
    ]
