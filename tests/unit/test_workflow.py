"""Workflow definitions and task input: every bad name or input is refused with one clear line."""

from __future__ import annotations

import json
import math

import pytest

from stepwarden.agent import Agent
from stepwarden.errors import InputError, PayloadTooLarge
from stepwarden.policies import Backoff, Retry
from stepwarden.workflow import Step, Workflow, check_key, check_name, encode_input, parse_input

OK_STEP = Step("reserve", "inventory.reserve")

# -- names -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["process-order", "a", "A.b:c_d-1", "9lives", "x" * 128])
def test_good_workflow_names_are_accepted(name: str) -> None:
    assert Workflow.of(name, [OK_STEP]).name == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "-leading-dash",
        "_leading",
        "has space",
        "x" * 129,
        "semi;colon",
        "quote'",
        "slash/x",
        "ünï",
        42,
        None,
    ],
)
def test_bad_workflow_names_are_refused(name: object) -> None:
    with pytest.raises(InputError, match="invalid workflow name") as err:
        Workflow.of(name, [OK_STEP])  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "operation",
    [
        "inventory",
        "inventory.",
        ".reserve",
        "1nv.reserve",
        "inv entory.reserve",
        "inv.res.erve",
        "a" * 65 + ".op",
    ],
)
def test_bad_operation_references_are_refused(operation: str) -> None:
    with pytest.raises(InputError, match=r"invalid (operation reference|agent name|operation name)"):
        Step("reserve", operation)


def test_bad_compensation_reference_is_refused() -> None:
    with pytest.raises(InputError, match="operation reference"):
        Step("reserve", "inventory.reserve", compensate="release")


@pytest.mark.parametrize("name", ["", "1st", "a.b", "a:b", "with space", "s" * 65, 7])
def test_bad_step_names_are_refused(name: object) -> None:
    with pytest.raises(InputError, match="invalid step name"):
        Step(name, "inventory.reserve")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "bad name", "1agent", "a.b"])
def test_bad_agent_names_are_refused(name: str) -> None:
    with pytest.raises(InputError, match="invalid agent name"):
        Agent(name)


def test_bad_or_duplicate_operation_names_on_an_agent_are_refused() -> None:
    agent = Agent("payments")

    @agent.operation
    def charge(req: object) -> None: ...

    with pytest.raises(InputError, match="already has an operation 'charge'"):
        agent.operation(charge)
    with pytest.raises(InputError, match="invalid operation name"):
        agent.operation(lambda req: None, name="not valid")
    assert list(agent.operations) == ["charge"]


@pytest.mark.parametrize("kind", ["workflow", "step", "operation", "queue"])
def test_names_with_a_trailing_newline_are_refused(kind: str) -> None:
    with pytest.raises(InputError):
        if kind == "workflow":
            Workflow.of("wf\n", [OK_STEP])
        elif kind == "step":
            Step("reserve\n", "inventory.reserve")
        elif kind == "operation":
            Step("reserve", "inventory.reserve\n")
        else:
            check_name("reply queue", "web-1\n")


@pytest.mark.parametrize("key", ["order-1", "a" * 255, "ünïcode ok", "with space"])
def test_good_keys_are_accepted(key: str) -> None:
    assert check_key("idempotency key", key) == key


@pytest.mark.parametrize("key", ["", "a" * 256, "new\nline", "tab\tbed", 5])
def test_bad_keys_are_refused(key: object) -> None:
    with pytest.raises(InputError, match="invalid correlation id"):
        check_key("correlation id", key)


# -- workflow shape ----------------------------------------------------------------------------------


def test_duplicate_step_names_are_refused_and_named() -> None:
    with pytest.raises(InputError, match=r"duplicate step names: \['a'\]"):
        Workflow.of("wf", [Step("a", "svc.x"), Step("b", "svc.y"), Step("a", "svc.z")])


def test_a_workflow_needs_steps_and_a_positive_version() -> None:
    with pytest.raises(InputError, match="has no steps"):
        Workflow.of("wf", [])
    with pytest.raises(InputError, match="version"):
        Workflow.of("wf", [OK_STEP], version=0)


@pytest.mark.parametrize("budget", [0, -1.0, 7 * 86400 + 1, math.nan, math.inf, 0.005, 1e-300, 0.0999])
def test_bad_complete_by_is_refused(budget: float) -> None:
    """Below 0.1 s (found by review: 0.005 s was accepted) an agent took the request with less
    time left than a try needs, made no call, and the task ended as if the service had hung."""
    with pytest.raises(InputError, match=r"complete_by must be between 0\.1 seconds and 7 days"):
        Step("a", "svc.x", complete_by=budget)


@pytest.mark.parametrize("budget", [0.1, 30, 7 * 86400])
def test_complete_by_within_bounds_is_accepted(budget: float) -> None:
    assert Step("a", "svc.x", complete_by=budget).complete_by == budget


@pytest.mark.parametrize("on_error", ["wait", "ignore", "", None])
def test_bad_on_error_is_refused(on_error: object) -> None:
    with pytest.raises(InputError, match="on_error must be 'error' or 'compensate'"):
        Step("a", "svc.x", on_error=on_error)  # type: ignore[arg-type]


def test_step_agent_is_the_operation_prefix() -> None:
    assert Step("charge", "payments.charge", compensate="payments.refund").agent == "payments"


# -- input -----------------------------------------------------------------------------------------


def test_encode_input_is_compact_json_that_round_trips() -> None:
    value = {"order_id": "o-1", "qty": 2, "tags": ["x", "ü"], "nested": {"ok": True, "none": None}}
    text = encode_input(value)
    assert json.loads(text) == value
    assert parse_input(text) == value
    assert " " not in text  # compact separators
    assert "ü" in text  # stored as UTF-8, not \\u escapes


@pytest.mark.parametrize("value", [{1, 2}, {"when": object()}, b"bytes", {"f": lambda: 1}])
def test_non_json_input_is_refused_on_one_line(value: object) -> None:
    with pytest.raises(InputError, match="not JSON-serialisable") as err:
        encode_input(value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", [math.nan, {"amount": math.inf}, [-math.inf]])
def test_nan_and_infinity_are_refused(value: object) -> None:
    with pytest.raises(InputError, match="not JSON-serialisable"):
        encode_input(value)


def test_nan_text_from_the_command_line_never_reaches_the_store() -> None:
    # ``--input NaN`` is parsed, then encoded for the store: the pair must refuse it.
    with pytest.raises(InputError):
        encode_input(parse_input('{"amount": NaN}'))


def test_oversize_input_is_refused_counting_utf8_bytes() -> None:
    value = {"blob": "é" * 600_000}  # 600k characters, 1.2 MB as UTF-8
    with pytest.raises(PayloadTooLarge, match=r"over the limit of 1048576 bytes"):
        encode_input(value)
    with pytest.raises(PayloadTooLarge):
        parse_input(json.dumps(value, ensure_ascii=False))


def test_size_limit_is_configurable_and_inclusive() -> None:
    text = encode_input({"k": "v" * 10})
    size = len(text.encode())
    assert encode_input({"k": "v" * 10}, max_bytes=size) == text
    with pytest.raises(PayloadTooLarge, match=f"{size} bytes, over the limit of {size - 1}"):
        encode_input({"k": "v" * 10}, max_bytes=size - 1)
    with pytest.raises(PayloadTooLarge):
        parse_input(text, max_bytes=size - 1)
    assert issubclass(PayloadTooLarge, InputError)


@pytest.mark.parametrize("text", ['{"a":\n 1,,\n}', "{'single': 'quotes'}", "", "[1, 2", "{\n\n\n"])
def test_malformed_json_message_is_one_line_with_a_position(text: str) -> None:
    with pytest.raises(InputError, match=r"^task input is not valid JSON: .+ at line \d+ column \d+$") as err:
        parse_input(text)
    assert "\n" not in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_malformed_json_position_points_at_the_error() -> None:
    with pytest.raises(InputError, match="at line 3 column 3"):
        parse_input('{\n "a": 1,\n  oops\n}')


# -- serialisation ---------------------------------------------------------------------------------


def test_workflow_dict_round_trip_through_json() -> None:
    wf = Workflow.of(
        "process-order",
        [
            Step("reserve", "inventory.reserve", complete_by=5, compensate="inventory.release"),
            Step(
                "charge",
                "payments.charge",
                complete_by=10.5,
                retry=Retry(
                    max_failures=5,
                    backoff=Backoff(initial=1.0, multiplier=3.0, maximum=60.0, jitter=0.1),
                    tries=2,
                    in_attempt=Backoff(initial=0.02, maximum=0.4, jitter=0.0),
                    escalation="wait",
                    escalation_wait=90.0,
                ),
                compensate="payments.refund",
                on_error="compensate",
            ),
            Step("ship", "shipping.create"),
        ],
        version=3,
    )
    stored = json.dumps(wf.to_dict())
    back = Workflow.from_dict(json.loads(stored))
    assert back == wf
    assert back.to_dict() == wf.to_dict()
    assert [s.name for s in back.steps] == ["reserve", "charge", "ship"]


def test_from_dict_validates_like_the_constructor() -> None:
    d = Workflow.of("wf", [Step("a", "svc.x"), Step("b", "svc.y")]).to_dict()
    d["steps"][1]["name"] = "a"
    with pytest.raises(InputError, match="duplicate"):
        Workflow.from_dict(d)
    d["steps"][1]["name"] = "b"
    d["steps"][1]["on_error"] = "wait"
    with pytest.raises(InputError, match="on_error"):
        Workflow.from_dict(d)


def test_step_from_dict_without_retry_gets_the_default_policy() -> None:
    assert Step.from_dict({"name": "a", "operation": "svc.x", "complete_by": 30}) == Step("a", "svc.x")


def test_a_workflow_of_more_than_max_steps_is_refused_and_checking_many_is_quick() -> None:
    """Found by review: any number of steps was accepted (a task's cost grows with the square of
    its steps), and the duplicate check itself was quadratic: 40,000 steps took 25 s to define."""
    from stepwarden.workflow import MAX_STEPS

    steps = [Step(f"s{i}", "svc.x") for i in range(MAX_STEPS)]
    assert len(Workflow.of("big", steps).steps) == MAX_STEPS
    with pytest.raises(InputError, match=rf"has {MAX_STEPS + 1} steps, more than {MAX_STEPS}"):
        Workflow.of("bigger", [*steps, Step("one_more", "svc.x")])
    with pytest.raises(InputError, match="more than"):  # 40,000, each name 40 times: the count first
        Workflow.of("huge", steps * 40)
    with pytest.raises(InputError, match=r"duplicate step names: \['s1'\]"):
        Workflow.of("dup", [*steps[:10], Step("s1", "svc.y")])


def test_a_definition_an_older_version_stored_is_read_back_within_todays_limits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by review: a definition registered before today's limits (a 0.05 s budget, more than
    1,000 steps) was refused when read back, so `submit` by name failed on it. As a stored
    policy's refused value is, the budget is read as the floor, with a warning; the step limit is
    a definition's (``app.workflow``), not a stored one's."""
    import logging

    from stepwarden.workflow import MAX_STEPS, MIN_COMPLETE_BY

    caplog.set_level(logging.WARNING, logger="stepwarden")
    steps = [{"name": f"s{i}", "operation": "svc.x", "complete_by": 30.0} for i in range(MAX_STEPS + 1)]
    steps[0]["complete_by"] = 0.05
    wf = Workflow.from_dict({"name": "old", "version": 3, "steps": steps})
    assert len(wf.steps) == MAX_STEPS + 1 and wf.steps[0].complete_by == MIN_COMPLETE_BY
    assert [r.getMessage() for r in caplog.records] == [
        "step 's0': its stored complete_by 0.05 is under 0.1 s, the least a step may have now; read as 0.1"
    ]
