"""OpenTelemetry spans per step attempt and per finished task (OPS6), with the SDK's in-memory
exporter; and the no-op path when ``opentelemetry`` is not installed.

The agent role runs on the fake clock: attempt 1 fails (a transient error, one try), the role
applies its own reply (as a worker that is also a scheduler does), the clock passes the step's
back-off, the scheduler dispatches attempt 2, which succeeds and finishes the task.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any, cast

import pytest

from stepwarden import tracing
from stepwarden.agent import Agent, AgentRole, AgentSettings, Request
from stepwarden.clock import FakeClock
from stepwarden.errors import Transient
from stepwarden.policies import Backoff, Retry
from stepwarden.store import Store
from stepwarden.store import transitions as t
from stepwarden.workflow import Workflow, encode_input

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

ME = "agent-1:1:otel"


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    """An in-memory exporter on the process's tracer provider (set once per process)."""
    exp = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exp))
    return exp


async def finish(role: AgentRole) -> None:
    if role.tasks:
        _, pending = await asyncio.wait(set(role.tasks), timeout=5)
        assert not pending


def test_attempts_and_the_task_are_spans_of_one_trace_linked_across_retries(
    store: Store, clock: FakeClock, make_workflow: Callable[..., Workflow], exporter: InMemorySpanExporter
) -> None:
    exporter.clear()
    retry = Retry(max_failures=3, backoff=Backoff(initial=5.0, maximum=5.0, jitter=0.0), tries=1)
    wf = make_workflow("s", budget=60.0, retry=retry, compensate=False)
    task_id, _ = store.transact_sync(
        t.submit,
        wf,
        encode_input({"n": 1}),
        correlation_id=None,
        idempotency_key=None,
        priority=0,
        reply_to=None,
    )
    agent = Agent("svc")
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(req.attempt)
        current = trace.get_current_span().get_span_context()
        assert current.trace_id == tracing.task_trace_id(task_id, req.store_id)
        if req.attempt == 1:
            raise Transient("service busy")
        return "done"

    async def body() -> None:
        role = AgentRole(store, {"svc": agent}, ME, clock=clock, settings=AgentSettings(apply_replies=True))
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 1
        assert await role.pull() == 1
        await finish(role)
        clock.advance(5.0)  # the step's back-off
        assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 1
        assert await role.pull() == 1
        await finish(role)

    asyncio.run(body())
    assert calls == [1, 2]
    state = store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks WHERE id = ?", (task_id,)))
    assert state[0]["state"] == "processed"

    spans: list[ReadableSpan] = list(exporter.get_finished_spans())

    def attempt_number(s: ReadableSpan) -> int:
        assert s.attributes is not None
        return cast(int, s.attributes["stepwarden.attempt"])

    attempts = sorted((s for s in spans if s.name == "attempt svc.do_s"), key=attempt_number)
    [task] = [s for s in spans if s.name == "stepwarden.task"]
    assert len(attempts) == 2
    # one trace per task, derived from the task id and the store's: the same in any process
    store_id = store.known_identity
    assert store_id is not None and len(store_id) == 16
    trace_id = tracing.task_trace_id(task_id, store_id)
    assert {s.context.trace_id for s in [*attempts, task]} == {trace_id}
    assert all(
        s.parent is not None and s.parent.span_id == tracing.task_span_id(task_id, store_id) for s in attempts
    )
    first, second = attempts
    want: dict[str, Any] = {
        "stepwarden.task.id": task_id,
        "stepwarden.workflow": "wf",
        "stepwarden.step": "s",
        "stepwarden.agent": "svc",
        "stepwarden.operation": "do_s",
        "stepwarden.kind": "do",
    }
    for s in attempts:
        assert {k: s.attributes[k] for k in want} == want  # type: ignore[index]
        assert s.kind == trace.SpanKind.CONSUMER
    assert (first.attributes["stepwarden.attempt"], first.attributes["stepwarden.outcome"]) == (1, "retry")  # type: ignore[index]
    assert (second.attributes["stepwarden.attempt"], second.attributes["stepwarden.outcome"]) == (2, "ok")  # type: ignore[index]
    assert first.status.status_code == trace.StatusCode.ERROR
    assert second.status.status_code == trace.StatusCode.OK
    assert [e.name for e in first.events] == ["try_failed"]
    assert first.events[0].attributes is not None and "service busy" in str(
        first.events[0].attributes["error"]
    )
    # the retry links to the attempt before it
    assert [link.context.span_id for link in second.links] == [first.context.span_id]
    assert task.attributes is not None and task.attributes["stepwarden.task.state"] == "processed"


def test_task_trace_ids_are_stable_and_distinct() -> None:
    """Distinct across tasks and across stores: every store numbers its tasks from 1, and a
    tracing backend that two deployments send to must not make their tasks 1 one trace."""
    assert tracing.task_trace_id(17, "a1") == tracing.task_trace_id(17, "a1")
    ids = {tracing.task_trace_id(i, s) for i in range(500) for s in ("a1", "b2")}
    assert len(ids) == 1000 and all(0 < i < 2**128 for i in ids)
    assert tracing.task_span_id(1, "a1") != tracing.task_span_id(1, "b2")
    assert all(0 < tracing.task_span_id(i, "a1") < 2**64 for i in range(100))


def test_without_opentelemetry_every_hook_is_a_no_op() -> None:
    """In a fresh interpreter where ``import opentelemetry`` fails, as without the extra."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["opentelemetry"] = None  # import fails, as when the extra is not installed
        from stepwarden import tracing
        from stepwarden.agent import AgentRole
        assert not tracing.ENABLED
        tr = tracing.tracer("w:1:x", None)
        assert isinstance(tr, tracing.NoTracer) and tr.attempt(None) is tracing.NO_ATTEMPT
        with tr.attempt(None) as span:
            span.try_failed(1, "x")
            span.finish("ok")
        tr.applied(None)
        assert not [m for m in sys.modules if m.startswith("opentelemetry.")]
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_with_the_api_but_no_sdk_provider_no_span_is_made() -> None:
    """The ``otel`` extra installed but no SDK configured: no span objects, no workflow lookups."""
    code = textwrap.dedent(
        """
        from stepwarden import tracing
        tr = tracing.tracer("w:1:x", None)
        assert tracing.ENABLED and isinstance(tr, tracing.Tracer)
        assert not tr.wants_workflows and tr.attempt(None) is tracing.NO_ATTEMPT
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        trace.set_tracer_provider(TracerProvider())  # configured later: spans from then on
        assert tr.wants_workflows
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_role_runs_unchanged_with_the_no_op_tracer(
    store: Store, make_workflow: Callable[..., Workflow], clock: FakeClock
) -> None:
    wf = make_workflow("s", budget=60.0, compensate=False)
    store.transact_sync(
        t.submit, wf, encode_input({}), correlation_id=None, idempotency_key=None, priority=0, reply_to=None
    )
    agent = Agent("svc")

    seen: list[Any] = []

    @agent.operation
    def do_s(req: Request) -> int:  # a plain function, in the role's thread pool
        seen.append(trace.get_current_span())
        return 1

    async def body() -> None:
        role = AgentRole(store, {"svc": agent}, ME, clock=clock, settings=AgentSettings(apply_replies=True))
        role.tracer = tracing.NoTracer()
        store.transact_sync(t.claim_and_dispatch, "sched", 10)
        assert await role.pull() == 1
        await finish(role)

    asyncio.run(body())
    rows = store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks"))
    assert rows == [{"state": "processed"}]
    assert len(seen) == 1 and not seen[0].get_span_context().is_valid  # no span, nothing recorded


def test_a_plain_function_sees_the_attempt_span_in_its_thread(
    store: Store, make_workflow: Callable[..., Workflow], clock: FakeClock, exporter: InMemorySpanExporter
) -> None:
    exporter.clear()
    wf = make_workflow("s", budget=60.0, compensate=False)
    task_id, _ = store.transact_sync(
        t.submit, wf, encode_input({}), correlation_id=None, idempotency_key=None, priority=0, reply_to=None
    )
    agent = Agent("svc")
    seen: list[int] = []

    @agent.operation
    def do_s(req: Request) -> int:
        seen.append(trace.get_current_span().get_span_context().trace_id)
        return 1

    async def body() -> None:
        role = AgentRole(store, {"svc": agent}, ME, clock=clock)
        store.transact_sync(t.claim_and_dispatch, "sched", 10)
        assert await role.pull() == 1
        await finish(role)

    asyncio.run(body())
    assert store.known_identity is not None
    assert seen == [tracing.task_trace_id(task_id, store.known_identity)]


@pytest.mark.parametrize("took", ["a scheduler round", "a reply batch"])
def test_attempts_taken_for_the_workers_own_slots_carry_their_workflow(
    store: Store,
    clock: FakeClock,
    make_workflow: Callable[..., Workflow],
    exporter: InMemorySpanExporter,
    took: str,
) -> None:
    """In the default worker (scheduler and agent in one process) a scheduler round or a reply
    batch takes requests for the worker's own slots in its transaction, which reads no task:
    those attempts' spans lacked `stepwarden.workflow`, which a pull's have (found by review)."""
    from stepwarden.scheduler import SchedulerRole

    exporter.clear()
    wf = make_workflow("a", "b", name="checkout", budget=60.0, compensate=False)
    store.transact_sync(
        t.submit, wf, encode_input({}), correlation_id=None, idempotency_key=None, priority=0, reply_to=None
    )
    agent = Agent("svc")

    @agent.operation
    async def do_a(req: Request) -> str:
        return "a"

    @agent.operation
    async def do_b(req: Request) -> str:
        return "b"

    async def body() -> None:
        role = AgentRole(store, {"svc": agent}, ME, clock=clock, settings=AgentSettings(apply_replies=True))
        await role.health.register({"svc": 1})
        role.attempts.store_id = await store.identity()
        sched = SchedulerRole(store, ME, clock=clock, local=role)
        if took == "a scheduler round":
            await sched.tick()  # claims the task, dispatches a, takes it for this worker's slot
        else:
            assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 1
            assert await role.pull() == 1
        await finish(role)  # a's reply batch applies it, dispatches b and takes it
        await finish(role)

    asyncio.run(body())
    spans = [s for s in exporter.get_finished_spans() if s.name.startswith("attempt svc.")]
    assert sorted(s.name for s in spans) == ["attempt svc.do_a", "attempt svc.do_b"]
    assert all(
        s.attributes is not None and s.attributes.get("stepwarden.workflow") == "checkout" for s in spans
    )


class _Raising(SimpleSpanProcessor):
    """A span processor that raises while ``on``: the SDK passes what ``on_start``/``on_end``
    raise on to the caller (``SynchronousMultiSpanProcessor`` catches nothing)."""

    on = False

    def __init__(self) -> None:
        super().__init__(InMemorySpanExporter())

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if _Raising.on:
            raise RuntimeError("processor on_start boom")

    def on_end(self, span: ReadableSpan) -> None:
        if _Raising.on:
            raise RuntimeError("processor on_end boom")


def test_a_tracing_sdk_that_raises_does_not_stop_the_work_and_is_warned_about_once(
    store: Store,
    clock: FakeClock,
    dispatch_requests: Callable[..., list[int]],
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a span processor that raised stopped every attempt before its operation
    was called; no reply was sent, and the task ended in error as if the service had hung.
    Tracing is observation: the work goes on without the span, with one warning."""
    import logging

    caplog.set_level(logging.WARNING, logger="stepwarden")
    monkeypatch.setattr(tracing, "_warned", False)  # once per process: this test's process
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    provider.add_span_processor(_Raising())
    ids = dispatch_requests(store, 2, budget=60.0)  # two tasks of one svc.do_s step, dispatched
    agent = Agent("svc")
    calls: list[int] = []

    @agent.operation
    async def do_s(req: Request) -> str:
        calls.append(req.task_id)
        return "done"

    async def body() -> None:
        role = AgentRole(store, {"svc": agent}, ME, clock=clock, settings=AgentSettings(apply_replies=True))
        assert await role.pull() == 2
        await finish(role)

    _Raising.on = True
    try:
        asyncio.run(body())
    finally:
        _Raising.on = False
    assert sorted(calls) == ids
    states = store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks ORDER BY id"))
    assert [r["state"] for r in states] == ["processed", "processed"]
    said = [r.getMessage() for r in caplog.records if r.name == "stepwarden.tracing"]
    assert len(said) == 1 and "work goes on without that span" in said[0] and "boom" in said[0], said


def test_a_task_a_sweep_ended_gets_its_task_span(store: Store, exporter: InMemorySpanExporter) -> None:
    """Found by review: only tasks ended by a reply had a ``stepwarden.task`` span; one whose last
    attempt passed complete-by (ended by the supervisor's sweep) had none, so a search on the
    task state missed exactly those. The worker hands its sweeps to the tracer too."""
    from stepwarden import App
    from stepwarden.store.base import SweepResult
    from stepwarden.worker import Worker

    exporter.clear()
    app = App()
    app.use_store(store)
    w = Worker(app)
    w._spans = tracing.tracer(w.identity, store)  # as run() sets it, once the store is open
    store.identity_sync()  # read before any span, as a worker does when it registers
    w._swept(SweepResult(rescued=1, finished=[(41, "error")]), 0.01)
    [span] = [s for s in exporter.get_finished_spans() if s.name == "stepwarden.task"]
    assert span.attributes is not None and span.attributes["stepwarden.task.state"] == "error"
    assert span.context.trace_id == tracing.task_trace_id(41, store.identity_sync())
