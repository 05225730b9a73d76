"""The operator's commands of SPEC section 3: reading tasks, alerts, leases, workers and agents,
retrying, cancelling and acknowledging, and following a task or a reply queue (OPS1, OPS2).

``cli.py`` adds them to the ``stepwarden`` group; errors are its one-line errors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import click

from .alerts import ack_alert
from .classify import default_classify
from .cli_params import TABLE_ROWS, FiniteRange, echo, open_for, positive_id, print_json
from .clock import SYSTEM_CLOCK, Outage
from .errors import InputError, NotFound, StepwardenError
from .logs import safe_text
from .replies import Replies
from .store import FINAL_TASK_STATES, TASK_STATES, Store, Tx, views
from .store import transitions as tr
from .store.base import read_only
from .workflow import check_key, check_name


def _show(view: Any, as_json: bool, table: str, *more: Any) -> None:
    """Print ``view`` as JSON, or as the table ``cli_render.<table>(view, *more)`` draws (rich is
    imported only when a person reads the output)."""
    if as_json:
        print_json(view)
        return
    from . import cli_render

    getattr(cli_render, table)(view, *more)


Rows = list[dict[str, Any]]


def _list(
    ctx: click.Context,
    as_json: bool,
    limit: int | None,
    table: str,
    rows_of: Callable[[Tx, int | None, bool], Rows],
    count: Callable[[Tx], int],
) -> None:
    """A list command: every row for --json (scripts keep the whole list), the first ``limit``,
    or in a table the newest TABLE_ROWS and how many there are in all (a person reads the end of
    the list). ``rows_of(tx, limit, newest)`` reads the rows, ``count(tx)`` counts them."""

    @read_only
    def read(tx: Tx) -> tuple[Rows, int]:
        if as_json or limit is not None:
            rows = rows_of(tx, limit, False)
            return rows, len(rows)
        rows = rows_of(tx, TABLE_ROWS, True)
        return rows, count(tx) if len(rows) == TABLE_ROWS else len(rows)

    rows, total = open_for(ctx).transact_sync(read)
    _show(rows, as_json, table, total)


@click.command()
@click.option("--state", type=click.Choice(TASK_STATES), default=None)
@click.option(
    "--correlation-id", default=None, metavar="ID", help="Only the tasks submitted with this correlation id."
)
@click.option("--limit", type=click.IntRange(1, 1_000_000_000), default=None)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def tasks(
    ctx: click.Context, state: str | None, correlation_id: str | None, limit: int | None, as_json: bool
) -> None:
    """List tasks and their steps, oldest first (a table shows the newest 100 unless --limit)."""
    if correlation_id is not None:
        check_key("correlation id", correlation_id)
    _list(
        ctx,
        as_json,
        limit,
        "tasks_table",
        lambda tx, n, newest: views.list_tasks(tx, state, n, correlation_id=correlation_id, newest=newest),
        lambda tx: views.count_tasks(tx, state, correlation_id),
    )


@click.group()
def task() -> None:
    """Show, retry or cancel one task."""


def _task_id(value: str) -> int:
    return positive_id("task id", value)


@task.command("show")
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def task_show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """A task with its steps, attempts and events."""
    tid = _task_id(task_id)
    _show(open_for(ctx).transact_sync(views.show_task, tid), as_json, "task_detail")


@task.command("retry")
@click.argument("task_id")
@click.option("--step", default=None, help="Resume from this step (default: the failed one).")
@click.pass_context
def task_retry(ctx: click.Context, task_id: str, step: str | None) -> None:
    """Resubmit an errored task from its failed step, after fixing the cause."""
    tid = _task_id(task_id)
    state = open_for(ctx).transact_sync(tr.retry_task, tid, step, "cli")
    echo(tr.describe_retry(tid, state, step))


@task.command("cancel")
@click.argument("task_id")
@click.pass_context
def task_cancel(ctx: click.Context, task_id: str) -> None:
    """Cancel a task: it stops after its running step; the steps it started are compensated, newest first."""
    tid = _task_id(task_id)
    state = open_for(ctx).transact_sync(tr.cancel_task, tid, "cli")
    echo(f"task {tid}: cancel requested (now {state})")


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--unacked", is_flag=True, help="Only alerts not yet acknowledged.")
@click.option("--limit", type=click.IntRange(1, 1_000_000_000), default=None)
@click.pass_context
def alerts(ctx: click.Context, as_json: bool, unacked: bool, limit: int | None) -> None:
    """Operator alerts, oldest first (a table shows the newest 100 unless --limit); `alerts ack ID`
    acknowledges one."""
    if ctx.invoked_subcommand is not None:
        return
    _list(
        ctx,
        as_json,
        limit,
        "alerts_table",
        lambda tx, n, newest: views.list_alerts(tx, not unacked, n, newest),
        lambda tx: views.count_alerts(tx, not unacked),
    )


def _default_operator() -> str:
    try:
        import getpass

        name = getpass.getuser()
    except Exception:  # no user name in this environment
        name = ""
    return name if name and name.isprintable() and len(name) <= 255 else "cli"


@alerts.command("ack")
@click.argument("alert_id")
@click.option("--by", default=None, help="Who acknowledges it (default: your user name).")
@click.option("--json", "as_json", is_flag=True, help="Print the alert as JSON.")
@click.pass_context
def alerts_ack(ctx: click.Context, alert_id: str, by: str | None, as_json: bool) -> None:
    """Acknowledge an alert (a second acknowledgement keeps the first)."""
    aid = positive_id("alert id", alert_id)
    who = check_key("--by name", by) if by is not None else _default_operator()
    alert, changed = open_for(ctx).transact_sync(ack_alert, aid, who)
    if as_json:
        print_json(alert)
    elif changed:
        echo(f"alert {aid} acknowledged by {alert['acked_by']}")
    else:
        echo(f"alert {aid} was already acknowledged by {alert['acked_by']} at {alert['acked_at']}")


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def leases(ctx: click.Context, as_json: bool) -> None:
    """Leases (the supervisor's leadership) with holder, term and expiry."""
    _show(open_for(ctx).transact_sync(views.list_leases), as_json, "leases_table")


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--all", "include_stopped", is_flag=True, help="Include workers that stopped.")
@click.pass_context
def workers(ctx: click.Context, as_json: bool, include_stopped: bool) -> None:
    """Worker processes: roles, agents, last heartbeat, circuit breaker states."""
    _show(open_for(ctx).transact_sync(views.list_workers, include_stopped), as_json, "workers_table")


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--all", "include_stopped", is_flag=True, help="Include instances of workers that stopped.")
@click.pass_context
def agents(ctx: click.Context, as_json: bool, include_stopped: bool) -> None:
    """Agent breakers (shared by every instance) and agent instances: capacity, health, load."""
    from .store import agents as store_agents

    _show(open_for(ctx).transact_sync(store_agents.list_agents, include_stopped), as_json, "agents_tables")


@click.command()
@click.argument("task_id", required=False)
@click.option("--reply-to", default=None, metavar="QUEUE", help="Follow a reply queue instead of one task.")
@click.option(
    "--consumer",
    default=None,
    metavar="NAME",
    help="With --reply-to: a durable cursor; resume after the last message printed under this name.",
)
@click.option(
    "--timeout",
    type=FiniteRange(0.0, min_open=True),
    default=None,
    help="Stop after this many seconds (exit 1 if the task is not final by then).",
)
@click.pass_context
def watch(
    ctx: click.Context,
    task_id: str | None,
    reply_to: str | None,
    consumer: str | None,
    timeout: float | None,
) -> None:
    """Follow one task's events until it is final, or a reply queue's messages."""
    if (task_id is None) == (reply_to is None):
        raise InputError("give a task ID or --reply-to QUEUE (one of them)")
    if consumer is not None and reply_to is None:
        raise InputError("--consumer goes with --reply-to QUEUE")
    if reply_to is not None:
        check_name("reply queue", reply_to)
        if consumer is not None:
            check_name("consumer name", consumer)
        _watch_queue(open_for(ctx), reply_to, consumer, timeout)
        return
    from .cli_render import detail_value  # as task show prints them (rich: only where it is used)

    tid = _task_id(task_id) if task_id is not None else 0
    store = open_for(ctx)
    end = None if timeout is None else time.monotonic() + timeout
    after = 0
    # The store failing while it is watched (a server restarting, a lost connection) is waited
    # out, as `watch --reply-to` waits it out, with one warning and one line when it answers;
    # it ended the watch with the driver's bare "PoolTimeout" after 5 s.
    outage = Outage(logging.getLogger("stepwarden.cli"), f"watch {tid}", SYSTEM_CLOCK)
    while True:  # look at least once, however short the timeout
        # The state before the events: a task's final state commits with its last events, so the
        # events read after a final state include them. In the other order, a task that became
        # final between the two reads ended the watch without its last events.
        try:
            state = store.transact_sync(views.task_state, tid)
            events = store.transact_sync(views.events_after, tid, after)
        except Exception as failure:
            if default_classify(failure) != "transient":  # a damaged store, a bug: not waited out
                raise
            wait = outage.failed(failure)
            if end is not None and time.monotonic() >= end:
                raise StepwardenError(
                    f"task {tid}: the store did not answer in the last"
                    f" {SYSTEM_CLOCK.monotonic() - outage.since:.0f}s of the {timeout:g}s watch: {failure}"
                ) from None
            time.sleep(wait if end is None else max(0.0, min(wait, end - time.monotonic())))
            continue
        outage.answered()
        for e in events:
            after = e["id"]
            detail = json.loads(e["detail"]) if e["detail"] else {}
            shown = " ".join(f"{k}={detail_value(k, v)}" for k, v in detail.items())
            line = f"{views.iso(e['at'])} {e['kind']:<16} {shown}"
            echo(safe_text(line))  # a reason or error from a service may hold ESC sequences
        if state is None:
            raise NotFound(f"no task {tid}")
        if state in FINAL_TASK_STATES:
            echo(f"task {tid} is {state}")
            return
        if end is not None and time.monotonic() >= end:
            raise StepwardenError(f"task {tid} is still {state} after {timeout:g}s")  # exit 1, one line
        time.sleep(0.2 if end is None else max(0.0, min(0.2, end - time.monotonic())))


def _watch_queue(store: Store, queue: str, consumer: str | None, timeout: float | None) -> None:
    """Print a reply queue's messages as they come (SCH8), each one line of JSON; with a consumer
    name, each is acknowledged once printed, so a restart prints only what came after."""

    async def follow() -> None:
        stop = asyncio.Event()
        if timeout is not None:
            asyncio.get_running_loop().call_later(max(0.0, timeout), stop.set)
        async with Replies(store, queue, consumer, stop=stop) as replies:
            async for msg in replies:
                echo(msg.raw)

    asyncio.run(follow())


COMMANDS = (tasks, task, alerts, leases, workers, agents, watch)
