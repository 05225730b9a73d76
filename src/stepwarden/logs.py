"""Structured logs (OPS6): one JSON object per line, for log shippers.

``configure_logging(level, "json")`` sends every record to standard error as a line like::

    {"ts": "2025-01-02T03:04:05.678Z", "level": "WARNING", "logger": "stepwarden.agent",
     "message": "agent inventory: circuit breaker opened (...)", "pid": 4242}

Fields passed with ``extra={...}`` become fields of the object (``task_id``, ``step``,
``worker`` ...); an exception adds ``exc_type`` and ``exc`` (the formatted traceback). Values
that are not JSON (a datetime, an exception) are written as their ``str``. No dependency.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, TextIO

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None)).keys()
    | {"message", "asctime", "taskName"}
)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def safe_text(text: str) -> str:
    """``text`` fit for a terminal, on one line: tabs and line breaks as spaces, any other
    character that is not printable (ESC, BEL, CSI, a zero-width space) as its escape. Text from
    services and users (an error message with ESC sequences) could otherwise clear an operator's
    screen, retitle it or draw fake lines; the CLI's error lines and tables and the text log
    format all show text through this."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else " " if c in "\t\n\r" else repr(c)[1:-1] for c in text)


class TextFormatter(logging.Formatter):
    """The human log lines: the message through :func:`safe_text` (a traceback keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return safe_text(super().formatMessage(record))


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module docstring)."""

    def __init__(self, static: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        out.update(self.static)
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_") and key not in out:
                out[key] = value
        if record.exc_info and record.exc_info[0] is not None:
            out["exc_type"] = record.exc_info[0].__name__
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False, separators=(",", ":"))


def configure_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Log to standard error as ``fmt``: ``"text"`` (human lines) or ``"json"`` (one object a line).

    Like ``logging.basicConfig`` it leaves alone a root logger that already has handlers of
    someone else's (an embedding application, pytest's capture); called again, it replaces the
    handler it installed before.
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, not {fmt!r}")
    root = logging.getLogger()
    root.setLevel(level.upper())
    for h in [h for h in root.handlers if getattr(h, "_stepwarden", False)]:
        root.removeHandler(h)
    if root.handlers:
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
    handler._stepwarden = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    if fmt == "json":
        # What Python itself writes to stderr, a warning or a thread's uncaught exception, as
        # records too: under json they were raw lines, a traceback over several, among the JSON
        # (found by review).
        logging.captureWarnings(True)
        threading.excepthook = _thread_exception_logged


def _thread_exception_logged(args: threading.ExceptHookArgs) -> None:
    """``threading.excepthook`` under the json format: a thread's uncaught exception as one
    record (its traceback in the record's ``exc`` field), as ``threading`` would print it."""
    if args.exc_type is SystemExit:
        return  # threading ignores it too
    name = args.thread.name if args.thread is not None else "?"
    error = args.exc_value if args.exc_value is not None else args.exc_type()
    logging.getLogger("stepwarden.threads").error("exception in thread %s", name, exc_info=error)


_SAID_LEVELS = {"": logging.INFO, "note": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def said(text: str, kind: str = "") -> str:
    """A line of a command's own for standard error (``dashboard on …``, ``warning: …``, the
    ``error: …`` it exits with): as text, ``kind: text``; under ``--log-format json`` (the handler
    :func:`configure_logging` installed), one JSON object like the log lines around it, ``kind``
    as its level, whatever the log level: a log shipper reading the worker's or the dashboard's
    standard error then parses every line, and still sees the line that said why it ended."""
    handler = next((h for h in logging.getLogger().handlers if getattr(h, "_stepwarden", False)), None)
    if handler is None or not isinstance(handler.formatter, JsonFormatter):
        return f"{kind}: {text}" if kind else text
    record = logging.LogRecord("stepwarden.cli", _SAID_LEVELS[kind], "", 0, text, None, None)
    return handler.formatter.format(record)


def log_raised(logger: logging.Logger, alerts: Iterable[Mapping[str, Any]]) -> None:
    """Each alert a role raised, once, in the log of the process that raised it, with the alert's
    fields for structured handlers. Delivery to the sinks is later and elsewhere (the ``alerts``
    lease holder); a ``LogSink`` then logs it again, as delivered, under ``stepwarden.alerts``."""
    for a in alerts:
        logger.error(
            "alert #%s raised: %s task=%s step=%s: %s",
            a["id"],
            a["kind"],
            a["task_id"],
            a["step"],
            a["message"],
            extra={"alert_id": a["id"], "alert_kind": a["kind"], "task_id": a["task_id"], "step": a["step"]},
        )
