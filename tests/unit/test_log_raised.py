"""An alert a role raises is logged once, at raise, distinct from a LogSink's delivery line."""

from __future__ import annotations

import json
import logging

import pytest

from stepwarden.logs import JsonFormatter, log_raised

ALERT = {"id": 7, "kind": "task_error", "task_id": 42, "step": "charge", "message": "card declined"}


def test_each_raised_alert_is_one_error_record_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("stepwarden.test_roles")
    other = dict(ALERT, id=8, kind="compensation_failed", step="refund")
    with caplog.at_level(logging.ERROR, logger=logger.name):
        log_raised(logger, [ALERT, other])
        log_raised(logger, [])
    recs = [r for r in caplog.records if r.name == logger.name]
    assert [r.levelno for r in recs] == [logging.ERROR, logging.ERROR]
    assert recs[0].getMessage() == "alert #7 raised: task_error task=42 step=charge: card declined"
    assert recs[1].getMessage().startswith("alert #8 raised: compensation_failed task=42 step=refund")
    # Not the LogSink's delivery wording ("ALERT task_error #7 ..."): a reader tells them apart.
    assert not any(r.getMessage().startswith("ALERT") for r in recs)


def test_a_raised_alert_carries_its_fields_in_json_logs(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("stepwarden.test_roles")
    with caplog.at_level(logging.ERROR, logger=logger.name):
        log_raised(logger, [ALERT])
    [rec] = [r for r in caplog.records if r.name == logger.name]
    line = json.loads(JsonFormatter().format(rec))
    assert line["level"] == "ERROR"
    assert (line["alert_id"], line["alert_kind"], line["task_id"], line["step"]) == (
        7,
        "task_error",
        42,
        "charge",
    )
