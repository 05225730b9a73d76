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


def test_text_log_lines_escape_what_a_service_put_in_a_message() -> None:
    """An alert's message holds a service's error text: in the text format its ESC sequences were
    written to the operator's terminal raw. The message is one line, escaped; a traceback keeps
    its lines."""
    from stepwarden.logs import TEXT_FORMAT, TextFormatter

    hostile = "card \x1b[2J\x1b]0;pwned\x07 declined\r\nfake line"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        rec = logging.LogRecord(
            "stepwarden.alerts", logging.ERROR, "x", 1, "ALERT %s", (hostile,), sys.exc_info()
        )
    out = TextFormatter(TEXT_FORMAT).format(rec)
    first, *trace = out.split("\n")
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out
    assert first.endswith("ALERT card \\x1b[2J\\x1b]0;pwned\\x07 declined  fake line")
    assert trace[0] == "Traceback (most recent call last):" and trace[-1] == "RuntimeError: boom"
