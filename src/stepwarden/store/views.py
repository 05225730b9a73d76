"""Read-only views for operators (OPS1): tasks with their steps, attempts, events, alerts, leases.

Times are returned as ISO 8601 UTC strings so JSON output is readable and sortable.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from ..errors import NotFound
from ..liveness import silent
from .base import TASK_STATES, Row, Tx, read_only

TASK_COLS = (
    "id, workflow, workflow_version, state, correlation_id, idempotency_key, reply_to, priority, "
    "failure_count, locked_by, complete_by, cancel_requested, last_error, created_at, updated_at, finished_at"
)
STEP_COLS = (
    "task_id, idx, name, agent, operation, compensate, budget, state, attempt, failure_count, "
    "comp_failures, locked_by, complete_by, last_error, started_at, finished_at"
)


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(float(t), UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _task(row: Row, steps: list[Row]) -> dict[str, Any]:
    out = dict(row)
    for k in ("complete_by", "created_at", "updated_at", "finished_at"):
        out[k] = iso(out[k])
    out["cancel_requested"] = bool(out["cancel_requested"])
    out["steps"] = [_step(s) for s in steps]
    return out


def _step(row: Row) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k != "task_id"}
    for k in ("complete_by", "started_at", "finished_at"):
        out[k] = iso(out[k])
    return out


@read_only
def list_tasks(
    tx: Tx,
    state: str | None = None,
    limit: int | None = None,
    correlation_prefix: str | None = None,
    correlation_id: str | None = None,
    newest: bool = False,
) -> list[dict[str, Any]]:
    """Tasks with their steps, oldest first. ``correlation_id`` is an exact match (the way to find
    a submission whose outcome a lost connection left unknown; ``tasks_correlation`` serves it).
    ``newest``: the ``limit`` most recent ones (still listed oldest first)."""
    where, params = task_filter(state, correlation_prefix, correlation_id)
    sql = f"SELECT {TASK_COLS} FROM tasks" + where_clause(where)
    sql += " ORDER BY id DESC" if newest else " ORDER BY id"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    tasks = tx.sql(sql, tuple(params))
    if newest:
        tasks.reverse()
    if not tasks:
        return []
    by_task: dict[int, list[Row]] = {t["id"]: [] for t in tasks}
    for s in _steps_of(tx, list(by_task)):
        by_task[s["task_id"]].append(s)
    return [_task(t, by_task[t["id"]]) for t in tasks]


_IDS_PER_READ = 500  # well under SQLite's and PostgreSQL's limits on a statement's parameters


def rows_by_ids(tx: Tx, select: str, column: str, ids: list[int], order: str) -> list[Row]:
    """``select`` (``SELECT ... FROM table``) of the rows whose ``column`` is one of ``ids``, in
    ``order``: by id, never a range between the lowest and the highest listed (a few ids far apart
    read every row between them: millions of steps for two ``error`` tasks). Ids listed without a
    gap are one range, the same rows in one statement; others go ``_IDS_PER_READ`` at a time."""
    if not ids:
        return []
    lo, hi = min(ids), max(ids)
    if hi - lo + 1 == len(set(ids)):
        return tx.sql(f"{select} WHERE {column} BETWEEN ? AND ? ORDER BY {order}", (lo, hi))
    rows: list[Row] = []
    for i in range(0, len(ids), _IDS_PER_READ):
        chunk = ids[i : i + _IDS_PER_READ]
        marks = ", ".join("?" * len(chunk))
        rows += tx.sql(f"{select} WHERE {column} IN ({marks}) ORDER BY {order}", tuple(chunk))
    return rows


def _steps_of(tx: Tx, task_ids: list[int]) -> list[Row]:
    """The steps of exactly these tasks (``tasks --state error`` spans from the oldest error,
    never pruned, to now)."""
    return rows_by_ids(tx, f"SELECT {STEP_COLS} FROM steps", "task_id", task_ids, "task_id, idx")


@read_only
def count_tasks(tx: Tx, state: str | None = None, correlation_id: str | None = None) -> int:
    """How many tasks :func:`list_tasks` would list with no limit."""
    where, params = task_filter(state, None, correlation_id)
    sql = "SELECT COUNT(*) AS n FROM tasks" + where_clause(where)
    return int(tx.sql(sql, tuple(params))[0]["n"])


def task_filter(
    state: str | None, correlation_prefix: str | None = None, correlation_id: str | None = None
) -> tuple[list[str], list[Any]]:
    """The WHERE conditions (and their parameters) that select tasks by state and correlation id."""
    where: list[str] = []
    params: list[Any] = []
    if state is not None:
        if state not in TASK_STATES:
            raise ValueError(f"unknown state {state!r}")
        where.append("state = ?")
        params.append(state)
    if correlation_id is not None:
        where.append("correlation_id = ?")
        params.append(correlation_id)
    if correlation_prefix is not None:
        where.append("substr(correlation_id, 1, ?) = ?")
        params += [len(correlation_prefix), correlation_prefix]
    return where, params


def where_clause(conditions: list[str]) -> str:
    return " WHERE " + " AND ".join(conditions) if conditions else ""


@read_only
def show_task(tx: Tx, task_id: int, newest: int | None = None) -> dict[str, Any]:
    """The task with its steps, each step's attempts, its events and replies. ``newest``: only the
    newest that many attempts, events and replies (the dashboard's page, polled: a step retried
    every minute for days made it 13 MB); ``omitted`` then says how many of each were left out."""
    rows = tx.sql(f"SELECT {TASK_COLS}, input FROM tasks WHERE id = ?", (task_id,))
    if not rows:
        raise NotFound(f"no task {task_id}")
    row = rows[0]
    text = row.pop("input")
    out = _task(row, tx.sql(f"SELECT {STEP_COLS} FROM steps WHERE task_id = ? ORDER BY idx", (task_id,)))
    out["input"] = json.loads(text)
    steps = {s["idx"]: s for s in out["steps"]}
    for s in out["steps"]:
        s["attempts"] = []
    omitted = {"attempts": 0, "events": 0, "replies": 0}

    def rows_of(table: str, columns: str, key: str) -> list[Row]:
        if newest is None:
            return tx.sql(f"SELECT {columns} FROM {table} WHERE task_id = ? ORDER BY id", (task_id,))
        got = tx.sql(
            f"SELECT {columns} FROM {table} WHERE task_id = ? ORDER BY id DESC LIMIT ?", (task_id, newest)
        )[::-1]
        if len(got) == newest:
            n = tx.sql(f"SELECT COUNT(*) AS n FROM {table} WHERE task_id = ?", (task_id,))[0]["n"]
            omitted[key] = int(n) - newest
        return got

    for r in rows_of(
        "requests",
        "step_idx, attempt, kind, state, outcome, dispatched_by, dispatched_at, taken_by, "
        "taken_at, complete_by, finished_at",
        "attempts",
    ):
        idx = r.pop("step_idx")
        for k in ("dispatched_at", "taken_at", "complete_by", "finished_at"):
            r[k] = iso(r[k])
        steps[idx]["attempts"].append(r)
    out["events"] = [
        {
            "kind": e["kind"],
            "step": steps[e["step_idx"]]["name"] if e["step_idx"] in steps else None,
            "attempt": e["attempt"],
            "actor": e["actor"],
            "at": iso(e["at"]),
            "detail": json.loads(e["detail"]) if e["detail"] else {},
        }
        for e in rows_of("events", "kind, step_idx, attempt, actor, detail, at", "events")
    ]
    out["replies"] = [
        dict(r, received_at=iso(r["received_at"]))
        for r in rows_of(
            "replies", "step_idx, attempt, kind, outcome, error, sent_by, received_at, status", "replies"
        )
    ]
    if newest is not None:
        out["omitted"] = omitted
    return out


ALERT_COLUMNS = "id, kind, task_id, step, message, created_at, acked_at, acked_by"


@read_only
def list_alerts(
    tx: Tx, include_acked: bool = True, limit: int | None = None, newest: bool = False
) -> list[dict[str, Any]]:
    """Alerts, oldest first, each with ``deliveries``: what became of it at each alert sink.
    ``limit``: the first ``limit`` of them, or with ``newest`` the most recent (still oldest first)."""
    sql = f"SELECT {ALERT_COLUMNS} FROM alerts"
    if not include_acked:
        sql += " WHERE acked_at IS NULL"
    sql += " ORDER BY id DESC" if newest else " ORDER BY id"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    rows = tx.sql(sql)
    if newest:
        rows.reverse()
    return _alert_views(tx, rows)


@read_only
def show_alert(tx: Tx, alert_id: int) -> dict[str, Any] | None:
    """One alert in the shape of :func:`list_alerts` (``alerts ack --json`` prints it)."""
    rows = tx.sql(f"SELECT {ALERT_COLUMNS} FROM alerts WHERE id = ?", (int(alert_id),))
    return _alert_views(tx, rows)[0] if rows else None


def _alert_views(tx: Tx, rows: list[Row]) -> list[dict[str, Any]]:
    out = [dict(a, created_at=iso(a["created_at"]), acked_at=iso(a["acked_at"]), deliveries=[]) for a in rows]
    if out:
        by_id = {a["id"]: a for a in out}
        for d in _deliveries_of(tx, list(by_id)):
            if d["alert_id"] in by_id:
                by_id[d["alert_id"]]["deliveries"].append(
                    {
                        "sink": d["sink"],
                        "attempts": d["attempts"],
                        "delivered_at": iso(d["delivered_at"]),
                        "next_attempt_at": iso(d["next_attempt_at"]),
                        "gave_up_at": iso(d["gave_up_at"]),
                        "last_error": d["last_error"],
                    }
                )
    return out


def _deliveries_of(tx: Tx, alert_ids: list[int]) -> list[Row]:
    """The deliveries of exactly these alerts: ``alerts --unacked`` lists a few, far apart, and a
    range between them read 594,002 rows for 200 in a store of 300,000 alerts; ``alerts --json``
    lists every one, one range (500 ids at a time took 1.2 s for 200,000 on PostgreSQL, not 0.35)."""
    columns = "sink, alert_id, attempts, next_attempt_at, delivered_at, gave_up_at, last_error, delivered_by"
    return rows_by_ids(tx, f"SELECT {columns} FROM alert_deliveries", "alert_id", alert_ids, "alert_id, sink")


@read_only
def count_alerts(tx: Tx, include_acked: bool = True) -> int:
    sql = "SELECT COUNT(*) AS n FROM alerts" + ("" if include_acked else " WHERE acked_at IS NULL")
    return int(tx.sql(sql)[0]["n"])


@read_only
def list_leases(tx: Tx) -> list[dict[str, Any]]:
    return [
        dict(
            r,
            expires_at=iso(r["expires_at"]),
            acquired_at=iso(r["acquired_at"]),
            renewed_at=iso(r["renewed_at"]),
            active=bool(r["active"]) and r["holder"] is not None,
        )
        for r in tx.all("list_leases")
    ]


@read_only
def live_workers(tx: Tx, within: float) -> list[str]:
    """The ids of the workers not stopped whose heartbeat is under ``within`` seconds old, by
    the database's clock (a supervisor presumes the others dead: see ``liveness``)."""
    sql = "SELECT id FROM workers WHERE stopped_at IS NULL AND heartbeat_at > ? ORDER BY id"
    return [str(r["id"]) for r in tx.sql(sql, (_db_now(tx) - within,))]


def _db_now(tx: Tx) -> float:
    row = tx.one("now")
    assert row is not None  # a SELECT of the clock always has its row
    return float(row["now"])


@read_only
def state_counts(tx: Tx, correlation_prefix: str | None = None) -> dict[str, int]:
    where, params = task_filter(None, correlation_prefix)
    sql = "SELECT state, COUNT(*) AS n FROM tasks" + where_clause(where)
    return {r["state"]: int(r["n"]) for r in tx.sql(sql + " GROUP BY state", tuple(params))}


@read_only
def event_counts(tx: Tx, since_id: int = 0) -> dict[str, int]:
    rows = tx.sql("SELECT kind, COUNT(*) AS n FROM events WHERE id > ? GROUP BY kind", (since_id,))
    return {r["kind"]: int(r["n"]) for r in rows}


@read_only
def max_event_id(tx: Tx) -> int:
    return int(tx.sql("SELECT COALESCE(MAX(id), 0) AS m FROM events")[0]["m"])


@read_only
def events_after(tx: Tx, task_id: int, after: int) -> list[Row]:
    return tx.sql(
        "SELECT id, kind, step_idx, attempt, actor, detail, at FROM events WHERE task_id = ? AND id > ? "
        "ORDER BY id",
        (task_id, after),
    )


@read_only
def messages_after(tx: Tx, queue: str, after: int, limit: int = 500) -> list[Row]:
    return tx.sql(
        "SELECT id, task_id, correlation_id, kind, body, created_at FROM messages WHERE queue = ? AND id > ? "
        "ORDER BY id LIMIT ?",
        (queue, after, limit),
    )


@read_only
def task_state(tx: Tx, task_id: int) -> str | None:
    rows = tx.sql("SELECT state FROM tasks WHERE id = ?", (task_id,))
    return str(rows[0]["state"]) if rows else None


@read_only
def list_workers(tx: Tx, include_stopped: bool = False, include_silent: bool = True) -> list[dict[str, Any]]:
    """Worker processes with their roles, agents, last heartbeat and breaker states (AGT3).

    A worker killed without a word (SIGKILL, a lost machine) never records its stop: its row
    stays, not stopped, until the leader prunes it (days later). Each worker has ``heartbeat_age``
    (seconds, by the database's clock), ``silent`` (``liveness.silent``: no heartbeat for a minute),
    as agent instances are judged (``agents.list_agents``), and ``state``: ``stopped``, ``silent``
    or ``live``, decided here once for the CLI's table, its ``--json`` and the dashboard, so that
    no reader can call a silent worker live. Listings for an operator keep the silent ones,
    marked, since a worker that died is worth seeing; ``include_silent=False`` leaves them out,
    for what counts live workers (the metrics: a killed worker must not stay a live ``worker``
    series for days, nor each restart of a crash-looping one add another)."""
    now = _db_now(tx)
    sql = "SELECT id, roles, agents, started_at, heartbeat_at, stopped_at, breakers FROM workers"
    rows = tx.sql(sql + ("" if include_stopped else " WHERE stopped_at IS NULL") + " ORDER BY started_at")
    listed = []
    for r in rows:
        quiet = silent(r["stopped_at"], r["heartbeat_at"], now)
        if quiet and not include_silent:
            continue
        listed.append(
            {
                "id": r["id"],
                "roles": [x for x in r["roles"].split(",") if x],
                "agents": [x for x in r["agents"].split(",") if x],
                "started_at": iso(r["started_at"]),
                "heartbeat_at": iso(r["heartbeat_at"]),
                "stopped_at": iso(r["stopped_at"]),
                "breakers": json.loads(r["breakers"]) if r["breakers"] else {},
                "heartbeat_age": round(max(0.0, now - float(r["heartbeat_at"])), 3),
                "silent": quiet,
                "state": "stopped" if r["stopped_at"] is not None else "silent" if quiet else "live",
            }
        )
    return listed
