"""What an application writes to define an agent: ``Agent``, its operations, and the ``Request`` they get.

Agents are named wrappers around one remote service. Their definitions are kept apart from the agent
role that runs them (``agent_role.py``): an application module, and the checks that reject a bad
definition at once, need none of the role's machinery (the event loop, the thread pool, the store),
and each reads without the other. ``stepwarden.agent`` re-exports both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .classify import default_classify as default_classify  # re-exported: its rules live there
from .errors import InputError
from .policies import check_count, check_seconds, show
from .workflow import check_ident

Handler = Callable[["Request"], Any]
F = TypeVar("F", bound=Handler)


@dataclass(frozen=True)
class Request:
    """What an operation receives: one attempt of one step (or of its compensation)."""

    task_id: int
    step: str
    attempt: int
    kind: str  # "do" or "undo"
    idempotency_key: str  # stable across attempts: TASK_ID:STEP_NAME (an undo carries the key it undoes)
    input: Any
    results: dict[str, Any]
    undo: Any  # for an undo: the result of the step being undone (None if it never completed)
    complete_by: float  # absolute, on the database clock
    deadline: float  # the same moment on this process's monotonic clock
    store_id: str = ""  # the store's own random id (``Store.identity``); empty in a hand-made Request

    @property
    def payload(self) -> dict[str, Any]:
        return {"input": self.input, "results": self.results}

    @property
    def global_idempotency_key(self) -> str:
        """``STORE_ID:TASK_ID:STEP_NAME``: the idempotency key with the store's id in front.

        ``idempotency_key`` is unique within one store only: every store numbers its tasks from
        1, so a store made again, or a second store (staging beside prod, a move to PostgreSQL)
        calling the same service, sends ``1:charge`` again, and an idempotent service would
        answer the new task with the old task's result, applying nothing. Send this one to a
        service that more than one store calls (see docs/guarantees.md)."""
        return f"{self.store_id}:{self.idempotency_key}" if self.store_id else self.idempotency_key


@dataclass
class Agent:
    """A named agent and its operations; define with ``app.agent(name)`` and ``@agent.operation``.

    ``concurrency`` (calls at once per worker) and ``breaker_threshold`` (failures in a row that
    open the circuit breaker) are ints from 1 to 2**31-1 (the stores' INTEGER columns), not bools
    or floats; ``breaker_cool_off`` is a finite number of seconds from 0 to 10**9 (about 31
    years, :data:`~stepwarden.policies.MAX_SECONDS`); ``classify`` is callable.
    A bad value raises :class:`~stepwarden.errors.InputError` naming the agent and the option.
    """

    name: str
    concurrency: int = 8
    breaker_threshold: int = 5
    breaker_cool_off: float = 5.0
    classify: Callable[[BaseException], str] = default_classify
    operations: dict[str, Handler] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_ident("agent name", self.name)
        for option in ("concurrency", "breaker_threshold"):
            count = check_count(f"agent {self.name!r}: {option}", getattr(self, option))
            object.__setattr__(self, option, count)
        check_seconds(f"agent {self.name!r}: breaker_cool_off", self.breaker_cool_off)
        if not callable(self.classify):
            raise InputError(f"agent {self.name!r}: classify must be a function, not {show(self.classify)}")

    def operation(self, fn: F | None = None, *, name: str | None = None) -> Any:
        """Register ``fn`` (async or plain) as operation ``name`` (default: the function's name).

        ``@agent.operation``, ``@agent.operation(name="reserve")`` or ``agent.operation(fn)``; a
        ``fn`` that is not callable raises :class:`~stepwarden.errors.InputError`."""
        if fn is not None and not callable(fn):
            hint = f" (to name it, use @agent.operation(name={fn!r}))" if isinstance(fn, str) else ""
            raise InputError(f"agent {self.name!r}: an operation must be a function, not {show(fn)}{hint}")

        def register(f: F) -> F:
            if not callable(f):
                raise InputError(f"agent {self.name!r}: an operation must be a function, not {show(f)}")
            if name is None and not isinstance(getattr(f, "__name__", None), str):
                raise InputError(
                    f"agent {self.name!r}: operation {show(f)} has no __name__; give it one with name="
                )
            op = check_ident("operation name", name if name is not None else f.__name__)
            if op in self.operations:
                raise InputError(f"agent {self.name!r} already has an operation {op!r}")
            _check_callable_with_a_request(self.name, op, f)
            self.operations[op] = f
            return f

        return register(fn) if fn is not None else register


def _check_callable_with_a_request(agent: str, op: str, f: Callable[..., Any]) -> None:
    """Refuse, at definition, an operation that cannot take the one :class:`Request` every call
    passes, or that is a generator (its result would be a generator object, not a value): each
    was accepted and failed in every attempt of every task, with a TypeError, at run time. A
    callable whose signature Python cannot read (some built-ins) is taken as it is."""
    where = f"agent {agent!r} operation {op!r}"
    if inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f):
        raise InputError(
            f"{where}: is a generator function (it has yield); an operation returns its result"
            " (or, async, returns it from a coroutine)"
        )
    try:
        # The callable's own signature, not the one functools.wraps copied from what it wraps: a
        # decorator that supplies an argument (``wrapper(req)`` calling ``f(req, db)``) was refused.
        signature = inspect.signature(f, follow_wrapped=False)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(object())
    except TypeError as e:
        raise InputError(
            f"{where}: cannot be called with the request alone ({e}); define it as"
            f" `def {op}(req)` or `async def {op}(req)`"
        ) from None
