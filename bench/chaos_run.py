"""One chaos run from start to end (``execute``): the store, the services, the workers, the
injection window and the wait for every task to end, then the report; every process it starts is
ended here."""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from chaos_common import (
    FINAL,
    Options,
    Reader,
    is_loopback,
    leader_row,
    log_line,
    now,
    pruned_total,
    with_port,
)
from chaos_faults import Injector, PlannedFault, plan_faults
from chaos_procs import ProxyProc, ServicesProc, Submitter, Workers, layout
from chaos_report import build_report
from chaos_tracker import Operator, Tracker


@dataclass
class Run:
    o: Options
    workdir: Path
    store_kind: str
    direct_url: str = ""
    worker_url: str = ""
    pg: Any = None
    services: ServicesProc | None = None
    proxy: ProxyProc | None = None
    workers: Workers | None = None
    store: Any = None
    reader: Reader | None = None
    tracker: Tracker | None = None
    operator: Operator | None = None
    events_before: int = 0  # events in the store before the run (a reused --db)
    pruned_before: int = 0  # event_totals' sum before the run
    notes: list[str] = field(default_factory=list)


def _start_db(run: Run) -> None:
    o = run.o
    if run.store_kind == "sqlite":
        run.direct_url = o.db or f"sqlite:///{run.workdir / 'chaos.db'}"
        if not run.direct_url.startswith("sqlite:///"):
            raise SystemExit("--store sqlite needs a sqlite:/// URL")
        run.worker_url = run.direct_url
        return
    if o.db:
        run.direct_url = o.db
        if not run.direct_url.startswith(("postgresql://", "postgres://")):
            raise SystemExit("--store postgres needs a postgresql:// URL")
        if "restart" in o.faults:
            run.notes.append("restart: not injected, the server named by --db is not ours to restart")
    else:
        import psycopg

        from stepwarden.testing.postgres import LocalPostgres

        run.pg = LocalPostgres(run.workdir / "pg" / "data").start()
        with psycopg.connect(run.pg.url(), autocommit=True) as c:
            c.execute("CREATE DATABASE chaos")
        run.direct_url = run.pg.url("chaos")
    run.worker_url = run.direct_url
    if "proxy" in o.faults:
        host = urlsplit(run.direct_url).hostname
        port = urlsplit(run.direct_url).port or 5432
        if not is_loopback(host):
            run.notes.append(f"proxy: not used, the server {host} is not on the loopback interface")
        else:
            run.proxy = ProxyProc(run.workdir)
            run.worker_url = with_port(run.direct_url, run.proxy.start(str(host), port))


def enabled_kinds(run: Run) -> list[str]:
    o = run.o
    kinds = []
    if "kill" in o.faults:
        kinds += ["kill", "kill_leader"]
    if "stop" in o.faults:
        kinds += ["stop_leader", "stop_worker"]
    if "term" in o.faults:
        kinds.append("term_leader")
    if "proxy" in o.faults and run.proxy is not None:
        kinds += ["proxy_reset", "proxy_stall"]
    if "restart" in o.faults and run.pg is not None:
        kinds.append("pg_restart")
    return kinds


def execute(o: Options) -> tuple[dict[str, Any], bool]:
    """Run the whole thing; returns (report, ok). Every process started here is ended here."""
    from stepwarden.demo.app import app
    from stepwarden.leader import LeaseSettings
    from stepwarden.store import open_store
    from stepwarden.store.core import _register
    from stepwarden.supervisor import SupervisorSettings

    lease = LeaseSettings()
    sup = SupervisorSettings()
    # The harness's own pool (submissions) complains on every reconnect during a restart; the
    # report counts what matters.
    pool_log = logging.getLogger("psycopg.pool")
    pool_level = pool_log.level
    pool_log.setLevel(logging.CRITICAL)
    workdir = Path(o.workdir) if o.workdir else Path(tempfile.mkdtemp(prefix=f"stepwarden-chaos-{o.store}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = Run(o, workdir, o.store)
    ok = False
    report: dict[str, Any] = {}
    try:
        _start_db(run)
        run.services = ServicesProc(o, workdir)
        services_url = run.services.start()
        run.store = open_store(run.direct_url)
        run.store.transact_sync(_register, list(app.workflows.values()), "chaos")
        app.use_store(run.store)
        run.reader = reader = Reader(run.direct_url)
        first_event = int(reader.rows("SELECT COALESCE(MAX(id), 0) AS m FROM events")[0]["m"])
        run.events_before = int(reader.rows("SELECT COUNT(*) AS n FROM events")[0]["n"])
        run.pruned_before = pruned_total(reader)
        run_started = now()
        env = dict(os.environ, STEPWARDEN_DEMO_SERVICES=services_url, PYTHONUNBUFFERED="1")
        env.pop("STEPWARDEN_DB", None)
        run.workers = workers = Workers(o, workdir, run.worker_url, env)
        for slot in workers.slots:
            workers.start(slot)
        _wait_ready(run)
        report = _drive(run, first_event, run_started, lease, sup)
        ok = bool(report["ok"])
        return report, ok
    finally:
        _teardown(run, ok)
        pool_log.setLevel(pool_level)


def _wait_ready(run: Run) -> None:
    assert run.workers is not None and run.reader is not None
    end = time.monotonic() + 60
    while time.monotonic() < end:
        run.workers.check(restart=False)
        rows = (
            run.reader.try_rows(
                "SELECT id FROM workers WHERE id LIKE ? AND stopped_at IS NULL", ("chaos-w%",)
            )
            or []
        )
        if len(rows) >= len(run.workers.slots) and leader_row(run.reader) is not None:
            return
        if run.workers.unexpected:
            raise RuntimeError(f"a worker failed to start: {run.workers.unexpected[0]}")
        time.sleep(0.2)
    raise RuntimeError("the workers did not register and elect a leader within 60 s")


def _drive(run: Run, first_event: int, run_started: float, lease: Any, sup: Any) -> dict[str, Any]:
    from stepwarden.demo.app import app

    o = run.o
    assert run.workers is not None and run.reader is not None and run.services is not None
    workers, reader = run.workers, run.reader
    rng = random.Random(o.seed)
    prefix = f"chaos-{secrets.token_hex(3)}-"
    total, rate = o.order_plan()
    kinds = enabled_kinds(run)
    stop_hold_max = lease.ttl + 3.0
    plan = plan_faults(random.Random(o.seed * 7919 + 1), kinds, o.duration, o.fault_every, stop_hold_max)
    injector = Injector(o, rng, workers, reader, run.proxy, run.pg, lease.ttl)
    log_line(
        o,
        f"{o.store}: {len(workers.slots)} workers {layout(o.workers)}, {total} orders at {rate:.2f}/s over "
        f"{o.duration:g}s, {len(plan)} faults planned ({', '.join(kinds) or 'none'}); workdir {run.workdir}"
        + (f"; retention {o.retention:g}s" if o.retention is not None else "")
        + (f"; an operator action every {o.operator_every:g}s" if o.operator_every else ""),
    )
    run.tracker = tracker = Tracker(run.direct_url, prefix, first_event, run_started)
    tracker.start()
    t0_mono = time.monotonic()
    injector.t0 = t0 = now()
    window_end = t0_mono + o.duration
    submitter = Submitter(app, prefix, total, rate, o.seed, window_end)
    submitter.start()
    if o.operator_every:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("STEPWARDEN_DB", None)
        run.operator = Operator(o, run.direct_url, env, tracker, o.seed * 104729 + 3, window_end, t0)
        run.operator.start()
    queue = [PlannedFault(t0_mono + off, kind, t0_mono + off + 12.0) for off, kind in plan]
    next_progress = t0_mono + 5
    for _ in range(int(o.duration * 50) + 1000):  # bounded: one pass per ~20 ms of the window
        t = time.monotonic()
        if t >= window_end:
            break
        injector.run_due()
        for pf in [p for p in queue if p.due <= t]:
            if injector.try_inject(pf.kind):
                queue.remove(pf)
            elif t >= pf.give_up:
                injector.skipped[pf.kind] += 1
                queue.remove(pf)
            else:
                pf.due = t + 0.25
        workers.check()
        if t >= next_progress:
            next_progress = t + max(5.0, o.duration / 60)
            _progress(o, reader, prefix, submitter, injector, tracker, t - t0_mono)
        time.sleep(0.02)
    injector.skipped.update(p.kind for p in queue)
    injected_until = now()
    if run.operator is not None:
        run.operator.halt.set()
        run.operator.join(timeout=90)  # an action in progress ends within its 60 s timeout
    injector.flush()
    submitter.halt.set()
    submitter.join(timeout=60)
    submitter.halt.clear()
    submitter.retry_unacked(time.monotonic() + 30)
    log_line(o, f"injection over: {len(injector.faults)} faults; waiting up to {o.settle:g}s for every task")
    settle_start = time.monotonic()
    settle_end = settle_start + o.settle
    while time.monotonic() < settle_end:
        workers.check()
        rows = reader.try_rows(
            "SELECT id, state FROM tasks WHERE substr(correlation_id, 1, ?) = ?", (len(prefix), prefix)
        )
        if rows is not None and all(r["state"] in FINAL for r in rows):
            # Every acknowledged order's task is final in the store, or was seen final and pruned.
            stored = {int(r["id"]) for r in rows}
            seen = tracker.seen_terminal()
            if all(tid in stored or tid in seen for tid in submitter.acked.values()):
                break
        time.sleep(0.5)
    settled_s = time.monotonic() - settle_start
    workers.check(restart=False)
    workers.stop_all()
    end_wall = now()
    tracker.finish()  # its last, full read: nothing moves any more
    effects = _ledger(run)
    report = build_report(
        run,
        prefix,
        first_event,
        run_started,
        t0,
        injected_until,
        end_wall,
        settled_s,
        submitter,
        injector,
        plan,
        effects,
        lease,
        sup,
    )
    return report


def _progress(
    o: Options, reader: Reader, prefix: str, sub: Submitter, inj: Injector, tracker: Tracker, elapsed: float
) -> None:
    rows = reader.try_rows(
        "SELECT id, state FROM tasks WHERE substr(correlation_id, 1, ?) = ?", (len(prefix), prefix)
    )
    final = sum(1 for r in rows or [] if r["state"] in FINAL)
    pruned = len(tracker.seen_terminal() - {int(r["id"]) for r in rows or []}) if rows is not None else 0
    log_line(
        o,
        f"t={elapsed:5.1f}s submitted {len(sub.acked)} (retrying {len(sub.unacked)}), final {final}"
        + (f" (and {pruned} pruned)" if pruned else "")
        + f", in flight {len(rows or []) - final}, faults {len(inj.faults)}"
        + ("" if rows is not None else " (store unreachable)"),
    )


def _ledger(run: Run) -> dict[str, dict[str, object]]:
    from stepwarden.demo.ledger import fetch_ledger

    assert run.services is not None
    return fetch_ledger(run.services.url, timeout=30)


def _stop_threads(run: Run) -> None:
    """The operator and the tracker, if a failure left them running (each ends on its own flag)."""
    if run.operator is not None and run.operator.is_alive():
        run.operator.halt.set()
        run.operator.join(timeout=90)
    if run.tracker is not None and run.tracker.is_alive():
        run.tracker.finish()


def _teardown(run: Run, ok: bool) -> None:
    for step in (
        lambda: _stop_threads(run),
        lambda: run.workers.stop_all() if run.workers else None,
        lambda: run.services.stop() if run.services else None,
        lambda: run.proxy.stop() if run.proxy else None,
        lambda: run.reader.close() if run.reader else None,
        lambda: run.store.close() if run.store else None,
        lambda: run.pg.stop("immediate") if run.pg else None,
    ):
        try:
            step()
        except Exception as e:  # keep tearing down the rest
            print(f"[chaos] teardown: {e!r}", file=sys.stderr)
    if (ok and not run.o.keep) and not run.o.workdir:
        shutil.rmtree(run.workdir, ignore_errors=True)
    else:
        log_line(run.o, f"kept {run.workdir} (worker logs in logs/)")
