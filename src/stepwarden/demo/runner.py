"""``stepwarden demo``: start the fake services and several workers, submit orders, kill a worker
mid-run, and check the services' ledgers against the store's final states (SPEC section 4)."""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..errors import InputError, StepwardenError
from ..logs import safe_text
from ..parent import PARENT_PID
from ..store import FINAL_TASK_STATES, Store, open_store, views
from ..store.base import redact_url
from ..store.core import _register
from ..supervisor import SupervisorSettings
from .ledger import OrderOutcome, check_ledger, fetch_ledger

WORKFLOW = "process-order"
# Signals that stop the demo in order: the processes it started are stopped, by pid, before it
# exits. SIGINT (Ctrl-C) stays Python's KeyboardInterrupt, unwinding the same way; it reaches the
# children too, as the terminal sends it to the whole process group.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class DemoStopped(Exception):
    """The demo was stopped by a signal before it finished; the processes it started were stopped."""

    def __init__(self, signum: int, workdir: str) -> None:
        self.signum = signum
        self.workdir = workdir
        name = signal.Signals(signum).name
        super().__init__(
            f"the demo was stopped by {name} before it finished; its workers and services were"
            f" stopped (its files are in {workdir})"
        )


class _Signals:
    """SIGTERM and SIGHUP, noted by their handler and acted on by the demo's own flow at its next
    :meth:`check`: an exception raised from the handler itself could land anywhere, between a
    process's start and its being recorded, say, and leave that process running."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers (the demo run from a library's thread)
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum

    def check(self) -> None:
        if self.received is not None:
            raise DemoStopped(self.received, self.workdir)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass(frozen=True)
class DemoOptions:
    db: str | None = None
    orders: int = 200
    workers: int = 3
    chaos: bool = True
    as_json: bool = False
    seed: int = 7
    transient_rate: float = 0.08
    hang_rate: float = 0.02
    permanent_rate: float = 0.02
    timeout: float | None = None


class _Procs:
    """The processes the demo started, ended by pid and only by pid."""

    def __init__(self, workdir: str, env: dict[str, str], db: str) -> None:
        self.workdir = workdir
        self.env = env
        self.db = db
        self.workers: list[subprocess.Popen[bytes]] = []
        self.logs: list[IO[bytes]] = []
        self.services: subprocess.Popen[str] | None = None

    def start_services(self, o: DemoOptions) -> str:
        self.services = subprocess.Popen(
            env=self.env,
            args=[
                sys.executable,
                "-m",
                "stepwarden.demo.services",
                "--port",
                "0",
                "--seed",
                str(o.seed),
                "--transient-rate",
                str(o.transient_rate),
                "--hang-rate",
                str(o.hang_rate),
                "--permanent-rate",
                str(o.permanent_rate),
                "--hang-seconds",
                "20",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.services.stdout is not None
        line = self.services.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"the demo services did not start (said {line!r})")
        return line.removeprefix("listening on ")

    def start_worker(self) -> subprocess.Popen[bytes]:
        n = len(self.workers) + 1
        log = open(os.path.join(self.workdir, f"worker-{n}.log"), "ab")  # noqa: SIM115 - closed in stop()
        self.logs.append(log)
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stepwarden",
                "--log-level",
                "WARNING",
                "worker",
                "--app",
                "stepwarden.demo.app:app",
                "--name",
                f"demo-w{n}",
            ],
            stdout=log,
            stderr=log,
            # The store in the environment, not on the command line, where every local user
            # reads it (a PostgreSQL URL's password); the demo's app follows STEPWARDEN_DB.
            env={**self.env, "STEPWARDEN_DB": self.db},
        )
        self.workers.append(p)
        return p

    def stop(self, *, at_once: bool = False) -> None:
        """Stop every process started, by pid: the workers gracefully, or with ``at_once`` (the
        demo interrupted) without waiting for their running calls (SIGTERM, then SIGINT: a
        worker's second stop signal; two of the same kind could merge into one)."""
        for p in self.workers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                if at_once:
                    p.send_signal(signal.SIGINT)
        end = time.monotonic() + 15
        for p in self.workers:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.services is not None and self.services.poll() is None:
            self.services.send_signal(signal.SIGTERM)
            try:
                self.services.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.services.kill()
                self.services.wait()
        if self.services is not None and self.services.stdout is not None:
            self.services.stdout.close()  # the pipe it announced its port on (a ResourceWarning)
        for log in self.logs:
            log.close()


def run_demo(o: DemoOptions) -> bool:
    run_id = secrets.token_hex(3)
    prefix = f"order-{run_id}-"
    # A store named by --db is opened first: one that cannot be, fails before any folder or
    # process exists.
    given = open_store(o.db) if o.db else None
    if given is not None:
        try:
            _refuse_unfinished(given)
        except BaseException:
            given.close()
            raise
    workdir = tempfile.mkdtemp(prefix="stepwarden-demo-")
    db = o.db or f"sqlite:///{os.path.join(workdir, 'demo.db')}"
    store = given or open_store(db)
    out = Console(stderr=o.as_json)
    show_live = not o.as_json or sys.stderr.isatty()
    env = dict(os.environ)
    env[PARENT_PID] = str(os.getpid())  # its workers and services end with it, even on SIGKILL
    procs = _Procs(workdir, env, db)
    signals = _Signals(workdir)
    signals.install()
    try:
        ok = _run(o, store, prefix, workdir, procs, out, show_live, signals)
    except BaseException:  # stopped by a signal, Ctrl-C, a failure: the run is abandoned
        procs.stop(at_once=True)
        raise
    else:
        procs.stop()
    finally:
        store.close()
        signals.restore()
    signals.check()  # one that came during the summary or the stop: still stopped by it
    return ok


def _unfinished(tx: Any) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = tx.sql(
        "SELECT workflow, COUNT(*) AS n FROM tasks WHERE state IN ('pending', 'processing', 'compensating')"
        " GROUP BY workflow ORDER BY workflow"
    )
    return rows


def _refuse_unfinished(store: Store) -> None:
    """A store given with ``--db`` that holds unfinished tasks is refused before anything starts:
    the demo's workers would run them (another application's steps, through the demo's agents,
    or an interrupted demo's orders against this run's services, whose effects the ledger check
    then counted as belonging to no order, and failed). Tasks in ``error`` wait for an operator
    and are left alone."""
    rows = store.transact_sync(_unfinished)
    if not rows:
        return
    total = sum(int(r["n"]) for r in rows)
    which = ", ".join(f"{int(r['n'])} of {safe_text(str(r['workflow']))}" for r in rows)
    raise InputError(
        f"the store {redact_url(store.url)} has {total} unfinished task(s) ({which}): the demo's"
        " workers would run them, and its ledger check would count their effects; give the demo"
        " a store of its own (leave out --db for a fresh one), or let the tasks finish first"
    )


def _run(
    o: DemoOptions,
    store: Store,
    prefix: str,
    workdir: str,
    procs: _Procs,
    out: Console,
    show_live: bool,
    signals: _Signals,
) -> bool:
    from .app import app

    signals.check()
    url = procs.start_services(o)
    signals.check()
    procs.env["STEPWARDEN_DEMO_SERVICES"] = url
    app.use_store(store)
    store.transact_sync(_register, list(app.workflows.values()), "demo")
    first_event = store.transact_sync(views.max_event_id)
    others = store.transact_sync(views.live_workers, SupervisorSettings().dead_after)
    if others:
        named = ", ".join(escape(safe_text(w)) for w in others[:5]) + (", ..." if len(others) > 5 else "")
        Console(stderr=True).print(  # on stderr, as any warning: --json's stdout stays one object
            f"[yellow]warning[/]: {len(others)} worker(s) not started by the demo are live on this"
            f" store ({named}); they may take the demo's steps, and its ledger check would then fail",
            soft_wrap=True,
            markup=True,
            highlight=False,
        )
    if not o.as_json:
        out.print(
            f"[bold]stepwarden demo[/]: {_count(o.orders, 'order')}, {_count(o.workers, 'worker')},"
            f" store {redact_url(store.url)}",
            soft_wrap=True,
        )
        out.print(
            f"services at {url} (transient {o.transient_rate:.0%}, hang {o.hang_rate:.0%}, "
            f"permanent {o.permanent_rate:.0%}); worker logs in {workdir}",
            soft_wrap=True,
        )
    for _ in range(o.workers):
        signals.check()
        procs.start_worker()
    rng = random.Random(o.seed)
    t0 = time.monotonic()
    for i in range(o.orders):
        signals.check()
        oid = f"{prefix}{i:05d}"
        order = {
            "order_id": oid,
            "sku": f"SKU-{rng.randint(1, 40)}",
            "quantity": rng.randint(1, 5),
            "amount_cents": rng.randint(100, 50_000),
        }
        app.submit(WORKFLOW, order, correlation_id=oid, idempotency_key=oid)
    deadline = t0 + (o.timeout or max(90.0, o.orders * 0.4))
    chaos_log: list[str] = []
    killed = False
    counts: dict[str, int] = {}

    def view() -> Group:
        done = sum(counts.get(s, 0) for s in FINAL_TASK_STATES)
        ev = store.transact_sync(views.event_counts, first_event)
        t = Table(box=None, show_header=False)
        t.add_row("elapsed", f"{time.monotonic() - t0:5.1f}s", "final", f"{done}/{o.orders}")
        t.add_row(
            "processed", str(counts.get("processed", 0)), "compensated", str(counts.get("compensated", 0))
        )
        t.add_row(
            "error",
            str(counts.get("error", 0)),
            "in flight",
            str(sum(counts.get(s, 0) for s in ("pending", "processing", "compensating"))),
        )
        t.add_row("retries", str(ev.get("retry_scheduled", 0)), "rescued", str(ev.get("rescued", 0)))
        bar = int(30 * done / max(1, o.orders))
        return Group(
            Text("[" + "#" * bar + "." * (30 - bar) + "]"), t, *[Text(c, style="red") for c in chaos_log]
        )

    def line() -> str:
        """The progress as one line, for a log or a pipe, where a live table cannot redraw."""
        ev = store.transact_sync(views.event_counts, first_event)
        moving = sum(counts.get(s, 0) for s in ("pending", "processing", "compensating"))
        return (
            f"{time.monotonic() - t0:6.1f}s  final {sum(counts.get(s, 0) for s in FINAL_TASK_STATES)}"
            f"/{o.orders}  processed {counts.get('processed', 0)}  compensated "
            f"{counts.get('compensated', 0)}  error {counts.get('error', 0)}  in flight {moving}  "
            f"retries {ev.get('retry_scheduled', 0)}  rescued {ev.get('rescued', 0)}"
        )

    # A live table on a terminal; on anything else (a pipe, CI's log) a line every few seconds.
    live = Live(view(), console=out, refresh_per_second=4) if show_live and out.is_terminal else None
    lines = show_live and live is None
    next_line = 0.0
    if live:
        live.start()
    try:
        while time.monotonic() < deadline:
            signals.check()
            counts = store.transact_sync(views.state_counts, prefix)
            final = sum(counts.get(s, 0) for s in FINAL_TASK_STATES)
            _check_alive(procs, workdir)
            # Mid-run: once steps are running (a few orders were all final before a worker had
            # started, and the kill then rescued nothing), a quarter of the orders in.
            running = counts.get("processing", 0) + counts.get("compensating", 0)
            due = final >= o.orders // 4 or time.monotonic() - t0 > 20
            if o.chaos and not killed and running and due:
                chaos_log.append(_kill_one(store, procs))
                procs.start_worker()
                chaos_log.append(f"started a fresh worker (pid {procs.workers[-1].pid})")
                killed = True
                if lines:
                    out.print(*chaos_log[-2:], sep="\n", soft_wrap=True, style="red")
            if live:
                live.update(view())
            elif lines and (time.monotonic() >= next_line or final >= o.orders):
                out.print(line(), soft_wrap=True)
                next_line = time.monotonic() + 2.0
            if final >= o.orders:
                break
            time.sleep(0.25)
    finally:
        if live:
            live.update(view())
            live.stop()
    signals.check()
    elapsed = time.monotonic() - t0
    return _summarise(o, store, url, prefix, first_event, elapsed, chaos_log, out, workdir)


def _check_alive(procs: _Procs, workdir: str) -> None:
    """The services and at least one worker still running, or a :class:`StepwardenError` that
    says which ended: without them the orders cannot end, and the demo waited out its deadline
    (90 s and more) to report them stuck, or failed reading a ledger that was gone."""
    services = procs.services
    if services is not None and services.poll() is not None:
        raise StepwardenError(
            f"the demo's services (pid {services.pid}) exited with code {services.returncode};"
            f" the orders cannot complete (worker logs in {workdir})"
        )
    if procs.workers and all(p.poll() is not None for p in procs.workers):
        codes = ", ".join(f"pid {p.pid}: {p.returncode}" for p in procs.workers)
        raise StepwardenError(
            f"every worker the demo started has exited ({codes}); the orders cannot complete:"
            f" see the logs in {workdir}"
        )


def _kill_one(store: Any, procs: _Procs) -> str:
    """SIGKILL the current supervisor leader if it is ours (a leader change), else the first worker."""
    pids = {p.pid: p for p in procs.workers if p.poll() is None}
    victim = next(iter(pids.values()))
    for lease in store.transact_sync(views.list_leases):
        parts = str(lease.get("holder") or "").split(":")
        if lease["name"] == "supervisor" and len(parts) >= 3 and parts[1].isdigit() and int(parts[1]) in pids:
            victim = pids[int(parts[1])]
    was_leader = any(
        str(x.get("holder") or "").split(":")[1:2] == [str(victim.pid)]
        for x in store.transact_sync(views.list_leases)
        if x["name"] == "supervisor"
    )
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    return f"SIGKILLed worker pid {victim.pid}{' (the supervisor leader)' if was_leader else ''} mid-run"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _calls(effect: dict[str, object]) -> int:
    calls = effect.get("calls", 0)
    return calls if isinstance(calls, int) and not isinstance(calls, bool) else 0


def _summarise(
    o: DemoOptions,
    store: Any,
    url: str,
    prefix: str,
    first_event: int,
    elapsed: float,
    chaos_log: list[str],
    out: Console,
    workdir: str,
) -> bool:
    tasks = store.transact_sync(views.list_tasks, None, None, prefix)
    ev = store.transact_sync(views.event_counts, first_event)
    effects = fetch_ledger(url)
    outcomes = [
        OrderOutcome(order_id=t["correlation_id"], task_id=str(t["id"]), state=t["state"]) for t in tasks
    ]
    report = check_ledger(effects, outcomes)
    by_state: dict[str, int] = {}
    for t in tasks:
        by_state[t["state"]] = by_state.get(t["state"], 0) + 1
    stuck = sum(n for s, n in by_state.items() if s not in FINAL_TASK_STATES)
    lost = (o.orders - len(tasks)) + report.lost
    summary = {
        "orders": o.orders,
        "processed": by_state.get("processed", 0),
        "error": by_state.get("error", 0),
        "compensated": by_state.get("compensated", 0),
        "cancelled": by_state.get("cancelled", 0),
        "stuck": stuck,
        "lost": lost,
        "duplicate_effects": report.duplicate_effects,
        "not_undone": report.not_undone,
        # Attempts retried by the step's policy (after a failed reply or a rescue); the calls a
        # service answered 503 and the agent tried again inside one attempt show in service_calls.
        "retries": ev.get("retry_scheduled", 0),
        "service_calls": sum(_calls(e) for e in effects.values()),
        "rescued": ev.get("rescued", 0),
        "stale_replies": ev.get("stale_reply", 0),
        "compensations": ev.get("step_compensated", 0),
        "alerts": ev.get("error", 0),
        "leader_changes": max(0, ev.get("lease_acquired", 0) - 1),
        "chaos": chaos_log,
        "elapsed_s": round(elapsed, 2),
        "throughput_per_s": round(o.orders / elapsed, 2) if elapsed > 0 else None,
        "ledger_ok": report.ok,
        "ledger_problems": report.problems,
        "store": redact_url(store.url),
        "workdir": workdir,
    }
    ok = stuck == 0 and lost == 0 and report.ok and len(tasks) == o.orders
    summary["ok"] = ok
    if o.as_json:
        print(json.dumps(summary), flush=True)
        return ok
    t = Table(title="summary", show_header=False)
    for k in (
        "orders",
        "processed",
        "error",
        "compensated",
        "stuck",
        "lost",
        "duplicate_effects",
        "retries",
        "service_calls",
        "rescued",
        "stale_replies",
        "compensations",
        "leader_changes",
        "elapsed_s",
        "throughput_per_s",
    ):
        t.add_row(k, str(summary[k]))
    out.print(t)
    if ok:
        out.print(
            "[green]ledger check passed[/]: every processed order applied exactly once, every "
            "compensated order fully undone, nothing stuck",
            soft_wrap=True,
        )
    else:
        wrong = [
            f"{n} {what}"
            for n, what in (
                (stuck, "stuck (not in a final state)"),
                (lost, "lost (no task, or processed with an effect missing)"),
                (report.duplicate_effects, "applied more than once"),
                (report.not_undone, "compensated but not fully undone"),
                (report.wrongly_undone, "processed but undone"),
                (report.unknown_effects, "effects of no known order"),
            )
            if n
        ]
        out.print(f"[red]ledger check FAILED[/]: {'; '.join(wrong) or 'see below'}", soft_wrap=True)
    for p in report.problems:
        out.print(f"  [red]{p}[/]", soft_wrap=True)
    out.print(f"inspect: stepwarden --db {redact_url(store.url)} tasks", soft_wrap=True)
    out.print(f"kept for inspection (delete it when done): {workdir}", soft_wrap=True)
    return ok
