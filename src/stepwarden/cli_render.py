"""Human-readable output for the CLI (rich tables); ``--json`` bypasses all of this.

The consoles here do not interpret markup: every value may come from a user (a correlation id
of ``[/]``, an error message with brackets) and must be shown literally. Colour comes only from
:class:`~rich.text.Text` styles we set ourselves.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .cli_params import ReaderGone
from .durations import short as short_duration
from .logs import safe_text
from .store.views import iso

STATE_STYLE = {
    "processed": "green",
    "error": "red",
    "compensated": "yellow",
    "cancelled": "magenta",
    "processing": "cyan",
    "compensating": "yellow",
    "pending": "white",
    "completed": "green",
    "failed": "red",
    "running": "cyan",
    "skipped": "dim",
}


# Free text, which may wrap; every other column (ids, states, times, names) stays on one line and
# is cut short with an ellipsis only if the terminal is too narrow for it.
WRAPS = {"message", "detail", "last error", "error", "steps", "breakers", "correlation", "agents"}


def _clean(value: Any) -> Any:
    """Every string in a view (dicts and lists, as the store's views return them) made safe_text."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


F = TypeVar("F", bound=Callable[..., None])


def _renders_safely(fn: F) -> F:
    """The view a renderer gets has its text made safe for the terminal first."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        fn(*_clean(list(args)), **{k: _clean(v) for k, v in kwargs.items()})

    return wrapper  # type: ignore[return-value]


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """The reader went away (``| head``): :class:`ReaderGone`, as for every command's output,
        not rich's own exit 1 with nothing said."""
        raise ReaderGone


# The narrowest COLUMNS=N taken as given: below it a table's ids and times cannot be read at all.
MIN_COLUMNS = 80


def _width() -> int | None:
    """The text's width: COLUMNS=N if it is a positive number (at least :data:`MIN_COLUMNS`), else
    the terminal's, else 200 for a pipe or a log file (which has no width: rich would assume 80
    and cut ids and times short). Rich reads COLUMNS itself, and took ``COLUMNS=0`` for a width
    of nothing: every table printed empty, with exit 0."""
    text = os.environ.get("COLUMNS", "").strip()
    if text.isdigit() and int(text) > 0:
        return max(MIN_COLUMNS, int(text))
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns if text else None  # a COLUMNS not a width: ignored
    return 200


def _console() -> Console:
    return _Console(markup=False, emoji=False, highlight=False, width=_width())


def _table(*columns: str, title: str | None = None) -> Table:
    t = Table(box=None, title=title)
    for c in columns:
        t.add_column(c, no_wrap=c not in WRAPS, overflow="fold" if c in WRAPS else "ellipsis")
    return t


def _state(s: str | None) -> Text:
    return Text(s or "-", style=STATE_STYLE.get(s or "", "white"))


def _v(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _time(t: str | None) -> str:
    """An ISO time as a table shows it: ``2026-11-25 03:47:54.123``; ``-`` for none."""
    return (t or "-").replace("T", " ").rstrip("Z")


@_renders_safely
def tasks_table(rows: list[dict[str, Any]], total: int | None = None) -> None:
    console = _console()
    if not rows:
        console.print("no tasks")
        return
    t = _table("id", "workflow", "state", "correlation", "failures", "steps", "updated")
    for r in rows:
        steps = Text(" ").join(Text(f"{s['name']}:").append_text(_state(s["state"])) for s in r["steps"])
        t.add_row(
            str(r["id"]),
            _v(r["workflow"]),
            _state(r["state"]),
            _v(r["correlation_id"]),
            str(r["failure_count"]),
            steps,
            _time(r["updated_at"]),
        )
    console.print(t)
    if total is not None and total > len(rows):
        console.print(
            f"the newest {len(rows)} of {total} tasks; --limit N for the first N, --state or "
            "--correlation-id to narrow, --json for all"
        )


@_renders_safely
def task_detail(v: dict[str, Any]) -> None:
    console = _console()
    head = Text(f"task {v['id']} ", style="bold").append(
        f"{v['workflow']} v{v['workflow_version']}  ", style=""
    )
    head.append_text(_state(v["state"]))
    if v.get("cancel_requested") and v["state"] not in ("processed", "error", "compensated", "cancelled"):
        head.append("  cancel requested", style="yellow")  # it stops after its running step (CMP4)
    head.append(
        f"  correlation={_v(v['correlation_id'])}  failures={v['failure_count']}  "
        f"locked_by={_v(v['locked_by'])}  complete_by={_time(v['complete_by'])}"
    )
    console.print(head)
    # The rest of what --json says of the task itself (docs/cli.md: "the text shows the same").
    console.print(
        f"created={_time(v.get('created_at'))}  updated={_time(v.get('updated_at'))}"
        f"  finished={_time(v.get('finished_at'))}  priority={_v(v.get('priority'))}"
        f"  reply_to={_v(v.get('reply_to'))}  idempotency_key={_v(v.get('idempotency_key'))}",
        markup=False,
        highlight=False,
    )
    if v.get("last_error"):
        console.print(Text("last error: ").append(str(v["last_error"]), style="red"))
    st = _table(
        "#",
        "step",
        "operation",
        "state",
        "attempt",
        "failures",
        "locked_by",
        "complete_by",
        "started_at",
        "finished_at",
        "last error",
    )
    for s in v["steps"]:
        st.add_row(
            str(s["idx"]),
            s["name"],
            s["operation"],
            _state(s["state"]),
            str(s["attempt"]),
            str(s["failure_count"]),
            _v(s["locked_by"]),
            _time(s["complete_by"]),
            _time(s.get("started_at")),
            _time(s.get("finished_at")),
            (s["last_error"] or "")[:60],
        )
    console.print(st)
    at = _table(
        "step",
        "attempt",
        "kind",
        "state",
        "outcome",
        "dispatched_by",
        "taken_by",
        "dispatched_at",
        "taken_at",
        "complete_by",
        "finished_at",
        title="attempts",
    )
    for s in v["steps"]:
        for a in s.get("attempts", []):
            at.add_row(
                s["name"],
                str(a["attempt"]),
                a["kind"],
                _state(a["state"]),
                _v(a["outcome"]),
                a["dispatched_by"],
                _v(a["taken_by"]),
                _time(a.get("dispatched_at")),
                _time(a.get("taken_at")),
                _time(a["complete_by"]),
                _time(a.get("finished_at")),
            )
    console.print(at)
    et = _table("at", "event", "step", "attempt", "actor", "detail", title="events")
    for e in v.get("events", []):
        detail = " ".join(f"{k}={detail_value(k, val)}" for k, val in e["detail"].items())[:160]
        et.add_row(_time(e["at"]), e["kind"], _v(e["step"]), _v(e["attempt"]), _v(e["actor"]), detail)
    console.print(et)
    names = {s["idx"]: s["name"] for s in v["steps"]}
    replies = v.get("replies", [])
    rt = _table(
        "received", "step", "attempt", "kind", "outcome", "status", "sent_by", "error", title="replies"
    )
    for r in replies:
        rt.add_row(
            _time(r["received_at"]),
            names.get(r["step_idx"], str(r["step_idx"])),
            str(r["attempt"]),
            r["kind"],
            r["outcome"],
            r["status"],
            _v(r["sent_by"]),
            _v((r["error"] or "")[:60] or None),
        )
    if replies:
        console.print(rt)


# Event details are stored as recorded (``complete_by`` in epoch seconds, for tools that compute
# with it, as ``--json`` shows); a person reads a time and a rounded duration.
_DETAIL_TIMES = {"complete_by"}


def detail_value(key: str, value: object) -> object:
    if value is None:  # as every empty value in the tables, not Python's word for it
        return "-"
    if isinstance(value, int | float) and not isinstance(value, bool):
        if key in _DETAIL_TIMES and value > 1e9:
            return _time(iso(value))
        if isinstance(value, float):
            return round(value, 3)
    return value


@_renders_safely
def alerts_table(rows: list[dict[str, Any]], total: int | None = None) -> None:
    console = _console()
    if not rows:
        console.print("no alerts")
        return
    t = _table("id", "kind", "task", "step", "message", "created", "acked")
    for a in rows:
        t.add_row(
            str(a["id"]),
            a["kind"],
            _v(a["task_id"]),
            _v(a["step"]),
            a["message"],
            _time(a["created_at"]),
            _time(a["acked_at"]),
        )
    console.print(t)
    if total is not None and total > len(rows):
        console.print(f"the newest {len(rows)} of {total} alerts; --limit N for the first N, --json for all")


@_renders_safely
def leases_table(rows: list[dict[str, Any]]) -> None:
    console = _console()
    if not rows:
        console.print("no leases")
        return
    t = _table("name", "holder", "term", "expires_at", "active")
    for r in rows:
        t.add_row(
            r["name"],
            _v(r["holder"]),
            str(r["term"]),
            _time(r["expires_at"]),
            "yes" if r["active"] else "no",
        )
    console.print(t)


@_renders_safely
def workers_table(rows: list[dict[str, Any]]) -> None:
    console = _console()
    if not rows:
        console.print("no workers")
        return
    t = _table("id", "state", "roles", "agents", "heartbeat", "breakers", "stopped")
    for w in rows:
        breakers = " ".join(f"{a}:{s}" for a, s in w["breakers"].items()) or "-"
        t.add_row(
            w["id"],
            w["state"],
            ",".join(w["roles"]),
            ",".join(w["agents"]) or "-",
            f"{_time(w['heartbeat_at'])} ({short_duration(w['heartbeat_age'])} ago)",
            breakers,
            _time(w["stopped_at"]),
        )
    console.print(t)


@_renders_safely
def agents_tables(view: dict[str, list[dict[str, Any]]]) -> None:
    """Each agent's shared breaker, then every live agent instance (AGT3, AGT6)."""
    console = _console()
    if not view["breakers"] and not view["instances"]:
        console.print("no agents")
        return
    b = _table("agent", "breaker", "since", "failures", "opened by", "trial by", "opens")
    for r in view["breakers"]:
        b.add_row(
            r["agent"],
            r["state"].replace("_", "-"),
            _time(r["since"]),
            f"{r['failures']}/{r['threshold']}",
            _v(r["opened_by"]),
            _v(r["trial_by"]),
            str(r["opens"]),
        )
    console.print(b)
    cols = ("worker", "agent", "capacity", "in flight", "health", "last success", "last failure", "error")
    t = _table(*cols)
    for i in view["instances"]:
        health = "healthy" if i["healthy"] else "unhealthy"
        t.add_row(
            i["worker"],
            i["agent"],
            str(i["capacity"]),
            str(i["inflight"]),
            health,
            _time(i["last_success_at"]),
            _time(i["last_failure_at"]),
            _v((i["last_error"] or "")[:60] or None),
        )
    console.print(t)
