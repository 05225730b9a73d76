"""The command-line contract of SPEC section 3.

Errors are one line on stderr; exit 2 for bad input (nothing written), 1 for anything else.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import replace
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from . import __version__
from .alerts import SINK_THREAD_PREFIX, ack_alert
from .app import App
from .cli_params import FiniteRange
from .errors import InputError, NotFound, StepwardenError, UnknownWorkflow
from .logs import safe_text
from .replies import Replies
from .store import FINAL_TASK_STATES, TASK_STATES, Store, Tx, open_existing, open_store, resolve_url, views
from .store import transitions as tr
from .store.base import read_only
from .supervisor import SupervisorSettings
from .worker import ROLES, WorkerSettings, parse_list
from .workflow import DEFAULT_MAX_INPUT_BYTES, check_key, check_name, parse_input

log = logging.getLogger("stepwarden.cli")


def fail(message: str) -> NoReturn:
    """An operational failure (exit 1): one line, no traceback."""
    raise click.ClickException(message)


TABLE_ROWS = 100  # the tasks (or alerts) a table shows without --limit


def _open(ctx: click.Context, *, create: bool = False) -> Store:
    """Open the store; read and operator commands refuse to create one by accident."""
    url = resolve_url(ctx.obj["db"])
    store = open_store(url) if create else open_existing(url)
    ctx.call_on_close(store.close)
    return store


def _quote(text: str, limit: int = 120) -> str:
    """User text inside an error line: quoted, escaped, shortened."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _one_line(message: str, limit: int = 600) -> str:
    """Every error is one line on stderr, whatever text a user or a library put into it."""
    flat = safe_text(message)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _load_app(ref: str) -> App:
    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise InputError(f"--app must be MODULE:ATTR, not {ref!r}")
    sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, a relative name (TypeError), or the module's own error
        reason = str(e).replace(mod_name, "it") if len(mod_name) > 20 else str(e)
        raise InputError(
            f"cannot import {_quote(mod_name)} for --app: {type(e).__name__}: {_quote(reason)}"
        ) from None
    except SystemExit as e:  # a script's code run at import: say so instead of exiting silently
        code = "" if e.code is None else _one_line(repr(e.code), 60)
        raise InputError(
            f"importing {_quote(mod_name)} for --app called sys.exit({code});"
            ' is the module\'s script code under `if __name__ == "__main__":`?'
        ) from None
    if not hasattr(mod, attr):
        raise InputError(f"module {_quote(mod_name)} has no attribute {_quote(attr)} for --app")
    obj = getattr(mod, attr)
    if not isinstance(obj, App):
        raise InputError(f"{_quote(ref)} is not a stepwarden App (its type is {type(obj).__name__})")
    return obj


def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    envvar="STEPWARDEN_DB",
    metavar="URL",
    help="Store URL (default: $STEPWARDEN_DB, else sqlite:///stepwarden.db).",
)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    envvar="STEPWARDEN_LOG_FORMAT",
    help="Log lines on stderr: text, or one JSON object per line.",
)
@click.version_option(__version__, prog_name="stepwarden")
@click.pass_context
def cli(ctx: click.Context, db: str | None, log_level: str, log_format: str) -> None:
    """stepwarden: multi-step tasks that complete or are undone as a whole."""
    from .logs import configure_logging

    ctx.ensure_object(dict)
    if db == "" and ctx.get_parameter_source("db") == ParameterSource.COMMANDLINE:
        raise InputError("--db is empty: give a store URL, or leave the option out for the default")
    ctx.obj["db"] = db or None  # an empty STEPWARDEN_DB counts as unset
    configure_logging(log_level, log_format)


@cli.command()
@click.pass_context
def init(ctx: click.Context) -> None:
    """Create or upgrade the schema (idempotent)."""
    store = _open(ctx, create=True)
    click.echo(f"store ready: {store.url}")


@cli.command()
@click.option(
    "--app", "app_ref", metavar="MODULE:ATTR", help="The application defining agents and workflows."
)
@click.option("--roles", default=",".join(ROLES), show_default=True, help="Comma-separated roles to run.")
@click.option("--agents", default=None, help="Comma-separated agent names (default: all of the app's).")
@click.option("--concurrency", type=int, default=None, help="Override every agent's concurrency.")
@click.option("--name", default=None, help="Worker name (default: the host name).")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve this worker's Prometheus metrics at http://127.0.0.1:PORT/metrics (0: a free port).",
)
@click.option(
    "--dead-after",
    type=FiniteRange(2.0, 3600.0),
    default=SupervisorSettings.dead_after,
    show_default=True,
    help="Seconds without a heartbeat after which a worker is presumed dead and its steps rescued.",
)
@click.option(
    "--retention",
    type=FiniteRange(0.0, 36500.0, min_open=True),
    default=None,
    help="Days to keep finished tasks before the leader prunes them (default 7).",
)
@click.option("--keep-finished", is_flag=True, help="Never prune finished tasks.")
@click.pass_context
def worker(
    ctx: click.Context,
    app_ref: str | None,
    roles: str,
    agents: str | None,
    concurrency: int | None,
    name: str | None,
    metrics_port: int | None,
    dead_after: float,
    retention: float | None,
    keep_finished: bool,
) -> None:
    """Run scheduler, agent and supervisor roles until SIGTERM/SIGINT."""
    if keep_finished and retention is not None:
        raise InputError("--retention and --keep-finished contradict each other: give one")
    sup = SupervisorSettings(dead_after=dead_after)
    if keep_finished:
        sup = replace(sup, retention=None)
    elif retention is not None:
        sup = replace(sup, retention=retention * 86400.0)
    settings = WorkerSettings(
        roles=parse_list(roles) or (),
        agents=parse_list(agents),
        concurrency=concurrency,
        name=name,
        supervisor=sup,
    )
    if app_ref is None and ("agent" in settings.roles):
        raise InputError(
            "--app MODULE:ATTR is needed for the agent role (or run --roles scheduler,supervisor)"
        )
    app = _load_app(app_ref) if app_ref else App()
    # Everything that can be refused is checked (the agents named, the metrics port) before the
    # store is opened: a refused command must not have created or migrated it.
    w = app.worker(settings)
    if metrics_port is not None:
        try:
            from .metrics import start_worker_metrics
        except ImportError:
            raise InputError("--metrics-port needs the extra: pip install 'stepwarden[dashboard]'") from None
        try:
            served = start_worker_metrics(w, metrics_port)
        except OSError as e:
            fail(f"cannot serve metrics on 127.0.0.1:{metrics_port} (--metrics-port): {e.strerror or e}")
        w.metrics = served.metrics
        click.echo(f"worker metrics on {served.url}", err=True)
    app.use_store(_open(ctx, create=True))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await w.run(stop)

    click.echo(f"worker {w.identity} on {app.url}", err=True)
    asyncio.run(main())
    _exit_despite_stuck_threads()


def _exit_despite_stuck_threads() -> None:
    """A plain-function operation cannot be interrupted; once the worker has released its
    attempts and resigned, do not let such a thread keep the process alive past SIGTERM."""
    import threading

    stuck = [
        t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    if any(t.name.startswith(("stepwarden-agent", SINK_THREAD_PREFIX)) for t in stuck):
        log.warning(
            "exiting with %d operation or alert-sink thread(s) still running; their results are discarded",
            len(stuck),
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _read_input(value: str) -> Any:
    """Inline JSON, ``@FILE`` or ``-`` (stdin), reading at most the size limit plus one byte, so a
    device or a pipe that never ends is refused instead of filling memory."""
    limit = DEFAULT_MAX_INPUT_BYTES
    where = "standard input"
    if value == "-":
        if sys.stdin is None:  # started with standard input closed (<&-)
            raise InputError("--input -: standard input is closed")
        data = sys.stdin.buffer.read(limit + 1)
    elif value.startswith("@"):
        where = f"input file {value[1:]!r}"
        try:
            with open(value[1:], "rb") as f:
                data = f.read(limit + 1)
        except OSError as e:
            raise InputError(f"cannot read {where}: {e.strerror}") from None
    else:
        return parse_input(value)
    if len(data) > limit:
        raise InputError(f"task input from {where} is over the limit of {limit} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{where} is not UTF-8 text") from None
    return parse_input(text)


@cli.command()
@click.argument("workflow")
@click.option("--input", "input_", required=True, metavar="JSON|@FILE|-", help="The task input.")
@click.option("--correlation-id", default=None)
@click.option("--idempotency-key", default=None)
@click.option("--reply-to", default=None, metavar="QUEUE")
@click.option("--priority", type=int, default=0, show_default=True)
@click.option(
    "--app",
    "app_ref",
    default=None,
    metavar="MODULE:ATTR",
    help="Validate against this app's workflows instead of those registered in the store.",
)
@click.pass_context
def submit(
    ctx: click.Context,
    workflow: str,
    input_: str,
    correlation_id: str | None,
    idempotency_key: str | None,
    reply_to: str | None,
    priority: int,
    app_ref: str | None,
) -> None:
    """Submit a task; prints its id."""
    data = _read_input(input_)
    app = _load_app(app_ref) if app_ref else App()
    app._prepare(
        workflow, data, correlation_id, idempotency_key, priority, reply_to
    )  # validate before opening
    if app_ref is not None and workflow not in app.workflows:
        # Refused before the store is opened: --app creates and migrates it, and bad input writes nothing.
        known = ", ".join(sorted(app.workflows)) or "none"
        raise UnknownWorkflow(f"unknown workflow {workflow!r}; this app defines: {known}")
    app.use_store(_open(ctx, create=app_ref is not None))
    click.echo(
        app.submit(
            workflow,
            data,
            correlation_id=correlation_id,
            idempotency_key=idempotency_key,
            priority=priority,
            reply_to=reply_to,
        )
    )


@cli.command()
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
    store = _open(ctx)
    if as_json or limit is not None:
        rows = store.transact_sync(views.list_tasks, state, limit, correlation_id=correlation_id)
        if as_json:
            _print_json(rows)
            return
        total = len(rows)
    else:  # a person reads the end of the list; --json (for scripts) keeps the whole of it

        @read_only
        def newest(tx: Tx) -> tuple[list[dict[str, Any]], int]:
            rows = views.list_tasks(tx, state, TABLE_ROWS, correlation_id=correlation_id, newest=True)
            more = len(rows) == TABLE_ROWS
            return rows, views.count_tasks(tx, state, correlation_id) if more else len(rows)

        rows, total = store.transact_sync(newest)
    from .cli_render import tasks_table

    tasks_table(rows, total)


@cli.group()
def task() -> None:
    """Show, retry or cancel one task."""


def _positive_id(kind: str, value: str) -> int:
    if not (value.isascii() and value.isdigit()) or len(value) > 18 or int(value) < 1:
        raise InputError(f"invalid {kind} {value[:40]!r}: expected a positive integer")
    return int(value)


def _task_id(value: str) -> int:
    return _positive_id("task id", value)


@task.command("show")
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def task_show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """A task with its steps, attempts and events."""
    tid = _task_id(task_id)
    view = _open(ctx).transact_sync(views.show_task, tid)
    if as_json:
        _print_json(view)
        return
    from .cli_render import task_detail

    task_detail(view)


@task.command("retry")
@click.argument("task_id")
@click.option("--step", default=None, help="Resume from this step (default: the failed one).")
@click.pass_context
def task_retry(ctx: click.Context, task_id: str, step: str | None) -> None:
    """Resubmit an errored task from its failed step, after fixing the cause."""
    tid = _task_id(task_id)
    _open(ctx).transact_sync(tr.retry_task, tid, step, "cli")
    click.echo(f"task {tid} is pending again")


@task.command("cancel")
@click.argument("task_id")
@click.pass_context
def task_cancel(ctx: click.Context, task_id: str) -> None:
    """Cancel a task: it stops after its running step; the steps it started are compensated, newest first."""
    tid = _task_id(task_id)
    state = _open(ctx).transact_sync(tr.cancel_task, tid, "cli")
    click.echo(f"task {tid}: cancel requested (now {state})")


@cli.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--unacked", is_flag=True, help="Only alerts not yet acknowledged.")
@click.option("--limit", type=click.IntRange(1, 1_000_000_000), default=None)
@click.pass_context
def alerts(ctx: click.Context, as_json: bool, unacked: bool, limit: int | None) -> None:
    """Operator alerts, oldest first (a table shows the newest 100 unless --limit); `alerts ack ID`
    acknowledges one."""
    if ctx.invoked_subcommand is not None:
        return
    store = _open(ctx)
    if as_json or limit is not None:
        rows = store.transact_sync(views.list_alerts, not unacked, limit)
        if as_json:
            _print_json(rows)
            return
        total = len(rows)
    else:  # as `tasks`: a person reads the end of the list; --json (for scripts) keeps all of it

        @read_only
        def newest(tx: Tx) -> tuple[list[dict[str, Any]], int]:
            rows = views.list_alerts(tx, not unacked, TABLE_ROWS, newest=True)
            more = len(rows) == TABLE_ROWS
            return rows, views.count_alerts(tx, not unacked) if more else len(rows)

        rows, total = store.transact_sync(newest)
    from .cli_render import alerts_table

    alerts_table(rows, total)


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
    aid = _positive_id("alert id", alert_id)
    who = check_key("--by name", by) if by is not None else _default_operator()
    alert, changed = _open(ctx).transact_sync(ack_alert, aid, who)
    if as_json:
        _print_json(alert)
    elif changed:
        click.echo(f"alert {aid} acknowledged by {alert['acked_by']}")
    else:
        click.echo(f"alert {aid} was already acknowledged by {alert['acked_by']} at {alert['acked_at']}")


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def leases(ctx: click.Context, as_json: bool) -> None:
    """Leases (the supervisor's leadership) with holder, term and expiry."""
    rows = _open(ctx).transact_sync(views.list_leases)
    if as_json:
        _print_json(rows)
        return
    from .cli_render import leases_table

    leases_table(rows)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--all", "include_stopped", is_flag=True, help="Include workers that stopped.")
@click.pass_context
def workers(ctx: click.Context, as_json: bool, include_stopped: bool) -> None:
    """Worker processes: roles, agents, last heartbeat, circuit breaker states."""
    rows = _open(ctx).transact_sync(views.list_workers, include_stopped)
    if as_json:
        _print_json(rows)
        return
    from .cli_render import workers_table

    workers_table(rows)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--all", "include_stopped", is_flag=True, help="Include instances of workers that stopped.")
@click.pass_context
def agents(ctx: click.Context, as_json: bool, include_stopped: bool) -> None:
    """Agent breakers (shared by every instance) and agent instances: capacity, health, load."""
    from .store import agents as store_agents

    view = _open(ctx).transact_sync(store_agents.list_agents, include_stopped)
    if as_json:
        _print_json(view)
        return
    from .cli_render import agents_tables

    agents_tables(view)


@cli.command()
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
        _watch_queue(_open(ctx), reply_to, consumer, timeout)
        return
    tid = _task_id(task_id) if task_id is not None else 0
    store = _open(ctx)
    end = None if timeout is None else time.monotonic() + timeout
    after = 0
    while True:  # look at least once, however short the timeout
        for e in store.transact_sync(views.events_after, tid, after):
            after = e["id"]
            detail = json.loads(e["detail"]) if e["detail"] else {}
            line = f"{views.iso(e['at'])} {e['kind']:<16} " + " ".join(f"{k}={v}" for k, v in detail.items())
            click.echo(safe_text(line))  # a reason or error from a service may hold ESC sequences
        state = store.transact_sync(views.task_state, tid)
        if state is None:
            raise NotFound(f"no task {tid}")
        if state in FINAL_TASK_STATES:
            click.echo(f"task {tid} is {state}")
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
                click.echo(msg.raw)

    asyncio.run(follow())


@cli.command()
@click.option(
    "--db", "demo_db", default=None, metavar="URL", help="Store URL (default: a fresh SQLite file)."
)
@click.option("--orders", type=click.IntRange(1, 100_000), default=200, show_default=True)
@click.option("--workers", type=click.IntRange(1, 32), default=3, show_default=True)
@click.option("--no-chaos", is_flag=True, help="Do not SIGKILL a worker mid-run.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
@click.option("--seed", type=int, default=7, show_default=True)
@click.pass_context
def demo(
    ctx: click.Context,
    demo_db: str | None,
    orders: int,
    workers: int,
    no_chaos: bool,
    as_json: bool,
    seed: int,
) -> None:
    """Run the order-processing example end to end, with failures, a SIGKILL and a ledger check."""
    from .demo.runner import DemoOptions, run_demo

    # Only a store named on this command line: $STEPWARDEN_DB may well name a real store, whose
    # own workers would take the demo's steps (and the demo's orders would stay in it).
    if demo_db == "":
        raise InputError("--db is empty: give a store URL, or leave the option out for a fresh file")
    given = ctx.parent is not None and ctx.parent.get_parameter_source("db") == ParameterSource.COMMANDLINE
    db = demo_db or (ctx.obj["db"] if given else None)
    if db is None and os.environ.get("STEPWARDEN_DB"):
        click.echo("note: the demo runs on a fresh SQLite file, not $STEPWARDEN_DB (--db chooses)", err=True)
    opts = DemoOptions(
        db=db,
        orders=orders,
        workers=workers,
        chaos=not no_chaos,
        as_json=as_json,
        seed=seed,
    )
    ok = run_demo(opts)
    ctx.exit(0 if ok else 1)


from .dashboard.command import dashboard as _dashboard  # noqa: E402 - click only; the extra loads lazily

cli.add_command(_dashboard)


def main(argv: list[str] | None = None) -> None:
    try:
        # Outside standalone mode click hands back the code of a ``ctx.exit(N)`` instead of
        # exiting with it (the demo's failed check exits 1 that way).
        code = cli.main(args=argv, prog_name="stepwarden", standalone_mode=False)
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            sys.exit(code)
    except click.exceptions.Abort:  # Ctrl-C (click turns KeyboardInterrupt into Abort)
        click.echo("error: interrupted", err=True)
        sys.exit(130)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.NoArgsIsHelpError as e:  # a group without its command: show its help
        click.echo(e.ctx.get_help() if e.ctx is not None else e.format_message())
        sys.exit(0)
    except click.UsageError as e:
        click.echo(f"error: {_one_line(e.format_message())}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(f"error: {_one_line(e.format_message())}", err=True)
        sys.exit(e.exit_code)
    except (InputError, NotFound) as e:
        click.echo(f"error: {_one_line(str(e))}", err=True)
        sys.exit(2)
    except StepwardenError as e:
        click.echo(f"error: {_one_line(str(e))}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # one line, never a traceback, for anything we did not foresee
        click.echo(f"error: {_one_line(f'{type(e).__name__}: {e}')}", err=True)
        if os.environ.get("STEPWARDEN_DEBUG"):
            raise
        sys.exit(1)
