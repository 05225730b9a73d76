"""What each dashboard page reads, each function one transaction (``store.transact(fn, ...)``).

Every filter is a bound parameter; the SQL text is fixed here, never built from what a user sent.
Lists are bounded (newest first, a page at a time), so a store with millions of tasks stays quick.
"""

from __future__ import annotations

from typing import Any

from .. import alerts
from ..errors import NotFound
from ..metrics import breaker_state
from ..store import TASK_STATES, Tx, views
from ..store import agents as store_agents
from ..store.base import read_only
from ..store.views import iso

PAGE = 50
# The newest attempts, events and replies a task's page shows (it is polled whole): a step retried
# every minute for ten days made it 13 MB, re-sent every poll. The rest: `task show ID --json`.
TASK_ROWS = 200
MAX_ID = 2**62


@read_only
def now(tx: Tx) -> float:
    row = tx.one("now")
    assert row is not None
    return float(row["now"])


@read_only
def task_list(tx: Tx, state: str | None, query: str | None, before: int | None) -> dict[str, Any]:
    """Tasks newest first: by state, and by a search that matches a task id or a correlation id
    (exactly or as a prefix)."""
    where, params = views.task_filter(state)
    if query:
        match = "substr(correlation_id, 1, ?) = ?"
        qparams: list[Any] = [len(query), query]
        if query.isascii() and query.isdigit() and 0 < int(query) < MAX_ID:
            match = f"(id = ? OR {match})"
            qparams.insert(0, int(query))
        where.append(match)
        params += qparams
    if before is not None:
        where.append("id < ?")
        params.append(before)
    sql = (
        "SELECT id, workflow, state, correlation_id, priority, failure_count, locked_by, complete_by, "
        "last_error, created_at, updated_at FROM tasks"
    ) + views.where_clause(where)
    rows = tx.sql(sql + " ORDER BY id DESC LIMIT ?", (*params, PAGE + 1))
    more = len(rows) > PAGE
    rows = rows[:PAGE]
    steps: dict[int, list[dict[str, Any]]] = {r["id"]: [] for r in rows}
    if rows:
        # The steps of exactly the page's tasks: a range between its lowest and highest id read
        # every step between them, 0.6 s a poll for 3 error tasks far apart among 112,000.
        select = "SELECT task_id, idx, name, state, attempt FROM steps"
        for s in views.rows_by_ids(tx, select, "task_id", list(steps), "task_id, idx"):
            steps[s["task_id"]].append(s)
    for r in rows:
        r["steps"] = steps[r["id"]]
        for k in ("complete_by", "created_at", "updated_at"):
            r[k + "_iso"] = iso(r[k])
    return {
        "tasks": rows,
        "counts": views.state_counts(tx),
        "next_before": rows[-1]["id"] if more and rows else None,
        "now": now(tx),
    }


@read_only
def task_detail(tx: Tx, task_id: int) -> dict[str, Any]:
    """The task with, per step, its attempts (owners, complete-by, outcome, the reply's error) and
    the events about it, and the task's own events."""
    if not 0 < task_id < MAX_ID:
        raise NotFound(f"no task {task_id}")
    task = views.show_task(tx, task_id, newest=TASK_ROWS)
    replies: dict[tuple[int, int, str], dict[str, Any]] = {}
    for r in task["replies"]:
        replies[(r["step_idx"], r["attempt"], r["kind"])] = r
    by_idx = {s["idx"]: s for s in task["steps"]}
    for s in task["steps"]:
        s["events"] = []
        for a in s["attempts"]:
            reply = replies.get((s["idx"], a["attempt"], a["kind"]))
            a["error"] = reply["error"] if reply else None
            a["reply_status"] = reply["status"] if reply else None
            a["replied_by"] = reply["sent_by"] if reply else None
    task_events: list[dict[str, Any]] = []
    for e in task["events"]:
        step = next((s for s in by_idx.values() if s["name"] == e["step"]), None)
        (step["events"] if step is not None else task_events).append(e)
    task["task_events"] = task_events
    task["now"] = now(tx)
    task["alerts"] = [
        dict(a, created_at=iso(a["created_at"]), acked_at=iso(a["acked_at"]))
        for a in tx.sql(
            "SELECT id, kind, step, message, created_at, acked_at, acked_by FROM alerts WHERE task_id = ? "
            "ORDER BY id",
            (task_id,),
        )
    ]
    return task


@read_only
def alert_list(tx: Tx, unacked_only: bool) -> dict[str, Any]:
    newest = views.list_alerts(tx, not unacked_only, PAGE * 4, newest=True)
    return {"alerts": newest[::-1], "unacked": views.count_alerts(tx, include_acked=False)}  # newest first


def ack_alert(tx: Tx, alert_id: int, actor: str) -> bool:
    """Acknowledge an alert; False if it was already acknowledged. :class:`NotFound` if none.

    The one acknowledgement of the CLI and ``app.ack_alert`` (:func:`stepwarden.alerts.ack_alert`),
    with its ``alert_acked`` event: the dashboard's own UPDATE wrote none, so its acknowledgements
    were missing from the task's timeline, from ``watch`` and from the events' metrics."""
    if not 0 < alert_id < MAX_ID:
        raise NotFound(f"no alert {alert_id}")
    return alerts.ack_alert(tx, alert_id, actor)[1]


@read_only
def lease_list(tx: Tx) -> dict[str, Any]:
    terms = [
        dict(t, acquired_at=iso(t["acquired_at"]), ended_at=iso(t["ended_at"]))
        for t in tx.sql(
            "SELECT name, term, holder, acquired_at, ended_at FROM lease_terms "
            "ORDER BY acquired_at DESC LIMIT ?",
            (20,),
        )
    ]
    t = now(tx)
    leases = views.list_leases(tx)
    for lease in leases:
        row = tx.sql("SELECT expires_at FROM leases WHERE name = ?", (lease["name"],))
        lease["expires_in"] = float(row[0]["expires_at"]) - t if row else None
    return {"leases": leases, "terms": terms, "now": t}


@read_only
def worker_list(tx: Tx) -> dict[str, Any]:
    t = now(tx)
    live = views.list_workers(tx)
    for w in live:
        w["breakers"] = {a: breaker_state(v) for a, v in w["breakers"].items()}
    stopped = [
        dict(r, started_at=iso(r["started_at"]), stopped_at=iso(r["stopped_at"]))
        for r in tx.sql(
            "SELECT id, roles, agents, started_at, stopped_at FROM workers WHERE stopped_at IS NOT NULL "
            "ORDER BY stopped_at DESC LIMIT ?",
            (10,),
        )
    ]
    agents = store_agents.list_agents(tx)
    return {
        "workers": live,
        "stopped": stopped,
        "breakers": agents["breakers"],
        "instances": agents["instances"],
        "now": t,
    }


@read_only
def overview(tx: Tx) -> dict[str, Any]:
    """Backlog and the system at a glance (the throughput series comes from the metrics tally)."""
    counts = views.state_counts(tx)
    queues = {
        r["agent"]: int(r["n"])
        for r in tx.sql("SELECT agent, COUNT(*) AS n FROM requests WHERE state = 'queued' GROUP BY agent")
    }
    unapplied = int(tx.sql("SELECT COUNT(*) AS n FROM replies WHERE status = 'new'")[0]["n"])
    unacked = views.count_alerts(tx, include_acked=False)
    leases = views.list_leases(tx)
    workers = views.list_workers(tx, include_silent=False)  # live ones, as the metrics count them
    # The breakers are shared by every instance of an agent: one entry per agent, with who opened it.
    open_breakers = [
        (b["opened_by"] or "-", b["agent"])
        for b in store_agents.list_agents(tx)["breakers"]
        if b["state"] != "closed"
    ]
    return {
        "counts": {s: counts.get(s, 0) for s in TASK_STATES},
        "total": sum(counts.values()),
        "queues": queues,
        "queued": sum(queues.values()),
        "unapplied": unapplied,
        "unacked": unacked,
        "leases": leases,
        "workers": len(workers),
        "open_breakers": open_breakers,
        "now": now(tx),
    }
