"""Definitions refuse, when they are written, the values that would break a worker later.

A back-off of nan or inf, a concurrency of nan, ``retry=None``, a version of ``"2"``: each is one
:class:`InputError` at definition time, on one line naming the parameter and the bad value, and
nothing is registered. Before, they were accepted and surfaced in the workers: a task waiting
forever (REL1), an IntegrityError at every pull, an AttributeError in the scheduler.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import re
from collections.abc import Callable
from typing import Any

import pytest

from stepwarden import App
from stepwarden.agent import Agent, Request
from stepwarden.errors import InputError
from stepwarden.policies import Backoff, Retry
from stepwarden.store import Store
from stepwarden.store import transitions as t
from stepwarden.workflow import MIN_ESCALATION_WAIT, Step, Workflow, encode_input

OK = Step("reserve", "inventory.reserve")
MAX_INT = 2**31 - 1  # the stores keep counts and versions in INTEGER columns


def _new(cls: Callable[..., object], *args: Any, **kw: Any) -> Callable[[], object]:
    return lambda: cls(*args, **kw)


def _app_agent(**kw: Any) -> Callable[[], object]:
    return lambda: App().agent("inventory", **kw)


def _app_workflow(steps: object, **kw: Any) -> Callable[[], object]:
    return lambda: App().workflow("order", steps, **kw)  # type: ignore[arg-type]


def _operation(fn: object, **kw: Any) -> Callable[[], object]:
    return lambda: Agent("inventory").operation(fn, **kw)  # type: ignore[arg-type]


def _half(x: int, y: int) -> int:
    return x // y


# (what to define, the parameter the message must name, how it shows the bad value)
BAD: list[Any] = [
    # Backoff: every field a finite number, not a bool or text
    pytest.param(_new(Backoff, initial=math.nan), "Backoff.initial", "not nan", id="backoff-initial-nan"),
    pytest.param(_new(Backoff, initial=math.inf), "Backoff.initial", "not inf", id="backoff-initial-inf"),
    pytest.param(_new(Backoff, initial=-0.1), "Backoff.initial", "not -0.1", id="backoff-initial-negative"),
    pytest.param(_new(Backoff, initial="1"), "Backoff.initial", "not '1'", id="backoff-initial-text"),
    pytest.param(_new(Backoff, initial=True), "Backoff.initial", "not True", id="backoff-initial-bool"),
    pytest.param(_new(Backoff, initial=None), "Backoff.initial", "not None", id="backoff-initial-none"),
    pytest.param(_new(Backoff, maximum=math.nan), "Backoff.maximum", "not nan", id="backoff-maximum-nan"),
    pytest.param(_new(Backoff, maximum=math.inf), "Backoff.maximum", "not inf", id="backoff-maximum-inf"),
    pytest.param(_new(Backoff, maximum=-1), "Backoff.maximum", "not -1", id="backoff-maximum-negative"),
    pytest.param(_new(Backoff, maximum=False), "Backoff.maximum", "not False", id="backoff-maximum-bool"),
    pytest.param(_new(Backoff, multiplier=math.nan), "Backoff.multiplier", "not nan", id="backoff-mult-nan"),
    pytest.param(_new(Backoff, multiplier=math.inf), "Backoff.multiplier", "not inf", id="backoff-mult-inf"),
    pytest.param(_new(Backoff, multiplier=0.5), "Backoff.multiplier", "not 0.5", id="backoff-mult-below-1"),
    pytest.param(_new(Backoff, multiplier=True), "Backoff.multiplier", "not True", id="backoff-mult-bool"),
    pytest.param(_new(Backoff, jitter=math.nan), "Backoff.jitter", "not nan", id="backoff-jitter-nan"),
    pytest.param(_new(Backoff, jitter=-0.01), "Backoff.jitter", "not -0.01", id="backoff-jitter-negative"),
    pytest.param(_new(Backoff, jitter=1.01), "Backoff.jitter", "not 1.01", id="backoff-jitter-over-1"),
    pytest.param(_new(Backoff, jitter=True), "Backoff.jitter", "not True", id="backoff-jitter-bool"),
    pytest.param(_new(Backoff, jitter="0.2"), "Backoff.jitter", "not '0.2'", id="backoff-jitter-text"),
    # Retry: whole counts, Backoff values, a finite escalation_wait
    pytest.param(_new(Retry, max_failures=1.5), "Retry.max_failures", "not 1.5", id="retry-failures-float"),
    pytest.param(
        _new(Retry, max_failures=math.nan), "Retry.max_failures", "not nan", id="retry-failures-nan"
    ),
    pytest.param(_new(Retry, max_failures=0), "Retry.max_failures", "not 0", id="retry-failures-zero"),
    pytest.param(_new(Retry, max_failures=True), "Retry.max_failures", "not True", id="retry-failures-bool"),
    pytest.param(_new(Retry, max_failures="3"), "Retry.max_failures", "not '3'", id="retry-failures-text"),
    pytest.param(_new(Retry, tries=2.5), "Retry.tries", "not 2.5", id="retry-tries-float"),
    pytest.param(_new(Retry, tries=0), "Retry.tries", "not 0", id="retry-tries-zero"),
    pytest.param(_new(Retry, backoff=None), "Retry.backoff", "not None", id="retry-backoff-none"),
    pytest.param(
        _new(Retry, backoff={"initial": 1}), "Retry.backoff", "not {'initial': 1}", id="retry-backoff-dict"
    ),
    pytest.param(_new(Retry, in_attempt=0.5), "Retry.in_attempt", "not 0.5", id="retry-in-attempt-number"),
    pytest.param(
        _new(Retry, escalation="explode"), "Retry.escalation", "not 'explode'", id="retry-escalation"
    ),
    pytest.param(
        _new(Retry, escalation=["wait"]), "Retry.escalation", "not ['wait']", id="retry-escalation-list"
    ),
    pytest.param(
        _new(Retry, escalation_wait=math.inf), "Retry.escalation_wait", "not inf", id="retry-wait-inf"
    ),
    pytest.param(
        _new(Retry, escalation_wait=math.nan), "Retry.escalation_wait", "not nan", id="retry-wait-nan"
    ),
    pytest.param(
        _new(Retry, escalation_wait=-1.0), "Retry.escalation_wait", "not -1.0", id="retry-wait-negative"
    ),
    pytest.param(
        _new(Retry, escalation_wait="60"), "Retry.escalation_wait", "not '60'", id="retry-wait-text"
    ),
    # Step
    pytest.param(_new(Step, "a", "svc.x", complete_by="5"), "complete_by", "not '5'", id="step-budget-text"),
    pytest.param(
        _new(Step, "a", "svc.x", complete_by=None), "complete_by", "not None", id="step-budget-none"
    ),
    pytest.param(
        _new(Step, "a", "svc.x", complete_by=True), "complete_by", "not True", id="step-budget-bool"
    ),
    pytest.param(
        _new(Step, "a", "svc.x", complete_by=math.nan), "complete_by", "not nan", id="step-budget-nan"
    ),
    pytest.param(_new(Step, "a", "svc.x", complete_by=0), "complete_by", "not 0", id="step-budget-zero"),
    pytest.param(_new(Step, "a", "svc.x", retry=3), "retry", "not 3", id="step-retry-number"),
    pytest.param(_new(Step, "a", "svc.x", retry=Backoff()), "retry", "not Backoff(", id="step-retry-backoff"),
    pytest.param(
        _new(Step, "a", "svc.x", on_error=["error"]), "on_error", "not ['error']", id="step-on-error-list"
    ),
    # Workflow (through App.workflow, as users define them)
    pytest.param(_app_workflow([OK], version="2"), "version", "not '2'", id="workflow-version-text"),
    pytest.param(_app_workflow([OK], version=1.5), "version", "not 1.5", id="workflow-version-float"),
    pytest.param(_app_workflow([OK], version=math.nan), "version", "not nan", id="workflow-version-nan"),
    pytest.param(_app_workflow([OK], version=True), "version", "not True", id="workflow-version-bool"),
    pytest.param(_app_workflow([OK], version=0), "version", "not 0", id="workflow-version-zero"),
    pytest.param(
        _app_workflow([OK], version=2**31), "version", f"not {2**31}", id="workflow-version-too-big"
    ),
    pytest.param(_app_workflow(None), "steps", "not None", id="workflow-steps-none"),
    pytest.param(_app_workflow("reserve"), "steps", "not 'reserve'", id="workflow-steps-text"),
    pytest.param(_app_workflow(5), "steps", "not 5", id="workflow-steps-number"),
    pytest.param(_app_workflow({"name": "a"}), "steps", "not {'name': 'a'}", id="workflow-steps-dict"),
    pytest.param(
        _app_workflow([{"name": "a", "operation": "svc.x"}]),
        "step 1 must be a Step",
        "not {'name': 'a', 'operation': 'svc.x'}",
        id="workflow-steps-of-dicts",
    ),
    pytest.param(_app_workflow([OK, None]), "step 2 must be a Step", "not None", id="workflow-step-none"),
    pytest.param(
        _new(Workflow, "order", ["reserve"]),
        "step 1 must be a Step",
        "not 'reserve'",
        id="workflow-direct-steps-of-text",
    ),
    # Agent options (through App.agent, which passes them to Agent)
    pytest.param(_app_agent(concurrency=math.nan), "concurrency", "not nan", id="agent-concurrency-nan"),
    pytest.param(_app_agent(concurrency=2.5), "concurrency", "not 2.5", id="agent-concurrency-float"),
    pytest.param(_app_agent(concurrency=True), "concurrency", "not True", id="agent-concurrency-bool"),
    pytest.param(_app_agent(concurrency="8"), "concurrency", "not '8'", id="agent-concurrency-text"),
    pytest.param(
        _app_agent(concurrency=2**31), "concurrency", f"not {2**31}", id="agent-concurrency-too-big"
    ),
    pytest.param(_app_agent(breaker_threshold=0), "breaker_threshold", "not 0", id="agent-threshold-zero"),
    pytest.param(
        _app_agent(breaker_threshold=-1), "breaker_threshold", "not -1", id="agent-threshold-negative"
    ),
    pytest.param(
        _app_agent(breaker_threshold=2.5), "breaker_threshold", "not 2.5", id="agent-threshold-float"
    ),
    pytest.param(_app_agent(breaker_cool_off=-5), "breaker_cool_off", "not -5", id="agent-cool-off-negative"),
    pytest.param(
        _app_agent(breaker_cool_off=math.nan), "breaker_cool_off", "not nan", id="agent-cool-off-nan"
    ),
    pytest.param(
        _app_agent(breaker_cool_off=math.inf), "breaker_cool_off", "not inf", id="agent-cool-off-inf"
    ),
    pytest.param(_app_agent(breaker_cool_off="5"), "breaker_cool_off", "not '5'", id="agent-cool-off-text"),
    pytest.param(_app_agent(classify="transient"), "classify", "not 'transient'", id="agent-classify-text"),
    # Agent.operation
    pytest.param(_operation(5), "operation", "not 5", id="operation-number"),
    pytest.param(_operation(None, name=None), "operation", "not None", id="operation-none-as-decorator"),
    pytest.param(_operation("reserve"), "operation", "not 'reserve'", id="operation-name-given-as-fn"),
    pytest.param(
        _operation(functools.partial(_half, 10)), "name=", "has no __name__", id="operation-without-a-name"
    ),
]


@pytest.mark.parametrize(("define", "parameter", "shown"), BAD)
def test_a_bad_definition_is_one_input_error_naming_the_parameter_and_value(
    define: Callable[[], object], parameter: str, shown: str
) -> None:
    with pytest.raises(InputError) as err:
        result = define()
        if callable(result):  # a decorator: what it is applied to is what is checked
            result(None)
    message = str(err.value)
    assert parameter in message
    assert shown in message  # "not <the bad value>"
    assert "\n" not in message


def test_a_refused_definition_registers_nothing() -> None:
    app = App()
    with pytest.raises(InputError, match="concurrency"):
        app.agent("inventory", concurrency=math.nan)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="version"):
        app.workflow("order", [OK], version="2")  # type: ignore[arg-type]
    inventory = app.agent("inventory")  # the name is still free
    with pytest.raises(InputError, match="operation"):
        inventory.operation(5)  # type: ignore[arg-type]
    assert app.workflows == {} and inventory.operations == {}
    assert app.workflow("order", [Step("ship", "shipping.create")]).version == 1  # the name is free too


# -- the nan back-off that left a task waiting --------------------------------------------------


def test_a_nan_or_infinite_backoff_cannot_reach_a_workflow() -> None:
    """The audit's case, ``Backoff(initial=nan)`` in a step's Retry, and its sibling the infinite
    back-off, which left a failed step's task pending with ``run_at = inf`` and no complete-by,
    never run again (see the stored-policy test below). Building the Backoff is now what fails,
    so no workflow holding one is registered, submitted or run."""
    app = App()
    for bad in ({"initial": math.nan}, {"initial": math.inf, "maximum": math.inf}):
        with pytest.raises(InputError, match=r"^invalid back-off: Backoff\.initial must be a finite number"):
            app.workflow("order", [Step("reserve", "inventory.reserve", retry=Retry(backoff=Backoff(**bad)))])
    assert app.workflows == {}


def _fail_once_with_stored_policy(store: Store, policy: str) -> dict[str, Any]:
    """Submit a one-step task, store ``policy`` as its step's (as an older version may have), fail its
    first attempt with a transient error, apply the reply; the task row after that."""
    wf = Workflow.of("order", [Step("reserve", "svc.do_reserve")])
    task_id = store.transact_sync(
        t.submit, wf, encode_input({}), correlation_id=None, idempotency_key=None, priority=0, reply_to=None
    )[0]
    store.transact_sync(lambda tx: tx.sql("UPDATE steps SET policy = ? WHERE task_id = ?", (policy, task_id)))
    assert store.transact_sync(t.claim_and_dispatch, "sched", 10) == 1
    for req in asyncio.run(store.claim_requests("agent", ["svc"], 10)):
        asyncio.run(store.send_reply("agent", req.id, "transient", None, "boom"))
    store.transact_sync(t.apply_replies, "sched", 10, random.Random(0))
    rows = store.transact_sync(lambda tx: tx.sql("SELECT * FROM tasks WHERE id = ?", (task_id,)))
    return dict(rows[0])


@pytest.mark.parametrize(
    "policy",
    [
        '{"max_failures": 1, "escalation": "wait", "escalation_wait": Infinity}',
        '{"max_failures": 1, "escalation": "wait", "escalation_wait": NaN}',
        '{"max_failures": 2, "backoff": {"initial": Infinity, "maximum": Infinity}}',
    ],
    ids=["wait-inf", "wait-nan", "backoff-inf"],
)
def test_a_policy_stored_before_the_checks_still_retries_after_a_finite_delay(
    store: Store, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: run_at = inf (the task waited forever, pending, with no complete-by) or, for nan,
    # an IntegrityError (NOT NULL tasks.run_at) that rolled back the batch of replies.
    with caplog.at_level(logging.WARNING, logger="stepwarden.policies"):
        task = _fail_once_with_stored_policy(store, policy)
    assert task["state"] == "pending" and task["complete_by"] is None
    assert math.isfinite(task["run_at"])
    assert "takes its default" in caplog.text


def test_stored_values_now_refused_take_their_defaults_field_by_field() -> None:
    stored = Retry.from_dict(
        {
            "max_failures": 1.5,  # read as 1, as before
            "tries": math.nan,
            "backoff": {"initial": math.nan, "multiplier": 3.0, "maximum": 9.0, "jitter": 0.0},
            "escalation": "wait",
            "escalation_wait": math.inf,
        }
    )
    assert stored == Retry(
        max_failures=1,
        tries=Retry().tries,
        backoff=Backoff(initial=Backoff().initial, multiplier=3.0, maximum=9.0, jitter=0.0),
        escalation="wait",
        escalation_wait=Retry().escalation_wait,
    )


# -- None, and the edge values that stay valid -----------------------------------------------------


def test_retry_none_means_the_default_policy() -> None:
    step = Step("reserve", "inventory.reserve", retry=None)  # type: ignore[arg-type]
    assert step.retry == Retry()
    assert step.to_dict() == OK.to_dict()
    assert App().workflow("order", [step]).steps[0].retry == Retry()


def test_edge_values_are_accepted() -> None:
    assert Backoff(initial=0, multiplier=1, maximum=0, jitter=0).delay(3, random.Random(0)) == 0.0
    assert Backoff(initial=1e6, multiplier=1e3, maximum=1e9, jitter=1).delay(50) == 1e9
    assert (
        Retry(max_failures=1, tries=1, escalation="wait", escalation_wait=0).after_failure(1, "error").delay
        == 0
    )
    retry = Retry(max_failures=1, tries=1, escalation="wait", escalation_wait=MIN_ESCALATION_WAIT)
    assert Retry(max_failures=10**6, tries=10**4, escalation_wait=1e9).escalation_wait == 1e9
    step = Step("a", "svc.x", complete_by=7 * 86400, retry=retry)
    assert Step("b", "svc.y", complete_by=0.1).complete_by == 0.1
    wf = Workflow.of("order", (s for s in [step]), version=MAX_INT)  # any iterable of steps
    assert wf.steps == (step,) and wf.version == MAX_INT
    assert Workflow("order", [step]).steps == (step,)  # type: ignore[arg-type]  # kept as a tuple
    app = App()
    agent = app.agent("inventory", concurrency=1, breaker_threshold=1, breaker_cool_off=0)
    assert (agent.concurrency, agent.breaker_threshold, agent.breaker_cool_off) == (1, 1, 0)
    big = app.agent("payments", concurrency=MAX_INT, breaker_threshold=MAX_INT, breaker_cool_off=1e9)
    assert big.concurrency == MAX_INT

    async def reserve(req: Request) -> None: ...

    assert agent.operation(functools.partial(_half, 10), name="halve") is not None
    assert agent.operation(name="booking")(reserve) is reserve
    assert agent.operation(reserve) is reserve
    assert sorted(agent.operations) == ["booking", "halve", "reserve"]


@pytest.mark.parametrize(
    ("retry", "said"),
    [
        (
            Retry(backoff=Backoff(initial=10, maximum=1)),
            r"Retry.backoff starts at 10 s, above its maximum of 1 s",
        ),
        (
            Retry(in_attempt=Backoff(initial=3, maximum=2)),
            r"Retry.in_attempt starts at 3 s, above its maximum",
        ),
        (
            Retry(escalation="wait", escalation_wait=0),
            r"Retry.escalation_wait of 0 s retries the failing step back to back",
        ),
        (Retry(escalation="wait", escalation_wait=0.5), r"Retry.escalation_wait of 0.5 s .* at least 1 s"),
    ],
    ids=["backoff-swapped", "in-attempt-swapped", "wait-0", "wait-half"],
)
def test_a_policy_that_cannot_mean_what_it_says_is_refused_at_definition(retry: Retry, said: str) -> None:
    """Each value alone is valid, together they are not: a back-off whose initial delay is above
    its maximum (swapped by mistake) had every delay capped, silently; a "wait" escalation of 0 s
    retried a failing service back to back for as long as its breaker stayed closed. Refused by
    the definition (``app.workflow``), naming the workflow and the step; a definition an older
    version stored is still read as it was written."""
    step = Step("charge", "pay.charge", complete_by=10, retry=retry)
    with pytest.raises(InputError, match=rf"workflow 'order', step 'charge': {said}"):
        Workflow.of("order", [step])
    with pytest.raises(InputError, match=said):
        App().workflow("order", [step])
    stored = Workflow("order", (step,)).to_dict()
    assert Workflow.from_dict(stored).steps[0].retry == retry


def test_steps_given_as_a_set_are_refused_for_having_no_order() -> None:
    with pytest.raises(InputError, match="steps must be in order"):
        Workflow.of("order", {OK})
    with pytest.raises(InputError, match="steps must be in order"):
        App().workflow("order", frozenset([OK]))  # type: ignore[arg-type]


def test_whole_floats_and_numpy_style_integers_are_counts() -> None:
    """3.0 from a configuration file (YAML, JSON) is a count of 3, as it was before the checks;
    it is stored as the int. A fraction, nan, a bool or text is not."""
    import fractions

    retry = Retry(max_failures=3.0, tries=2.0)  # type: ignore[arg-type]
    assert (retry.max_failures, retry.tries) == (3, 2) and isinstance(retry.max_failures, int)
    agent = App().agent("inventory", concurrency=8.0, breaker_threshold=5.0)  # type: ignore[arg-type]
    assert (agent.concurrency, agent.breaker_threshold) == (8, 5) and isinstance(agent.concurrency, int)
    assert Workflow.of("order", [OK], version=2.0).version == 2  # type: ignore[arg-type]
    # an int too large for a float is refused in one line, not an OverflowError
    with pytest.raises(InputError, match="complete_by"):
        Step("a", "svc.x", complete_by=10**400)
    with pytest.raises(InputError, match="max_failures"):
        Retry(max_failures=fractions.Fraction(3, 2))  # type: ignore[arg-type]


def test_an_agent_runs_a_step_whose_stored_in_attempt_backoff_is_now_refused(tmp_path: Any) -> None:
    """The agent reads a step's in-attempt back-off from its request, as stored at submission by
    whatever version submitted it. A value now refused (``maximum: Infinity``) takes its default
    there too, instead of failing every attempt of the task (no reply, rescued, again...)."""
    app = App(f"sqlite:///{tmp_path / 'old.db'}")
    svc = app.agent("svc", concurrency=2)
    ran: list[int] = []

    @svc.operation
    async def do_reserve(req: Request) -> Any:
        ran.append(req.attempt)
        return {"ok": True}

    app.workflow("order", [Step("reserve", "svc.do_reserve", complete_by=10)])
    task_id = app.submit("order", {})
    old = '{"max_failures": 3, "tries": 4, "in_attempt": {"initial": 0.05, "maximum": Infinity}}'
    app.store.transact_sync(
        lambda tx: tx.sql("UPDATE steps SET policy = ? WHERE task_id = ?", (old, task_id))
    )

    async def run_until_processed() -> str:
        stop = asyncio.Event()
        worker = asyncio.create_task(app.worker(roles=("scheduler", "agent")).run(stop))
        try:
            for _ in range(200):  # 10 s at most
                state = app.store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks"))[0]["state"]
                if state == "processed":
                    return str(state)
                await asyncio.sleep(0.05)
            return str(state)
        finally:
            stop.set()
            await worker

    try:
        assert asyncio.run(run_until_processed()) == "processed"
        assert ran == [1], "the first attempt ran, once"
    finally:
        app.close()


def test_a_result_or_error_the_store_cannot_keep_is_that_steps_error_not_the_batchs(tmp_path: Any) -> None:
    """A NaN result, a result nested too deeply and an error message with a lone surrogate used to
    fail the whole batch of replies they were sent in (the database refused it), so the other
    tasks' replies were lost too and their steps rescued as if the worker had died. (No supervisor
    runs here: a lost reply leaves its task unfinished, and the test says so.)"""
    from stepwarden import Permanent
    from stepwarden.workflow import MAX_JSON_DEPTH

    app = App(f"sqlite:///{tmp_path / 'r.db'}")
    svc = app.agent("svc", concurrency=8)

    @svc.operation
    async def good(req: Request) -> Any:
        await asyncio.sleep(0.05)  # in the same reply batch as the others
        return {"fine": req.input["n"]}

    @svc.operation
    async def nan(req: Request) -> Any:
        return {"x": float("nan")}

    @svc.operation
    async def deep(req: Request) -> Any:
        value: Any = 1
        for _ in range(MAX_JSON_DEPTH + 20):
            value = [value]
        return value

    @svc.operation
    async def surrogate(req: Request) -> Any:
        raise Permanent("refused \ud800 by the service")

    for name in ("good", "nan", "deep", "surrogate"):
        app.workflow(name, [Step("s", f"svc.{name}", complete_by=10, retry=Retry(max_failures=1, tries=1))])
    ids = {name: app.submit(name, {"n": i}) for i, name in enumerate(["good", "nan", "deep", "surrogate"])}
    ids["good2"] = app.submit("good", {"n": 9})

    async def run_until_final() -> None:
        stop = asyncio.Event()
        worker = asyncio.create_task(app.worker(roles=("scheduler", "agent")).run(stop))
        try:
            for _ in range(200):  # 10 s at most
                if all(app.task(t)["state"] in ("processed", "error") for t in ids.values()):
                    return
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await worker

    try:
        asyncio.run(run_until_final())
        views = {name: app.task(t) for name, t in ids.items()}
        assert views["good"]["state"] == "processed" and views["good2"]["state"] == "processed"
        for name in ("nan", "deep", "surrogate"):
            assert views[name]["state"] == "error", views[name]
        assert "cannot be stored: not JSON" in views["nan"]["last_error"]
        assert "cannot be stored: nested too deeply" in views["deep"]["last_error"]
        assert views["surrogate"]["last_error"] == "refused \\ud800 by the service"
    finally:
        app.close()


def test_a_stored_policy_is_parsed_once_per_text_and_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every request of a step carries the same policy text: agents and schedulers read it per
    attempt, so it is parsed (and a refused value warned about) once, not per attempt."""
    from stepwarden.policies import stored_policy

    text = '{"tries": 2, "in_attempt": {"initial": 0.01, "maximum": Infinity}, "sw_test": 1}'
    with caplog.at_level(logging.WARNING, logger="stepwarden.policies"):
        first, again = stored_policy(text), stored_policy(text)
    assert first is again
    assert (first.tries, first.in_attempt) == (2, Backoff(initial=0.01, maximum=Retry().in_attempt.maximum))
    assert caplog.text.count("takes its default") == 1


def test_an_operation_a_workflow_names_is_checked_when_a_worker_starts_whatever_the_order(
    tmp_path: Any,
) -> None:
    """Found by review: the check ran in app.workflow, so it hung on the order of definitions. An
    agent defined first, its operations decorated after the workflow (in a module imported
    later), was refused; one defined after the workflow was never checked, and a typo went
    through: its requests waited, taken by no agent, until their complete-by."""
    from stepwarden import InputError, Step, Worker

    later = App(f"sqlite:///{tmp_path / 'a.db'}")
    pay = later.agent("payments")
    later.workflow("order", [Step("charge", "payments.charge"), Step("ship", "shipping.create")])

    @pay.operation
    async def charge(req: Request) -> None:
        return None

    Worker(later)  # accepted: every operation of `payments` exists by now; `shipping` is another's

    typo = App(f"sqlite:///{tmp_path / 'b.db'}")
    typo.workflow("order", [Step("charge", "payments.chrage")])
    pays = typo.agent("payments")

    @pays.operation
    async def charge2(req: Request) -> None:
        return None

    with pytest.raises(
        InputError, match=r"step 'charge': agent 'payments' has no operation 'chrage' \(it has: charge2\)"
    ):
        Worker(typo)
    assert not (tmp_path / "b.db").exists()  # refused before the store was opened


def test_a_submission_of_a_workflow_naming_an_operation_its_own_agent_lacks_is_refused_writing_nothing(
    tmp_path: Any,
) -> None:
    """SUB4, found by review: the typo was caught only when a worker started on the app, and by
    then ``app.submit`` (every way in: plain, async, inside ``app.transaction()``) had written
    tasks that no worker could start. Checked at submission now, before anything is written;
    once the operation is defined (a module imported later), the same app submits."""
    from stepwarden import Step

    url = f"sqlite:///{tmp_path / 'typo.db'}"
    app = App(url)
    pay = app.agent("pay")
    app.workflow("order", [Step("charge", "pay.chrage")])

    @pay.operation
    async def charge(req: Request) -> None:
        return None

    refused = r"workflow 'order' step 'charge': agent 'pay' has no operation 'chrage' \(it has: charge\)"
    try:
        with pytest.raises(InputError, match=refused):
            app.submit("order", {})
        with pytest.raises(InputError, match=refused):
            asyncio.run(app.submit_async("order", {}))
        with pytest.raises(InputError, match=refused), app.transaction() as tx:
            tx.submit("order", {})
        assert app.store.transact_sync(lambda tx: tx.sql("SELECT id FROM tasks")) == []

        @pay.operation
        async def chrage(req: Request) -> None:  # defined after all: the same app now submits
            return None

        assert app.submit("order", {}) == 1
    finally:
        app.close()


def test_code_that_submits_without_importing_an_agents_operations_may_submit(tmp_path: Any) -> None:
    """Found by review of the check above: a web tier imports the definitions (the app, its
    agents, its workflows) but not the module of the operations, which only the workers import.
    Its agent has no operations in that process: a submission is not refused for it, and the
    worker, which imports them, checks them all when it starts."""
    from stepwarden import Step, Worker

    url = f"sqlite:///{tmp_path / 'web.db'}"
    app = App(url)
    pay = app.agent("pay")
    app.workflow("order", [Step("charge", "pay.charge")])
    try:
        assert app.submit("order", {}) == 1  # the web tier: no operation of `pay` here
        with pytest.raises(InputError, match="agent 'pay' has no operation 'charge' \\(it has: none\\)"):
            Worker(app)  # a worker that did not import them either: it could never take the step

        @pay.operation
        async def charge(req: Request) -> None:  # the workers' module, imported
            return None

        Worker(app)
        assert app.submit("order", {}) == 2
    finally:
        app.close()


def test_submitting_an_unknown_workflow_to_a_store_that_does_not_exist_creates_nothing(
    tmp_path: Any,
) -> None:
    """SUB4, found by review: the lookup opened the app's store, which created and migrated one
    at the (likely mistyped) path, for a submission that wrote nothing."""
    from stepwarden.errors import UnknownWorkflow

    folder = tmp_path / "fresh"
    folder.mkdir()
    app = App(f"sqlite:///{folder / 'new.db'}")
    with pytest.raises(UnknownWorkflow, match=r"unknown workflow 'nope': no stepwarden store at .*new\.db"):
        app.submit("nope", {})
    assert list(folder.iterdir()) == []
    app.close()


def test_the_store_opened_to_look_up_an_unknown_workflow_is_the_apps_not_opened_twice(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look-up opens the store as it must exist (nothing created); that store is then the
    app's. It was closed and the app's own opened again: twice the connections (on PostgreSQL a
    pool and its threads) for one submission."""
    import stepwarden.app as app_module
    from stepwarden.errors import UnknownWorkflow
    from stepwarden.store import open_store

    url = f"sqlite:///{tmp_path / 'there.db'}"
    open_store(url).close()
    opened: list[str] = []
    real = open_store

    def counted(*a: Any, **k: Any) -> Any:
        opened.append("again")
        return real(*a, **k)

    monkeypatch.setattr(app_module, "open_store", counted)
    app = App(url)
    with pytest.raises(UnknownWorkflow, match="no worker has registered it"):
        app.submit("nope", {})
    assert app._store is not None and opened == []
    with pytest.raises(UnknownWorkflow):
        app.submit("nope", {})
    assert opened == []
    app.close()


def _no_argument() -> None: ...


def _two_arguments(req: Request, other: int) -> None: ...


def _generator(req: Request) -> Any:
    yield 1


async def _async_generator(req: Request) -> Any:
    yield 1


@pytest.mark.parametrize(
    ("fn", "says"),
    [
        (_no_argument, "cannot be called with the request alone (too many positional arguments)"),
        (_two_arguments, "cannot be called with the request alone (missing a required argument: 'other')"),
        (_generator, "is a generator function"),
        (_async_generator, "is a generator function"),
    ],
)
def test_an_operation_that_cannot_take_the_request_is_refused_at_definition(
    fn: Callable[..., Any], says: str
) -> None:
    """Found by review: each was accepted and failed every attempt of every task at run time (a
    TypeError; a generator object that is not JSON), so the task ended in error after its
    retries. Now one InputError where the operation is defined, and the agent keeps nothing."""
    agent = App("sqlite:///never-opened.db").agent("svc")
    with pytest.raises(InputError, match=rf"agent 'svc' operation 'op': {re.escape(says)}"):
        agent.operation(fn, name="op")
    assert agent.operations == {}


def test_operations_that_take_the_request_in_any_form_are_accepted() -> None:
    agent = App("sqlite:///never-opened.db").agent("svc")

    async def keyword_after(req: Request, *, dry_run: bool = False) -> None: ...

    def anything(*args: Any, **kwargs: Any) -> None: ...

    class Callable_:
        def __call__(self, req: Request) -> None: ...

    def with_db(f: Callable[..., Any]) -> Callable[..., Any]:  # a decorator that supplies an argument
        @functools.wraps(f)
        def wrapper(req: Request) -> Any:
            return f(req, 2)

        return wrapper

    fns: list[Callable[..., Any]] = [
        keyword_after,
        anything,
        Callable_(),
        functools.partial(_two_arguments, other=2),
        with_db(_two_arguments),  # found by review: refused, its signature read through __wrapped__
    ]
    for i, fn in enumerate(fns):
        agent.operation(fn, name=f"op{i}")
    agent.operation(print, name="builtin")  # no signature to read: taken as it is
    assert len(agent.operations) == 6


def test_the_app_api_says_a_store_that_does_not_answer_as_a_store_error(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review on PostgreSQL: with the server down, ``app.submit`` raised psycopg_pool's
    PoolTimeout and ``app.task`` psycopg's OperationalError as they came, so code that caught
    StoreError, as documented, crashed on them. Each is now a StoreError that says whether the
    submission may have been written; an error that is no outage goes on as it came."""
    import psycopg
    import psycopg_pool

    from stepwarden import Step
    from stepwarden.errors import StoreError

    app = App(f"sqlite:///{tmp_path / 'api.db'}")
    app.workflow("order", [Step("a", "svc.do_a")])
    store = app.store

    def failing(error: BaseException) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise error

        return call

    try:
        monkeypatch.setattr(store, "transact_sync", failing(psycopg_pool.PoolTimeout("no connection in 5 s")))
        with pytest.raises(
            StoreError,
            match=r"submit: the store did not answer \(PoolTimeout: no connection in 5 s\); no connection was"
            r" had, so nothing was written",
        ):
            app.submit("order", {})
        monkeypatch.setattr(
            store, "transact_sync", failing(psycopg.OperationalError("server closed the connection"))
        )
        with pytest.raises(
            StoreError, match="it may have been written: submit it again with the same idempotency key"
        ):
            app.submit("order", {})
        with pytest.raises(StoreError, match=r"task: the store did not answer .*; try again once it answers"):
            app.task(1)
        with pytest.raises(StoreError, match="alerts: the store did not answer"):
            app.alerts()

        async def down(*args: Any, **kwargs: Any) -> Any:
            raise psycopg.OperationalError("server closed the connection")

        monkeypatch.setattr(store, "transact", down)
        with pytest.raises(StoreError, match="submit: the store did not answer"):
            asyncio.run(app.submit_async("order", {}))
        monkeypatch.setattr(store, "transact_sync", failing(RuntimeError("a bug")))
        with pytest.raises(RuntimeError, match="a bug"):  # not an outage: as it came
            app.submit("order", {})
    finally:
        monkeypatch.undo()
        app.close()
