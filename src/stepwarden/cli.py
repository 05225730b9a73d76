"""The command-line contract of SPEC section 3.

Errors are one line on stderr; exit 2 for bad input (nothing written), 1 for anything else.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from . import __version__
from .alerts import SINK_THREAD_PREFIX
from .app import App
from .cli_params import (
    FiniteRange,
    ReaderGone,
    bracketed,
    echo,
    fail,
    is_loopback,
    missing_what,
    open_for,
    store_url,
)
from .cli_views import COMMANDS
from .clock import SYSTEM_CLOCK, Clock
from .errors import InputError, NotFound, StepwardenError, StoreError, UnknownWorkflow
from .logs import safe_text, said
from .parent import die_with_parent
from .store.base import read_only, redact_url
from .store.sqlite import SQLiteStore
from .store.sqlite_files import damaged_text
from .supervisor import SupervisorSettings
from .worker import ROLES, Worker, WorkerSettings, parse_list
from .workflow import DEFAULT_MAX_INPUT_BYTES, parse_input

log = logging.getLogger("stepwarden.cli")


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    envvar="STEPWARDEN_DB",
    metavar="URL",
    help="Store URL (default: the --app's own, else $STEPWARDEN_DB, else sqlite:///stepwarden.db).",
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
    ctx.obj["db_given"] = ctx.get_parameter_source("db") == ParameterSource.COMMANDLINE
    configure_logging(log_level, log_format)


for _command in COMMANDS:
    cli.add_command(_command)


# Up to this size `init` runs SQLite's full integrity_check, which also compares every index with
# its table (1.5 s for a 200 MB file here, cached); above it, quick_check, which does not. A backup
# moved over a live store left an index that quick_check passed and that hid 36 tasks from every
# claim for good (found by review). Stores are kept small by pruning.
FULL_CHECK_UP_TO = 256 * 1024 * 1024


@read_only
def _integrity(tx: Any, pragma: str) -> str:
    """SQLite's ``PRAGMA integrity_check`` or ``quick_check``: "ok", or its first finding."""
    rows = tx.sql(f"PRAGMA {pragma}(1)")
    return str(next(iter(rows[0].values()))) if rows else "ok"


@cli.command()
@click.pass_context
def init(ctx: click.Context) -> None:
    """Create or upgrade the schema (idempotent)."""
    # On PostgreSQL, where the search_path points, even beside a store in another schema.
    store = open_for(ctx, create=True, beside=True)
    if isinstance(store, SQLiteStore):
        # A damaged file opens, and its schema reads, as long as the pages read are whole: "ready"
        # was printed for a store whose tasks table was damaged (every other command then failed).
        try:
            size = os.path.getsize(store.path)
        except OSError:
            size = 0
        pragma = "integrity_check" if size <= FULL_CHECK_UP_TO else "quick_check"
        found = store.transact_sync(_integrity, pragma)
        if found != "ok":
            raise StoreError(damaged_text(safe_text(store.path), f"{pragma}: {safe_text(found)}"))
    echo(f"store ready: {safe_text(redact_url(store.url))}")  # the URL is the user's: escaped


@cli.command()
@click.option(
    "--app", "app_ref", metavar="MODULE:ATTR", help="The application defining agents and workflows."
)
@click.option("--roles", default=",".join(ROLES), show_default=True, help="Comma-separated roles to run.")
@click.option("--agents", default=None, help="Comma-separated agent names (default: all of the app's).")
@click.option(
    "--concurrency",
    type=click.IntRange(1, 10_000),  # WorkerSettings' bounds, named by the option a user typed
    default=None,
    help="Override every agent's concurrency.",
)
@click.option("--name", default=None, help="Worker name (default: the host name).")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve this worker's Prometheus metrics at http://HOST:PORT/metrics (0: a free port).",
)
@click.option(
    "--metrics-host",
    metavar="HOST",
    default=None,
    help="Address the metrics listen on, with --metrics-port (default 127.0.0.1: this machine only).",
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
    metrics_host: str | None,
    dead_after: float,
    retention: float | None,
    keep_finished: bool,
) -> None:
    """Run scheduler, agent and supervisor roles until SIGTERM/SIGINT."""
    if keep_finished and retention is not None:
        raise InputError("--retention and --keep-finished contradict each other: give one")
    if metrics_host is not None and metrics_port is None:
        raise InputError("--metrics-host needs --metrics-port: the port to serve the metrics on")
    host = _metrics_host(metrics_host)
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
    # store is opened (by the worker, as it starts): a refused command must not have created or
    # migrated it.
    w = Worker(app, settings, db=store_url(ctx, app))
    if metrics_port is not None:
        try:
            from .metrics import start_worker_metrics
        except ImportError as e:  # the machine lacks a package, not bad input: exit 1, as `dashboard`
            raise StepwardenError(
                f"--metrics-port needs the extra: pip install 'stepwarden[dashboard]' ({missing_what(e)})"
            ) from None
        shown = bracketed(host)
        try:
            served = start_worker_metrics(w, metrics_port, host)
        except OSError as e:
            why = f"cannot serve metrics on {shown}:{metrics_port} (--metrics-host, --metrics-port)"
            if isinstance(e, socket.gaierror) and e.errno != socket.EAI_AGAIN:
                raise InputError(f"{why}: {host!r} does not resolve ({e.strerror or e})") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise InputError(f"{why}: {e.strerror}; give an address of this machine") from None
            fail(f"{why}: {e.strerror or e}")
        w.metrics = served.metrics
        click.echo(said(f"worker metrics on {served.url}"), err=True)
        if not is_loopback(host):  # as the dashboard warns: these metrics ask for no token
            line = said(f"metrics served on {shown}, beyond this machine, to anyone", "warning")
            click.echo(line, err=True)
    # Last, after the app has closed (the callbacks run in reverse), once the worker has run: the
    # stop signals stay ignored through the interpreter's own shutdown (which would set Python's
    # handlers back to the default: a signal then ended a stopped worker with 143 or 130) when
    # this is the process's command; run in-process (by a test, say), they are set back as they were.
    ran: list[bool] = []
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # before asyncio.run's own SIGINT
    ctx.call_on_close(lambda: _after_the_worker(before) if ran else None)
    ctx.call_on_close(app.close)

    async def main() -> bool:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.set_default_executor(UnjoinedExecutor(thread_name_prefix=DEFAULT_EXECUTOR_PREFIX))
        signals = _StopSignals(w, stop)
        # Before the worker opens the store: a stop signal while it opens stops it there (the
        # opening waits in a thread, this loop free to run the handler).
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, signals.received, sig.name)
        die_with_parent()  # started by the demo: its SIGKILL is this worker's SIGTERM
        failure: BaseException | None = None
        try:
            return await w.run(stop)
        except BaseException as e:
            failure = e
            raise
        finally:
            # Stopped: what is left is closing the loop and the store (which lets a stop write
            # past its bound finish in its thread). A signal now (a second one, late, or GNU
            # timeout's repeat) fell on the default handlers once the loop closed, and the stop
            # that had completed exited 143 or 130: from here on the stop signals are ignored.
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)
            # The process ends now, stopped or failed: nothing an operation left may hold it.
            if _COMMAND:
                watch.start(0 if failure is None else 1)
            await _end_left_tasks(failure)

    watch = _ExitWatch()
    try:
        started = asyncio.run(main())
    finally:
        watch.loop_closed.set()
    ran.append(True)
    if not started:
        # Stopped while it opened the store or recorded its workflows (it says so): that may
        # still wait, for a lock or a server, in a thread; the exit ends it, and it commits whole
        # or not at all.
        _exit_now(0)
    _exit_despite_stuck_threads()


# How long a stopped worker waits for the tasks and threads its operations left running.
LEFT_RUNNING_JOIN = 1.0


async def _end_left_tasks(failure: BaseException | None) -> None:
    """Cancel the tasks still running once the worker has stopped, and wait for them a moment:
    ``asyncio.run`` then cancels them too, but waits for them with no bound, and an async
    operation that swallows its cancellation (``except BaseException: continue``) kept a worker
    that had logged ``stopped`` alive, its stop signals ignored, until the operation chose to
    end (found by review). Such a task left past the wait is named in a warning, and the process
    exits at once, as for a thread that cannot be interrupted: 0, or after ``failure``'s one
    error line, 1 (2 for bad input), as the command would have."""
    me = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for t in left:
        t.cancel()
    if not left:
        return
    _, pending = await asyncio.wait(left, timeout=LEFT_RUNNING_JOIN)
    if not pending or not _COMMAND:
        return
    log.warning(
        "exiting with %d task(s) still running that ignored their cancellation (%s); their"
        " results are discarded",
        len(pending),
        ", ".join(sorted(t.get_name() for t in pending)[:5]),
    )
    if failure is None:
        _exit_now(0)
    _exit_now(_say_error(failure))


def _say_error(e: BaseException) -> int:
    """The one ``error:`` line of an error the command ends with; its exit code: 2 for bad input,
    1 for anything else (one that is not ours shows its type, never a traceback)."""
    text = str(e) if isinstance(e, StepwardenError) else f"{type(e).__name__}: {e}"
    click.echo(said(_one_line(text), "error"), err=True)
    return 2 if isinstance(e, InputError | NotFound) else 1


# How long a stopped worker's process may take to end before a watch says what holds it and ends
# it: held by a thread (an operation's) or by its event loop's tasks, EXIT_WITHIN; held by the
# interpreter's own shutdown (atexit handlers, an OpenTelemetry exporter's flush), EXIT_SHUTDOWN.
EXIT_WITHIN = 5.0
EXIT_SHUTDOWN = 60.0


class _ExitWatch:
    """Watch the end of a stopped (or failed) worker's process from a daemon thread. A thread an
    operation started (``threading.Thread``, its own ``ThreadPoolExecutor`` with a call running)
    kept a worker that had logged ``stopped`` alive for good, its stop signals ignored, as the
    interpreter waited to join it (found by review). Past :data:`EXIT_WITHIN`, such a thread, or
    a loop that has not closed, is named and the process exits with ``code``; an exit held by
    the interpreter's shutdown alone (an atexit handler flushing spans) is given until
    :data:`EXIT_SHUTDOWN`, so that a flush that takes a few seconds still happens."""

    def __init__(self) -> None:
        self.loop_closed = threading.Event()

    def start(self, code: int) -> None:
        threading.Thread(target=self._watch, args=(code,), name="stepwarden-exit-watch", daemon=True).start()

    def _watch(self, code: int) -> None:
        time.sleep(EXIT_WITHIN)
        held = sorted(
            t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
        )
        if held or not self.loop_closed.is_set():
            what = f"thread(s) {', '.join(held[:5])}" if held else "its event loop's tasks"
            self._exit(EXIT_WITHIN, what, code)
        time.sleep(EXIT_SHUTDOWN - EXIT_WITHIN)
        self._exit(EXIT_SHUTDOWN, "its shutdown (an atexit handler)", code)

    @staticmethod
    def _exit(after: float, what: str, code: int) -> None:
        log.warning(
            "the worker stopped %gs ago and its process has not ended, held by %s; exiting now", after, what
        )
        _exit_now(code)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The first stop signal again this soon is the same stop, delivered twice: GNU timeout, for one,
# signals the process and then its process group. An operator's second signal comes later, or is
# the other one (SIGINT after SIGTERM).
REPEAT_WINDOW = 0.25


class _StopSignals:
    """A worker's SIGTERM and SIGINT, from the moment it starts: the first stops it gracefully
    (or, while it opens the store or records its workflows, at once), a second one hurries it
    (:meth:`Worker.hurry`), unless it is the first one again within :data:`REPEAT_WINDOW` on
    ``clock``'s monotonic time."""

    def __init__(self, w: Worker, stop: asyncio.Event, clock: Clock = SYSTEM_CLOCK) -> None:
        self.w = w
        self.stop = stop
        self.clock = clock
        self.first: tuple[str, float] | None = None  # the first signal's name, and when it came

    def received(self, name: str) -> None:
        now = self.clock.monotonic()
        if self.first is None:
            self.first = (name, now)
            log.info(
                "worker %s: %s: stopping gracefully; a second SIGTERM or SIGINT stops it without"
                " waiting for running calls",
                self.w.identity,
                name,
            )
            self.w.stopped_by = name
            self.stop.set()
        elif name != self.first[0] or now - self.first[1] >= REPEAT_WINDOW:
            self.w.hurry()


# The worker loop's default executor (``asyncio.to_thread``, ``run_in_executor(None, ...)`` in an
# async operation or sink): its threads are named so that the exit sees them (below).
DEFAULT_EXECUTOR_PREFIX = "stepwarden-agent-default"
# How long the loop's close waits for the default executor's idle threads to end.
EXECUTOR_IDLE_JOIN = 0.5


class UnjoinedExecutor(ThreadPoolExecutor):
    """The worker loop's default executor. ``asyncio.run`` waits for its threads, with no bound,
    when the loop closes: an async operation that handed a blocking call to a thread
    (``asyncio.to_thread``) held a stopped worker's process until the call returned, for good if
    it never did, and a second signal changed nothing. Its shutdown waits only for idle threads,
    briefly; a call still running is left to its thread, which the exit ends, as a plain
    function's (:func:`_exit_despite_stuck_threads`)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=True)
        if wait:
            end = time.monotonic() + EXECUTOR_IDLE_JOIN
            for t in threading.enumerate():
                if t.name.startswith(DEFAULT_EXECUTOR_PREFIX):
                    t.join(max(0.0, end - time.monotonic()))


def _after_the_worker(before: Mapping[signal.Signals, Any]) -> None:
    """The stop signals once the worker's command is done: still ignored if the process is
    ending (:data:`_COMMAND`), else as they were before it ran."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        if not _COMMAND and before.get(sig) is not None:
            signal.signal(sig, before[sig])


def _exit_now(code: int) -> NoReturn:
    """Exit at once, after the log and the output are flushed: threads still waiting (for a
    lock, in an operation that cannot be interrupted) do not hold the process."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# One label of a host name (RFC 1123): letters, digits and inner hyphens, up to 63 characters.
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _metrics_host(value: str | None) -> str:
    """``--metrics-host``: an IP address (an IPv6 one with or without brackets) or a host name,
    checked before anything starts, so a mistyped one is exit 2 with one line and no store
    created. Whether it is an address of this machine is found when binding."""
    if value is None:
        return "127.0.0.1"
    host = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise InputError(f"--metrics-host {value[:80]!r} is not an IP address or a host name")
    return host


def _exit_despite_stuck_threads() -> None:
    """A plain-function operation cannot be interrupted; once the worker has released its
    attempts and resigned, do not let such a thread keep the process alive past SIGTERM."""
    # Ours only, daemon (the agents' and plain sinks' pools, daemon_pool.py) or not (the loop's
    # default executor, UnjoinedExecutor). Exiting at once, not as the interpreter does: a daemon
    # thread still writing (to stderr, a log) as the interpreter finalizes can abort it, and the
    # exit code would no longer be 0 (DEP4).
    stuck = [
        t
        for t in threading.enumerate()
        if t is not threading.main_thread()
        and t.is_alive()
        and t.name.startswith(("stepwarden-agent", SINK_THREAD_PREFIX))
    ]
    if not stuck:
        return
    log.warning(
        "exiting with %d operation or alert-sink thread(s) still running; their results are discarded",
        len(stuck),
    )
    _exit_now(0)


# How much larger than the input limit the text as written may be: the limit applies to the input's
# compact JSON, as ``App.submit`` measures it, and a file written by ``jq .`` or an editor carries
# indentation, spaces and \u escapes that the compact form drops.
RAW_INPUT_FACTOR = 8


def _read_input(value: str, limit: int = DEFAULT_MAX_INPUT_BYTES) -> Any:
    """Inline JSON, ``@FILE`` or ``-`` (stdin). The size limit is the compact JSON's, checked at
    submission; the text as written is read up to :data:`RAW_INPUT_FACTOR` times the limit, plus
    one byte, so a device or a pipe that never ends is refused instead of filling memory."""
    raw = limit * RAW_INPUT_FACTOR
    where = "standard input"
    if value == "-":
        if sys.stdin is None:  # started with standard input closed (<&-)
            raise InputError("--input -: standard input is closed")
        data = sys.stdin.buffer.read(raw + 1)
    elif value.startswith("@"):
        where = f"input file {value[1:]!r}"
        try:
            with open(value[1:], "rb") as f:
                data = f.read(raw + 1)
        except OSError as e:
            raise InputError(f"cannot read {where}: {e.strerror}") from None
    else:
        return parse_input(value, raw)
    if len(data) > raw:
        raise InputError(
            f"task input from {where} is over {raw} bytes as written, far over the limit of"
            f" {limit} bytes (of its compact JSON)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{where} is not UTF-8 text") from None
    return parse_input(text, raw)


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
    app = _load_app(app_ref) if app_ref else App()
    data = _read_input(input_, app.max_input_bytes)  # with --app, that app's limit (SUB4)
    app._prepare(
        workflow, data, correlation_id, idempotency_key, priority, reply_to
    )  # validate before opening
    if app_ref is not None and workflow not in app.workflows:
        # Refused before the store is opened: --app creates and migrates it, and bad input writes nothing.
        known = ", ".join(sorted(app.workflows)) or "none"
        raise UnknownWorkflow(f"unknown workflow {workflow!r}; this app defines: {known}")
    app.own_workflow(workflow)  # its operations on the app's agents, before the store is opened
    app.use_store(open_for(ctx, create=app_ref is not None, app=app))
    echo(
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
    from .demo.runner import DemoOptions, DemoStopped, run_demo

    # Only a store named on this command line: $STEPWARDEN_DB may well name a real store, whose
    # own workers would take the demo's steps (and the demo's orders would stay in it).
    if demo_db == "":
        raise InputError("--db is empty: give a store URL, or leave the option out for a fresh file")
    given = ctx.parent is not None and ctx.parent.get_parameter_source("db") == ParameterSource.COMMANDLINE
    db = demo_db or (ctx.obj["db"] if given else None)
    if db is None and os.environ.get("STEPWARDEN_DB"):
        note = said("the demo runs on a fresh SQLite file, not $STEPWARDEN_DB (--db chooses)", "note")
        click.echo(note, err=True)
    opts = DemoOptions(
        db=db,
        orders=orders,
        workers=workers,
        chaos=not no_chaos,
        as_json=as_json,
        seed=seed,
    )
    try:
        ok = run_demo(opts)
    except DemoStopped as e:  # SIGTERM or SIGHUP: every process it started is stopped
        click.echo(said(_one_line(str(e)), "error"), err=True)
        ctx.exit(128 + e.signum)  # as a shell reports a process ended by that signal
    if not ok:
        # The summary (stdout) says what failed; stderr has its one line, as for every failure.
        click.echo(said("the demo's ledger check failed: see the summary for what", "error"), err=True)
        ctx.exit(1)
    ctx.exit(0)


from .dashboard.command import dashboard as _dashboard  # noqa: E402 - click only; the extra loads lazily

cli.add_command(_dashboard)


# Whether this process is the ``stepwarden`` command itself (its command line, not ``argv`` given
# by a caller in-process): a worker's command then leaves the stop signals ignored as it ends.
_COMMAND = False


def main(argv: list[str] | None = None) -> None:
    global _COMMAND
    _COMMAND = argv is None
    run(cli, argv, "stepwarden")


def run(group: click.Group, argv: list[str] | None, prog_name: str) -> None:
    """Run a command line of ours with its errors as one ``error:`` line and exit codes 2 (bad
    input) or 1 (anything else), never click's ``Error:`` block or a traceback: ``stepwarden``
    itself, and ``python -m stepwarden.dashboard``.

    A reader of standard output that went away (``| head``: :class:`ReaderGone`) ends the
    command quietly with exit 0, whatever it was doing: what it had done stays done (a
    submitted task is submitted), and the reader had what it wanted (docs/cli.md)."""
    try:
        _run(group, argv, prog_name)
    except ReaderGone:
        _stdout_to_devnull()
        sys.exit(0)


def _stdout_to_devnull() -> None:
    """Point standard output at /dev/null: what its buffer still holds is flushed again at exit,
    and to the closed pipe that would fail again (Python then says "Exception ignored" on stderr
    and exits 120)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no descriptor of its own (an in-process runner)
        pass


def _run(group: click.Group, argv: list[str] | None, prog_name: str) -> None:
    try:
        # Outside standalone mode click hands back the code of a ``ctx.exit(N)`` instead of
        # exiting with it (the demo's failed check exits 1 that way).
        code = group.main(args=argv, prog_name=prog_name, standalone_mode=False)
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            sys.exit(code)
    except click.exceptions.Abort:  # Ctrl-C (click turns KeyboardInterrupt into Abort)
        click.echo(said("interrupted", "error"), err=True)
        sys.exit(130)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.NoArgsIsHelpError as e:  # a group without its command: show its help
        echo(e.ctx.get_help() if e.ctx is not None else e.format_message())
        sys.exit(0)
    except click.UsageError as e:
        click.echo(said(_one_line(e.format_message()), "error"), err=True)
        sys.exit(2)
    except click.ClickException as e:
        click.echo(said(_one_line(e.format_message()), "error"), err=True)
        sys.exit(e.exit_code)
    except StepwardenError as e:
        sys.exit(_say_error(e))
    except KeyboardInterrupt:
        sys.exit(130)
    except ReaderGone:
        raise  # for run(): not an error
    except Exception as e:  # one line, never a traceback, for anything we did not foresee
        code = _say_error(e)
        if os.environ.get("STEPWARDEN_DEBUG"):
            raise
        sys.exit(code)
