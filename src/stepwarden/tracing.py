"""OpenTelemetry spans for tasks and step attempts (OPS6), when the ``otel`` extra is installed.

Without ``opentelemetry-api`` every hook here is a no-op object whose methods do nothing, chosen
once at import: nothing is imported, allocated or looked up per attempt. With the API installed but
no SDK configured, OpenTelemetry's own no-op tracer is used (also near zero cost); configure an SDK
``TracerProvider`` and exporter in your worker's process to record them.

What is recorded:

- a span per **step attempt**, in the agent instance that runs it, named ``attempt AGENT.OPERATION``
  (kind CONSUMER: it processes a request message), with attributes ``stepwarden.task.id``,
  ``stepwarden.workflow``, ``stepwarden.step``, ``stepwarden.attempt``, ``stepwarden.kind``
  (do/undo), ``stepwarden.agent``, ``stepwarden.operation``, ``stepwarden.outcome`` (ok, error,
  retry, released, silent) and the worker; each failed try inside the attempt is a span event. The
  span is current while the operation runs, so spans of an instrumented HTTP client nest under it.
- a span per **task finished** by a worker that applies its agents' replies (``stepwarden.task``,
  with the final state).

How attempts are linked: every span of a task has the same trace id, derived from the task id
and the store's own id (:func:`task_trace_id`; task ids start at 1 in every store, so the task id
alone would put one store's task 1 in the same trace as another's, in a tracing backend that
several deployments send to), and as parent a remote span context derived from them too -- so the
attempts of one task, made by different processes across retries and failovers, are one trace
without any context having to travel through the store. A retry made by the same process also carries a span
link to the previous attempt's span.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .logs import safe_text

try:
    from opentelemetry import trace as _trace
except ImportError:  # the `otel` extra is not installed: every hook below is a no-op
    _trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .store import ApplyResult, RequestMsg, Store, SweepResult

ENABLED = _trace is not None
TRACER_NAME = "stepwarden"
_REMEMBER = 10_000  # previous attempts' span contexts kept per process, for links
log = logging.getLogger("stepwarden.tracing")
_warned = False


def _guarded(what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None if the tracing SDK raised: tracing is observation, and a span processor
    or exporter that raises (the SDK does not catch what ``on_start``/``on_end`` raise) stopped
    every attempt before its operation was called, which then ended as if the service had hung
    (found by review). Warned about once per process, then at debug level."""
    global _warned
    try:
        return fn()
    except Exception as e:
        if not _warned:
            _warned = True
            log.warning("tracing failed (%s), work goes on without that span: %r", what, e)
        else:
            log.debug("tracing failed (%s): %r", what, e)
        return None


def _digest(task_id: int, store_id: str) -> bytes:
    return hashlib.blake2b(f"stepwarden:{store_id}:task:{task_id}".encode(), digest_size=24).digest()


def task_trace_id(task_id: int, store_id: str) -> int:
    """The trace id of every span of task ``task_id`` of the store ``store_id``
    (``Store.identity``): the same in every process (128 bits)."""
    return int.from_bytes(_digest(task_id, store_id)[:16], "big") or 1


def task_span_id(task_id: int, store_id: str) -> int:
    """The span id of the task's (remote, never emitted) root context: the attempts' parent."""
    return int.from_bytes(_digest(task_id, store_id)[16:], "big") or 1


class NoAttempt:
    """The attempt span when tracing is off: does nothing."""

    __slots__ = ()

    def __enter__(self) -> NoAttempt:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def try_failed(self, n: int, error: str) -> None:
        return None

    def finish(self, outcome: str, error: str | None = None) -> None:
        return None


class NoTracer:
    """The tracer when the ``otel`` extra is not installed."""

    __slots__ = ()
    wants_workflows = False

    def attempt(self, msg: RequestMsg, workflow: str | None = None) -> NoAttempt:
        return NO_ATTEMPT

    def applied(self, result: ApplyResult | SweepResult) -> None:
        return None


NO_ATTEMPT = NoAttempt()


class AttemptSpan:
    """One attempt's span, current while the attempt runs."""

    def __init__(self, tracer: Tracer, msg: RequestMsg, workflow: str | None) -> None:
        self.tracer = tracer
        self.msg = msg
        self.workflow = workflow
        self.span: Any = None
        self._use: Any = None
        self._finished = False

    def __enter__(self) -> AttemptSpan:
        if _guarded("starting an attempt's span", self._start) is None:
            self.span = None  # the attempt runs on without it
            self._use = None
        return self

    def _start(self) -> bool:
        assert _trace is not None
        msg = self.msg
        step = msg.idempotency_key.split(":", 1)[1]
        parent = _trace.set_span_in_context(
            _trace.NonRecordingSpan(_task_context(msg.task_id, self.tracer.store_id))
        )
        key = (msg.task_id, msg.step_idx, msg.kind)
        before = self.tracer.last.get(key)
        links = [_trace.Link(before, {"stepwarden.link": "previous_attempt"})] if before is not None else []
        attrs: dict[str, Any] = {
            "stepwarden.task.id": msg.task_id,
            "stepwarden.step": step,
            "stepwarden.step.index": msg.step_idx,
            "stepwarden.attempt": msg.attempt,
            "stepwarden.kind": msg.kind,
            "stepwarden.agent": msg.agent,
            "stepwarden.operation": msg.operation,
            "stepwarden.idempotency_key": msg.idempotency_key,
            "stepwarden.worker": self.tracer.me,
        }
        if self.workflow is not None:
            attrs["stepwarden.workflow"] = self.workflow
        self.span = self.tracer.otel.start_span(
            f"attempt {msg.agent}.{msg.operation}",
            context=parent,
            kind=_trace.SpanKind.CONSUMER,
            attributes=attrs,
            links=links,
        )
        self.tracer.remember(key, self.span.get_span_context())
        self._use = _trace.use_span(self.span, end_on_exit=False)
        self._use.__enter__()
        return True

    def __exit__(self, *exc: object) -> None:
        if self._use is not None:
            _guarded("leaving an attempt's span", lambda: self._use.__exit__(*exc))
        if self.span is not None:
            _guarded("ending an attempt's span", lambda: self._end(bool(exc and exc[0])))

    def _end(self, raised: bool) -> None:
        if self.span.is_recording():
            if not self._finished:  # cancelled (worker stopping) or failed before an outcome
                self.span.set_attribute("stepwarden.outcome", "cancelled" if raised else "none")
            self.span.end()

    def try_failed(self, n: int, error: str) -> None:
        if self.span is not None:
            event = {"stepwarden.try": n, "error": safe_text(error[:500])}
            _guarded("recording a failed try", lambda: self.span.add_event("try_failed", event))

    def finish(self, outcome: str, error: str | None = None) -> None:
        self._finished = True
        if self.span is not None:
            _guarded("recording an attempt's outcome", lambda: self._outcome(outcome, error))

    def _outcome(self, outcome: str, error: str | None) -> None:
        assert _trace is not None
        self.span.set_attribute("stepwarden.outcome", outcome)
        if outcome in ("error", "retry"):
            text = safe_text((error or outcome)[:500])  # a service's text: no control characters
            self.span.set_status(_trace.Status(_trace.StatusCode.ERROR, text))
        elif outcome == "silent":
            self.span.set_status(_trace.Status(_trace.StatusCode.ERROR, "complete-by passed: no reply"))
        elif outcome == "ok":
            self.span.set_status(_trace.Status(_trace.StatusCode.OK))


class Tracer:
    """Spans of one worker process (see the module docstring).

    Until an SDK tracer provider is configured (the API's global is still its proxy or no-op
    provider) it makes no span at all and asks for no workflow names: nearly free."""

    def __init__(self, me: str, store: Store) -> None:
        assert _trace is not None
        from . import __version__

        self.me = me
        self.store = store
        self.otel = _trace.get_tracer(TRACER_NAME, __version__)
        self.last: OrderedDict[tuple[int, int, str], Any] = OrderedDict()

    @property
    def store_id(self) -> str:
        """The store's identity: known before any span is made (the agent role reads it before
        its first pull, a worker when it registers its workflows), so never read here."""
        known = self.store.known_identity
        assert known is not None, "the store's identity is read before the first span"
        return known

    def remember(self, key: tuple[int, int, str], ctx: Any) -> None:
        self.last[key] = ctx
        self.last.move_to_end(key)
        while len(self.last) > _REMEMBER:
            self.last.popitem(last=False)

    @property
    def wants_workflows(self) -> bool:
        """Is a real tracer provider configured? (Checked per pull: it may be set after start.)"""
        assert _trace is not None
        provider = _trace.get_tracer_provider()
        return not isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider)

    def attempt(self, msg: RequestMsg, workflow: str | None = None) -> AttemptSpan | NoAttempt:
        return AttemptSpan(self, msg, workflow) if self.wants_workflows else NO_ATTEMPT

    def applied(self, result: ApplyResult | SweepResult) -> None:
        """Replies applied, or a sweep, by this process: a span for each task they finished."""
        if result.finished and self.wants_workflows:
            _guarded("recording finished tasks", lambda: self._finished_tasks(result.finished))

    def _finished_tasks(self, finished: list[tuple[int, str]]) -> None:
        assert _trace is not None
        for task_id, state in finished:
            root = _task_context(task_id, self.store_id)
            parent = _trace.set_span_in_context(_trace.NonRecordingSpan(root))
            span = self.otel.start_span(
                "stepwarden.task",
                context=parent,
                attributes={
                    "stepwarden.task.id": task_id,
                    "stepwarden.task.state": state,
                    "stepwarden.outcome": state,
                    "stepwarden.worker": self.me,
                },
            )
            if state != "processed":
                span.set_status(_trace.Status(_trace.StatusCode.ERROR, f"task ended {state}"))
            span.end()


def _task_context(task_id: int, store_id: str) -> Any:
    assert _trace is not None
    return _trace.SpanContext(
        trace_id=task_trace_id(task_id, store_id),
        span_id=task_span_id(task_id, store_id),
        is_remote=True,
        trace_flags=_trace.TraceFlags(_trace.TraceFlags.SAMPLED),
    )


def tracer(me: str, store: Store) -> Tracer | NoTracer:
    """The tracer for a worker process: real when ``opentelemetry-api`` is importable."""
    return Tracer(me, store) if ENABLED else NoTracer()
