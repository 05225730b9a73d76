"""`task show`'s text (OPS1): what --json says of the task, its steps and attempts, as tables."""

from __future__ import annotations

from typing import Any

import pytest

from stepwarden.cli_render import task_detail


def view(state: str, cancel_requested: bool) -> dict[str, Any]:
    at = "2026-11-29T10:00:00.000Z"
    return {
        "id": 7, "workflow": "order", "workflow_version": 1, "state": state, "correlation_id": "o-7",
        "failure_count": 0, "locked_by": "w:1:a", "complete_by": at, "last_error": None,
        "created_at": at, "updated_at": at, "finished_at": None, "priority": 5, "reply_to": "web",
        "idempotency_key": "k-7", "cancel_requested": cancel_requested,
        "steps": [{
            "idx": 0, "name": "charge", "operation": "pay.charge", "state": "running", "attempt": 1,
            "failure_count": 0, "locked_by": "w:1:a", "complete_by": at, "last_error": None,
            "started_at": "2026-11-29T10:00:01.000Z", "finished_at": None,
            "attempts": [{
                "attempt": 1, "kind": "do", "state": "taken", "outcome": None, "dispatched_by": "w:1:a",
                "taken_by": "w:1:a", "dispatched_at": "2026-11-29T10:00:02.000Z",
                "taken_at": "2026-11-29T10:00:03.000Z", "complete_by": at, "finished_at": None,
            }],
        }],
        "events": [], "replies": [],
    }  # fmt: skip


@pytest.mark.parametrize(("state", "marked"), [("processing", True), ("cancelled", False)])
def test_a_task_asked_to_stop_says_so_until_it_has(
    state: str, marked: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: after `task cancel` of a running task, the text said only "processing";
    the cancel was an event row among the others."""
    monkeypatch.setenv("COLUMNS", "250")
    task_detail(view(state, cancel_requested=True))
    out = capsys.readouterr().out
    assert ("cancel requested" in out) is marked, out
    for shown in ("10:00:01.000", "10:00:02.000", "10:00:03.000", "priority=5", "reply_to=web", "k-7"):
        assert shown in out, (shown, out)
