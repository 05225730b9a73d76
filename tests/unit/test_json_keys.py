"""A dict key that is not text is refused, in a task input (SUB4) and in an operation's result,
with an error that names the key and where it is.

``json.dumps`` turns such a key into text on its own: ``{1: "x"}`` was stored as
``{"1": "x"}``, which the next step reads back under another key, and ``{1: "a", "1": "b"}`` as
an object with the key ``"1"`` twice, of which a reader keeps one. docs/concepts.md promises
that nothing is turned into text for you.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_agent_calls import run_requests
from test_agent_role import Dispatch, replies

from stepwarden import App
from stepwarden.agent import Agent, Request
from stepwarden.errors import InputError
from stepwarden.store import Store
from stepwarden.workflow import encode_input, encode_result

NOT_TEXT = "is not text: JSON object keys are text, and nothing is turned into text for you"


class Colour(enum.StrEnum):
    RED = "red"


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({1: "x"}, "key 1 (int) at the top level"),
        ({1: "a", "1": "b"}, "key 1 (int) at the top level"),
        ({"orders": [{"sku": "a"}, {"sku": "b", 2: "two"}]}, 'key 2 (int) at ["orders"][1]'),
        ({"a": {"b": {None: 1}}}, 'key None (NoneType) at ["a"]["b"]'),
        ([{True: 1}], "key True (bool) at [0]"),
        ({"f": {1.5: "x"}}, 'key 1.5 (float) at ["f"]'),
        ({(1, 2): "tuple"}, "key (1, 2) (tuple) at the top level"),
    ],
)
def test_a_key_that_is_not_text_is_refused_and_named(value: Any, where: str) -> None:
    with pytest.raises(InputError) as result:
        encode_result(value)
    assert str(result.value) == f"not JSON ({where} {NOT_TEXT})"
    with pytest.raises(InputError) as task_input:
        encode_input(value)
    assert str(task_input.value) == f"task input is not JSON-serialisable: {where} {NOT_TEXT}"


def test_text_keys_of_any_kind_are_kept() -> None:
    assert encode_result({"a": {"ü": [1]}, Colour.RED: 2}) == '{"a":{"ü":[1]},"red":2}'
    assert encode_input({"n": 1}) == '{"n":1}'


def test_an_operation_whose_result_has_a_number_key_fails_its_step_with_the_reason(
    rt_store: Store, dispatch_requests: Dispatch
) -> None:
    dispatch_requests(rt_store, tries=4)
    agent = Agent("svc")

    @agent.operation
    async def do_s(req: Request) -> dict[str, dict[int, str]]:
        return {"by_id": {7: "seven"}}  # the author meant "7"? the step says so, not the store

    run_requests(rt_store, agent)
    assert [(r["outcome"], r["result"], r["error"]) for r in replies(rt_store)] == [
        (
            "error",
            None,
            f'the operation\'s result cannot be stored: not JSON (key 7 (int) at ["by_id"] {NOT_TEXT})',
        )
    ]


def test_a_submission_with_a_number_key_writes_nothing(
    tmp_path: Path, noop_app: Callable[..., App], rows: Callable[[Store, str], list[dict[str, Any]]]
) -> None:
    app = noop_app(f"sqlite:///{tmp_path / 'keys.db'}")
    try:
        with pytest.raises(InputError, match=r'key 1 \(int\) at \["lines"\]\[0\] is not text'):
            app.submit("one", {"lines": [{1: "x"}]})
        assert rows(app.store, "SELECT id FROM tasks") == []
    finally:
        app.close()
