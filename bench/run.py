"""stepwarden's benchmark harness: W1, W2, W3, L1, the raw-SQL floor and the peers, on SQLite and
PostgreSQL, in one run; writes ``bench/results/bench-<date>.json`` and ``.md``.

    .venv/bin/python bench/run.py                 # everything, 3 repetitions (about an hour on 2 cores)
    .venv/bin/python bench/run.py --quick         # W1, W2, L1, floor, submission alone: 1 rep, 1 worker
    .venv/bin/python bench/run.py --workloads w1,floor --stores sqlite --peers none --reps 1

See bench/README.md for what each workload measures and how.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import datetime as dt
import json
import os
import platform
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS_DIR = HERE / ".peers"
sys.path.insert(0, str(HERE))

import calibrate  # noqa: E402
import cpu  # noqa: E402
import floor  # noqa: E402
from peers.common import stop as stop_process  # noqa: E402 - by pid: SIGTERM, SIGKILL after a grace

WORKLOADS = ("w1", "w2", "w3", "l1", "floor", "submit")
STORES = ("sqlite", "postgres")
# Issue 5's throughput goals: stepwarden at this multiple of this peer, per store. Reported against
# what submission alone reaches in the same run, because W1 can go no faster than its submissions.
GOALS = {"sqlite": ("huey", 2.0), "postgres": ("procrastinate", 4.0)}
FINAL = ("processed", "error", "compensated", "cancelled")

# Each peer: what pip installs into its own venv, the stores it runs on, its driver script.
PEERS: dict[str, dict[str, Any]] = {
    "huey": {"pip": ["huey"], "stores": ("sqlite",), "script": "huey_bench.py"},
    "procrastinate": {
        "pip": ["procrastinate", "psycopg[binary]"],
        "stores": ("postgres",),
        "script": "procrastinate_bench.py",
    },
    "dbos": {"pip": ["dbos", "psycopg[binary]"], "stores": ("sqlite", "postgres"), "script": "dbos_bench.py"},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- databases -------------------------------------------------------------------------------------
class Databases:
    """Fresh databases for each measurement: a new SQLite file, or a new PostgreSQL database on a
    throwaway server (``LocalPostgres``, fsync on) or on the server given with ``--postgres``."""

    def __init__(self, work: Path, admin: str | None, need_pg: bool) -> None:
        self.work = work
        self.admin = admin
        self.server: Any = None
        self.n = 0
        if need_pg and admin is None:
            from stepwarden.testing.postgres import LocalPostgres

            log("starting a throwaway PostgreSQL (durable: fsync on)")
            self.server = LocalPostgres(work / "pg", durable=True).start()
            self.admin = self.server.url()

    def fresh(self, store: str, label: str) -> str:
        self.n += 1
        name = re.sub(r"[^a-z0-9_]", "_", f"b{self.n}_{label}".lower())[:60]
        if store == "sqlite":
            folder = self.work / name
            folder.mkdir(parents=True, exist_ok=True)
            return f"sqlite:///{folder / 'store.db'}"
        import psycopg

        assert self.admin is not None
        with psycopg.connect(self.admin, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name}")
            c.execute(f"CREATE DATABASE {name}")
        return self.admin.rsplit("/", 1)[0] + "/" + name

    def drop(self, url: str) -> None:
        """Give the disk back after a measurement (PostgreSQL databases; SQLite files stay in work/)."""
        if not floor.is_pg(url):
            return
        import psycopg

        assert self.admin is not None  # a PostgreSQL URL comes from fresh(), which needs it too
        name = url.rsplit("/", 1)[1].split("?")[0]
        with contextlib.suppress(Exception), psycopg.connect(self.admin, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def server_cpu(self) -> float | None:
        """CPU seconds of the PostgreSQL server this harness started (None for a server given
        with ``--postgres``, whose processes are not ours)."""
        pid = cpu.postmaster_pid(self.server.data_dir) if self.server is not None else None
        return cpu.tree_cpu(pid) if pid is not None else None

    def meter(self, store: str, **groups: Callable[[], float | None]) -> cpu.CpuMeter:
        """CPU of the harness (which submits), of ``groups``, and of the server on PostgreSQL
        (on SQLite the store works inside the other processes)."""
        named = {"cpu_submitter": cpu.harness, **{f"cpu_{k}": v for k, v in groups.items()}}
        if store == "postgres":
            named["cpu_server"] = self.server_cpu
        return cpu.CpuMeter(named)

    def pg_version(self) -> str | None:
        if self.admin is None:
            return None
        import psycopg

        with psycopg.connect(self.admin, autocommit=True) as c:
            row = c.execute("SHOW server_version").fetchone()
            return str(row[0]) if row else None

    def close(self) -> None:
        server, self.server = self.server, None  # once: close() also runs at exit
        if server is not None:
            server.stop()


class Reader:
    """A plain connection for the harness's own reads (never ``BEGIN IMMEDIATE`` on SQLite, so
    polling does not take the writers' lock). ``?`` placeholders on both stores."""

    def __init__(self, url: str) -> None:
        self.pg = floor.is_pg(url)
        if self.pg:
            import psycopg

            self.conn: Any = psycopg.connect(url.split("?")[0], autocommit=True)
        else:
            self.conn = sqlite3.connect(
                floor.sqlite_path(url.split("?")[0]), isolation_level=None, timeout=30
            )

    def all(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if self.pg:
            sql = sql.replace("?", "%s")
        return list(self.conn.execute(sql, params).fetchall())

    def one(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        rows = self.all(sql, params)
        return rows[0][0] if rows else None

    def run(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        if self.pg:
            sql = sql.replace("?", "%s")
        self.conn.execute(sql, params)

    def close(self) -> None:
        self.conn.close()


# -- processes -------------------------------------------------------------------------------------
def start_worker(
    url: str,
    app_ref: str,
    concurrency: int,
    logfile: Path,
    env: dict[str, str] | None = None,
    metrics: bool = False,
) -> subprocess.Popen[bytes]:
    environ = dict(os.environ if env is None else env)
    environ["PYTHONPATH"] = str(HERE) + os.pathsep + environ.get("PYTHONPATH", "")
    out = open(logfile, "ab")  # noqa: SIM115 - closed with the process
    cmd = [
        sys.executable,
        "-m",
        "stepwarden",
        "--db",
        url,
        "--log-level",
        "WARNING",
        "worker",
        "--app",
        app_ref,
    ]
    cmd += ["--concurrency", str(concurrency)]
    if metrics:  # on a port the worker picks and prints (`worker metrics on URL`): see metrics_urls
        cmd += ["--metrics-port", "0"]
    return subprocess.Popen(cmd, env=environ, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT))


@contextlib.contextmanager
def workers(
    url: str,
    n: int,
    app_ref: str,
    concurrency: int,
    work: Path,
    env: dict[str, str] | None = None,
    metrics: bool = False,
) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(n):
            procs.append(start_worker(url, app_ref, concurrency, work / f"worker-{i}.log", env, metrics))
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            stop_process(p)


REPLY_COUNTERS = ("stepwarden_worker_requests_completed_total", "stepwarden_worker_reply_batches_total")


def parse_reply_counters(text: str) -> tuple[float, float]:
    """(replies sent, reply transactions) from one worker's Prometheus text (0 where absent)."""
    got = dict.fromkeys(REPLY_COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in got:
                got[sample.name] += sample.value
    return got[REPLY_COUNTERS[0]], got[REPLY_COUNTERS[1]]


def metrics_urls(logs: list[Path], procs: list[Any], timeout: float = 60) -> list[str]:
    """The metrics URL each worker printed once it was serving (``worker metrics on URL``)."""

    def found() -> list[str] | None:
        urls = [re.search(r"worker metrics on (\S+)", p.read_text(errors="replace")) for p in logs]
        return [m.group(1) for m in urls if m] if all(urls) else None

    return wait_until(found, timeout, every=0.05, procs=procs)


def reply_counters(urls: list[str]) -> tuple[float, float] | None:
    """The workers' replies and reply transactions so far, summed; None, with a line saying why,
    if an endpoint does not answer (the run's other figures stand)."""
    replies = batches = 0.0
    for url in urls:
        try:
            r = httpx.get(url, timeout=5.0)
            r.raise_for_status()
        except httpx.HTTPError as e:
            log(f"  worker metrics at {url} did not answer: {e!r}; no reply-batch figure")
            return None
        a, b = parse_reply_counters(r.text)
        replies, batches = replies + a, batches + b
    return replies, batches


def wait_until(check: Callable[[], T | None], timeout: float, every: float = 0.02, procs: Any = ()) -> T:
    end = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"worker pid {dead[0].pid} exited with code {dead[0].returncode}")
        if time.monotonic() > end:
            raise TimeoutError(f"not done after {timeout:g}s")
        time.sleep(every)


def wait_registered(reader: Reader, procs: list[Any], timeout: float = 60) -> dict[int, str]:
    """Wait until every worker process has recorded itself in ``workers``; returns pid -> identity."""

    def check() -> dict[int, str] | None:
        ids = [r[0] for r in reader.all("SELECT id FROM workers WHERE stopped_at IS NULL")]
        found = {}
        for p in procs:
            mine = [i for i in ids if f":{p.pid}:" in i]
            if mine:
                found[p.pid] = mine[0]
        return found if len(found) == len(procs) else None

    return wait_until(check, timeout, every=0.05, procs=procs)


# -- stepwarden ------------------------------------------------------------------------------------
def open_app(url: str, module: str = "benchapp") -> tuple[Any, Any]:
    """The bench app pointed at a fresh store (migrated here; the workers register the workflows,
    and ``App.submit`` uses the app's own definitions)."""
    import importlib

    from stepwarden.store import open_store

    app = importlib.import_module(module).app
    store = open_store(url)
    app.use_store(store)
    return app, store


def stepwarden_throughput(
    dbs: Databases,
    store_kind: str,
    workload: str,
    n: int,
    nworkers: int,
    concurrency: int,
    prefill: int = 0,
    sync: str | None = None,
    app_module: str = "benchapp",
) -> dict[str, Any]:
    """W1 (workflow ``one``) or W2 (``three``): submit ``n`` tasks one call each while the workers
    run; elapsed from just before the first submit to the last ``processed`` event. ``sync``: a
    SQLite ``synchronous`` other than the default FULL (``?synchronous=NORMAL``). ``app_module``:
    the bench app under another name (``sqlite_queries``: the same app, with timers)."""
    wf = "one" if workload == "w1" else "three"
    steps = 1 if workload == "w1" else 3
    url = dbs.fresh(store_kind, f"sw_{workload}_{nworkers}w{'_pre' if prefill else ''}")
    if sync and store_kind == "sqlite":
        url += f"?synchronous={sync}"
    work = Path(tempfile.mkdtemp(prefix="sw-", dir=dbs.work))
    app, store = open_app(url, app_module)
    reader = Reader(url)
    try:
        with workers(url, nworkers, f"{app_module}:app", concurrency, work, metrics=True) as procs:
            wait_registered(reader, procs)
            urls = metrics_urls([work / f"worker-{i}.log" for i in range(nworkers)], procs)
            warm = [app.submit(wf, {}) for _ in range(4 * nworkers)]
            wait_until(
                lambda: (
                    reader.one(f"SELECT count(*) FROM tasks WHERE id <= ? AND state IN {FINAL}", (max(warm),))
                    >= len(warm)
                ),
                120,
                procs=procs,
            )
            prefill_s = None
            if prefill:
                t = time.monotonic()
                prefill_store(reader, max(warm), prefill)
                prefill_s = round(time.monotonic() - t, 1)
            base = int(reader.one("SELECT max(id) FROM tasks"))
            counted = reply_counters(urls)
            meter = dbs.meter(store_kind, workers=lambda: cpu.process_cpu(p.pid for p in procs))
            meter.start()
            t0 = time.time()
            for _ in range(n):
                app.submit(wf, {})
            submitted = time.time()
            timeout = max(120.0, n * steps / 10)
            wait_until(
                lambda: (
                    reader.one(f"SELECT count(*) FROM tasks WHERE id > ? AND state IN {FINAL}", (base,)) >= n
                ),
                timeout,
                procs=procs,
            )
            used = meter.stop(n)
            end = float(
                reader.one("SELECT max(at) FROM events WHERE kind = 'processed' AND task_id > ?", (base,))
            )
            bad = reader.one("SELECT count(*) FROM tasks WHERE id > ? AND state <> 'processed'", (base,))
            rows = int(reader.one("SELECT count(*) FROM tasks"))
            after = reply_counters(urls) if counted else None
    finally:
        reader.close()
        store.close()
        dbs.drop(url)
    elapsed = end - t0
    out = {
        "elapsed_s": round(elapsed, 3),
        "rate": round(n / elapsed, 1),
        "steps_per_s": round(n * steps / elapsed, 1),
        "submit_rate": round(n / (submitted - t0), 1),
        "not_processed": int(bad),
        "tasks_in_store": rows,
        **used,
    }
    if counted and after and after[1] > counted[1]:
        # With quick calls, near the slots per worker; far below, the slots answer in groups
        # that pay a commit each (the split that AgentSettings.reply_linger prevents).
        out["replies_per_batch"] = round((after[0] - counted[0]) / (after[1] - counted[1]), 2)
    if prefill:
        out["prefill_s"] = prefill_s
    return out


def stepwarden_submit_alone(dbs: Databases, store_kind: str, n: int) -> dict[str, Any]:
    """W1's submissions with no worker running: ``n`` one-step tasks, one ``App.submit`` call
    each, as W1 submits them. W1 ends when its last task is processed, so it cannot pass this
    rate (the workers only add to the machine's load and, on SQLite, to its one write lock)."""
    url = dbs.fresh(store_kind, "sw_submit")
    app, store = open_app(url)
    try:
        # What a worker would do at start: without it the store does not know the workflow.
        asyncio.run(store.register_workflows(list(app.workflows.values()), "bench-harness"))
        for _ in range(20):
            app.submit("one", {})
        meter = dbs.meter(store_kind)
        meter.start()
        t0 = time.perf_counter()
        for _ in range(n):
            app.submit("one", {})
        elapsed = time.perf_counter() - t0
        used = meter.stop(n)
    finally:
        store.close()
        dbs.drop(url)
    return {
        "elapsed_s": round(elapsed, 3),
        "rate": round(n / elapsed, 1),
        "submit_rate": round(n / elapsed, 1),
        "us_per_call": round(elapsed / n * 1e6, 1),
        **used,
    }


def prefill_store(reader: Reader, template: int, n: int, batch: int = 10_000) -> None:
    """Add ``n`` finished tasks to the store by copying every row of one finished task (``template``,
    a processed one-step task) with new ids: tasks, steps, requests, replies, events, messages. Copying
    a real task's rows keeps this right whatever columns the schema grows. Batches of ``batch``
    tasks per transaction; the copies keep the template's (recent) timestamps."""
    pg = reader.pg

    def columns(table: str) -> list[str]:
        if pg:
            rows = reader.all(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
                "AND table_schema = current_schema() ORDER BY ordinal_position",
                (table,),
            )
            return [r[0] for r in rows]
        return [r[1] for r in reader.all(f"PRAGMA table_info({table})")]

    n_req = reader.one("SELECT count(*) FROM requests WHERE task_id = ?", (template,))
    n_rep = reader.one("SELECT count(*) FROM replies WHERE task_id = ?", (template,))
    if n_req != 1 or n_rep != 1:
        raise RuntimeError(
            f"template task {template} has {n_req} requests and {n_rep} replies; expected 1 each"
        )
    done = 0
    while done < n:
        k = min(batch, n - done)
        task_base = int(reader.one("SELECT max(id) FROM tasks"))
        req_base = int(reader.one("SELECT COALESCE(max(id), 0) FROM requests"))
        rep_base = int(reader.one("SELECT COALESCE(max(id), 0) FROM replies"))
        numbers = (
            f"(SELECT generate_series(1, {k}) AS i) AS gen"
            if pg
            else f"(WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {k}) "
            "SELECT i FROM s) AS gen"
        )
        stmts = []
        for table, key in (
            ("tasks", "id"),
            ("steps", "task_id"),
            ("requests", "task_id"),
            ("replies", "task_id"),
            ("events", "task_id"),
            ("messages", "task_id"),
        ):
            cols = columns(table)
            if not cols:
                continue
            out_cols, exprs = [], []
            for c in cols:
                if (table == "tasks" and c == "id") or c == "task_id":
                    expr = f"{task_base} + gen.i"
                elif table == "requests" and c == "id":
                    expr = f"{req_base} + gen.i"
                elif table == "replies" and c == "id":
                    expr = f"{rep_base} + gen.i"
                elif table == "replies" and c == "request_id":
                    expr = f"{req_base} + gen.i"
                elif c == "id":
                    continue  # events, messages: their own sequence
                else:
                    expr = f"t.{c}"
                out_cols.append(c)
                exprs.append(expr)
            stmts.append(
                f"INSERT INTO {table} ({', '.join(out_cols)}) SELECT {', '.join(exprs)} "
                f"FROM {table} t, {numbers} WHERE t.{key} = {template}"
            )
        if pg:
            with reader.conn.transaction():
                for s in stmts:
                    reader.conn.execute(s)
                for table in ("tasks", "requests", "replies"):
                    reader.conn.execute(
                        f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                        f"(SELECT max(id) FROM {table}))"
                    )
        else:
            reader.conn.execute("BEGIN IMMEDIATE")
            try:
                for s in stmts:
                    reader.conn.execute(s)
            except BaseException:
                reader.conn.execute("ROLLBACK")
                raise
            reader.conn.execute("COMMIT")
        done += k
    if pg:
        reader.run("ANALYZE")  # what autovacuum would have done after 100,000 tasks


def stepwarden_latency(dbs: Databases, store_kind: str, tasks: int) -> dict[str, Any]:
    """L1, by bench/latency.py's own procedure (one worker, all roles, idle between tasks)."""
    import latency

    url = dbs.fresh(store_kind, "sw_l1")
    try:
        r = latency.run_case(url, tasks, store_kind)
    finally:
        dbs.drop(url)
    return {
        "p50_ms": r["submit_to_processed_ms"]["p50"],
        "p99_ms": r["submit_to_processed_ms"]["p99"],
        "pickup_p50_ms": r["pickup_ms"]["p50"],
        "pickup_p99_ms": r["pickup_ms"]["p99"],
        "tasks": r["tasks"],
    }


def stepwarden_rescue(
    dbs: Databases,
    store_kind: str,
    n: int,
    concurrency: int,
    kill_after: float,
    budget: float,
    step_seconds: float,
) -> dict[str, Any]:
    """W3: ``n`` tasks of one 200 ms step; SIGKILL the only worker ``kill_after`` s after the first
    submit, start a fresh one at once; count lost and duplicated executions from the operation's
    own ledger, and the rescue latency of the steps the dead worker held (kill -> re-dispatched)."""
    url = dbs.fresh(store_kind, "sw_w3")
    work = Path(tempfile.mkdtemp(prefix="w3-", dir=dbs.work))
    ledger = work / "ledger.db"
    env = dict(os.environ)
    env.update(
        STEPWARDEN_BENCH_LEDGER=str(ledger),
        STEPWARDEN_BENCH_SLOW_BUDGET=repr(budget),
        STEPWARDEN_BENCH_SLOW_SECONDS=repr(step_seconds),
    )
    os.environ.update({k: env[k] for k in ("STEPWARDEN_BENCH_SLOW_BUDGET", "STEPWARDEN_BENCH_SLOW_SECONDS")})
    if "benchapp_slow" in sys.modules and budget != sys.modules["benchapp_slow"].BUDGET:
        raise RuntimeError("benchapp_slow was imported with another budget")
    app, store = open_app(url, "benchapp_slow")
    sys.modules["benchapp_slow"].prepare_ledger(str(ledger))
    reader = Reader(url)
    first = start_worker(url, "benchapp_slow:app", concurrency, work / "worker-killed.log", env)
    second = None
    try:
        dead_id = wait_registered(reader, [first])[first.pid]
        t0 = time.time()
        ids = []
        for _ in range(n):
            ids.append(app.submit("slow", {}))
        submitted = time.time()
        time.sleep(max(0.0, t0 + kill_after - time.time()))
        os.kill(first.pid, signal.SIGKILL)
        t_kill = time.time()
        first.wait(timeout=10)
        second = start_worker(url, "benchapp_slow:app", concurrency, work / "worker-fresh.log", env)
        lo, hi = min(ids), max(ids)
        wait_until(
            lambda: (
                reader.one(
                    f"SELECT count(*) FROM tasks WHERE id BETWEEN ? AND ? AND state IN {FINAL}", (lo, hi)
                )
                >= n
            ),
            budget + 120,
            every=0.1,
            procs=[second],
        )
        t_done = time.time()
        states = dict(
            reader.all("SELECT state, count(*) FROM tasks WHERE id BETWEEN ? AND ? GROUP BY state", (lo, hi))
        )
        processed_ids = [
            r[0]
            for r in reader.all(
                "SELECT id FROM tasks WHERE id BETWEEN ? AND ? AND state = 'processed'", (lo, hi)
            )
        ]
        orphans = reader.all(
            "SELECT r.task_id, r.step_idx, r.attempt FROM requests r WHERE r.taken_by = ? "
            "AND NOT EXISTS (SELECT 1 FROM replies p WHERE p.request_id = r.id)",
            (dead_id,),
        )
        rescue = []
        for task_id, idx, attempt in orphans:
            at = reader.one(
                "SELECT min(at) FROM events WHERE kind = 'dispatched' AND task_id = ? AND step_idx = ? "
                "AND attempt > ?",
                (task_id, idx, attempt),
            )
            if at is not None:
                rescue.append(float(at) - t_kill)
        accepted_twice = reader.one(
            "SELECT count(*) FROM (SELECT task_id, step_idx FROM replies "
            "WHERE status = 'accepted' AND kind = 'do' "
            "GROUP BY task_id, step_idx HAVING count(*) > 1) x"
        )
        completed_events = dict(
            reader.all(
                "SELECT kind, count(*) FROM events WHERE task_id BETWEEN ? AND ? AND kind IN "
                "('step_completed', 'processed') GROUP BY kind",
                (lo, hi),
            )
        )
        # A lost task's own account, for the results: its state and error, and its events in order.
        unfinished = [
            {
                "task_id": int(task_id),
                "state": state,
                "last_error": last_error,
                "events": [
                    f"{kind} attempt={attempt} by={actor} {detail or ''}".strip()
                    for kind, attempt, actor, detail in reader.all(
                        "SELECT kind, attempt, actor, detail FROM events WHERE task_id = ? ORDER BY id",
                        (task_id,),
                    )
                ],
            }
            for task_id, state, last_error in reader.all(
                "SELECT id, state, last_error FROM tasks WHERE id BETWEEN ? AND ? AND state <> 'processed' "
                "ORDER BY id LIMIT 5",
                (lo, hi),
            )
        ]
    finally:
        reader.close()
        if second is not None:
            stop_process(second)
        stop_process(first, signal.SIGKILL)
        store.close()
        dbs.drop(url)
    led = sqlite3.connect(ledger)
    done_per_task = dict(
        led.execute(
            "SELECT task_id, count(*) FROM executions WHERE phase = 'done' GROUP BY task_id"
        ).fetchall()
    )
    started = led.execute("SELECT count(*) FROM executions WHERE phase = 'start'").fetchone()[0]
    interrupted = led.execute(
        "SELECT count(*) FROM executions s WHERE phase = 'start' AND NOT EXISTS "
        "(SELECT 1 FROM executions d WHERE d.phase = 'done' AND d.key = s.key AND d.attempt = s.attempt)"
    ).fetchone()[0]
    led.close()
    processed = {int(r) for r in processed_ids}
    lost = sum(1 for t in ids if t not in processed or done_per_task.get(t, 0) == 0)
    dup_exec = sum(c - 1 for t, c in done_per_task.items() if lo <= t <= hi and c > 1)
    rescue.sort()
    return {
        "tasks": n,
        "final_states": states,
        "lost": lost,
        "duplicated_executions": dup_exec,
        "duplicated_completions": int(accepted_twice) + max(0, completed_events.get("step_completed", 0) - n),
        "executions_started": started,
        "unfinished_tasks": unfinished,
        "executions_not_finished": interrupted,
        "orphaned_steps": len(orphans),
        "rescued": len(rescue),
        "rescue_s": {
            "first": round(rescue[0], 2) if rescue else None,
            "median": round(statistics.median(rescue), 2) if rescue else None,
            "last": round(rescue[-1], 2) if rescue else None,
        },
        "kill_after_s": round(t_kill - t0, 2),
        "submit_s": round(submitted - t0, 2),
        "all_final_after_kill_s": round(t_done - t_kill, 2),
        "step_budget_s": budget,
    }


# -- the raw floor -----------------------------------------------------------------------------------
def floor_throughput(
    dbs: Databases, store_kind: str, workload: str, n: int, consumers: int, threads: int
) -> dict[str, Any]:
    """The raw-SQL floor (bench/floor.py) of W1 (chains of one job) or W2 (of three): ``n`` chains
    inserted one call each while the consumers run; elapsed to the last chain's end."""
    steps = 1 if workload == "w1" else 3
    url = dbs.fresh(store_kind, f"floor_{workload}_{consumers}c")
    work = Path(tempfile.mkdtemp(prefix="floor-", dir=dbs.work))
    floor.setup(url)
    procs = []
    try:
        for i in range(consumers):
            out = open(work / f"consumer-{i}.log", "ab")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(HERE / "floor.py"),
                        "consume",
                        "--db",
                        url,
                        "--threads",
                        str(threads),
                    ],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
        reader = Reader(url)
        warm = 4 * consumers
        floor.produce(url, warm, steps=steps)
        wait_until(lambda: reader.one(floor.FINISHED) >= warm, 60, procs=procs)
        meter = dbs.meter(store_kind, workers=lambda: cpu.process_cpu(p.pid for p in procs))
        meter.start()
        t0, t1 = floor.produce(url, n, steps=steps)
        wait_until(lambda: reader.one(floor.FINISHED) >= warm + n, max(120.0, n * steps / 10), procs=procs)
        used = meter.stop(n)
        end = float(reader.one(floor.LAST_DONE))
        reader.close()
    finally:
        for p in procs:
            stop_process(p)
        dbs.drop(url)
    return {
        "elapsed_s": round(end - t0, 3),
        "rate": round(n / (end - t0), 1),
        "steps_per_s": round(n * steps / (end - t0), 1),
        "submit_rate": round(n / (t1 - t0), 1),
        **used,
    }


# -- peers -------------------------------------------------------------------------------------------
def ensure_peer(name: str, timeout: float = 900) -> tuple[Path | None, str]:
    """The peer's own venv under bench/.peers/NAME, created and filled by pip on first use."""
    spec = PEERS[name]["pip"]
    venv = PEERS_DIR / name
    py = venv / "bin" / "python"
    marker = venv / ".bench-installed"
    if py.exists() and marker.exists() and json.loads(marker.read_text()) == spec:
        return py, "already installed"
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    log(f"installing peer {name} into {venv} ({' '.join(spec)})")
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True, timeout=300
        )
        r = subprocess.run(
            [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", *spec],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return None, f"pip install {' '.join(spec)} did not finish in {timeout:g}s"
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"cannot create a virtual environment: {e}"
    if r.returncode != 0:
        lines = [x for x in (r.stderr or r.stdout).splitlines() if x.strip() and "WARNING" not in x]
        return None, f"pip install failed: {' | '.join(lines[-3:])[:500]}"
    marker.write_text(json.dumps(spec))
    return py, "installed"


def peer_versions(py: Path, name: str) -> str:
    pkgs = {"huey": "huey", "procrastinate": "procrastinate", "dbos": "dbos"}
    r = subprocess.run(
        [str(py), "-c", f"import importlib.metadata as m; print(m.version('{pkgs[name]}'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r.stdout.strip() or "?"


def peer_throughput(
    dbs: Databases,
    py: Path,
    name: str,
    store_kind: str,
    workload: str,
    n: int,
    concurrency: int,
    dbos_poll: float,
) -> dict[str, Any]:
    url = dbs.fresh(store_kind, f"{name}_{workload}")
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=dbs.work))
    target = floor.sqlite_path(url) if store_kind == "sqlite" else url
    cmd = [str(py), str(HERE / "peers" / PEERS[name]["script"]), "--db", target, "--workload", workload]
    cmd += ["--tasks", str(n), "--concurrency", str(concurrency), "--work", str(work)]
    cmd += ["--timeout", str(max(300.0, n / 2))]
    if name == "dbos":
        cmd += ["--poll", str(dbos_poll)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(HERE / "peers")
    )
    try:
        stdout, stderr = proc.communicate(timeout=max(600.0, n))
    except BaseException:  # timeout or interrupted: the driver ends its own worker on SIGTERM
        stop_process(proc)  # type: ignore[arg-type]
        raise
    finally:
        dbs.drop(url)
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{name} driver exited {proc.returncode}: {(stderr or stdout)[-800:]}")
    got = json.loads(line[len("RESULT ") :])
    if "error" in got:
        raise RuntimeError(f"{got['error']}; worker log: {got.get('log', '')[-600:]}")
    steps = 1 if workload == "w1" else 3
    elapsed = got["end"] - got["t0"]
    return {
        "elapsed_s": round(elapsed, 3),
        "rate": round(n / elapsed, 1),
        "steps_per_s": round(n * steps / elapsed, 1),
        "submit_rate": round(n / (got["submitted"] - got["t0"]), 1),
        "settings": got.get("settings"),
    }


# -- results -----------------------------------------------------------------------------------------
class Results:
    def __init__(self, path_json: Path, path_md: Path, meta: dict[str, Any]) -> None:
        self.path_json = path_json
        self.path_md = path_md
        self.meta = meta
        self.series: dict[str, dict[str, Any]] = {}
        self.peer_status: dict[str, Any] = {}

    def add(
        self, key: dict[str, Any], rep: int, value: dict[str, Any] | None, error: str | None = None
    ) -> None:
        k = json.dumps(key, sort_keys=True)
        s = self.series.setdefault(k, {**key, "runs": []})
        s["runs"].append({"rep": rep, **(value or {}), **({"error": error} if error else {})})
        self.save()

    def find(self, **key: Any) -> dict[str, Any] | None:
        for s in self.series.values():
            if all(s.get(k) == v for k, v in key.items()):
                return s
        return None

    def save(self) -> None:
        data = {**self.meta, "series": list(self.series.values()), "peers": self.peer_status}
        data["summary"] = summarise(self)
        self.path_json.parent.mkdir(parents=True, exist_ok=True)
        self.path_json.write_text(json.dumps(data, indent=2) + "\n")
        self.path_md.write_text(markdown(self, data))


def stat(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
        "n": len(values),
    }


def figure(series: dict[str, Any] | None, field: str) -> dict[str, float] | None:
    if series is None:
        return None
    return stat([r[field] for r in series["runs"] if field in r and r[field] is not None])


def per_rep(a: dict[str, Any] | None, b: dict[str, Any] | None, field: str = "rate") -> list[float]:
    """a / b in each repetition that measured both (the same run's figures)."""
    if a is None or b is None:
        return []
    bx = {r["rep"]: r.get(field) for r in b["runs"] if r.get(field)}
    return [r[field] / bx[r["rep"]] for r in a["runs"] if r.get(field) and r["rep"] in bx]


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, field: str = "rate") -> dict[str, float] | None:
    """a / b, per repetition, then median and range."""
    return stat(per_rep(a, b, field))


def goal_over(
    res: Results, st: str, workload: str, base: dict[str, Any] | None, name: str
) -> dict[str, Any] | None:
    """Issue 5's goal for ``workload`` on store ``st`` (a multiple of a peer's figure) over a ceiling
    ``base`` measured in the same repetition (submission alone, or the raw-SQL floor): above 1, the
    goal asks for more than that ceiling reaches on this machine. Scaled per repetition, then
    summarised, so that the rounding is not multiplied."""
    peer, times = GOALS.get(st, ("", 0.0))
    r = stat([v * times for v in per_rep(res.find(system=peer, store=st, workload=workload), base)])
    if r is None:
        return None
    return {
        "what": f"issue 5's {workload.upper()} goal ({times:g}x {peer}) / {name}",
        "store": st,
        "workers": 0,
        **r,
    }


def goals(res: Results, st: str) -> list[dict[str, Any]]:
    """Each of issue 5's goals on ``st`` set against the ceilings measured in the same run: W1's
    against submission alone (W1 ends when its last submission is processed) and the floor, W2's
    against its floor; the floor with one consumer process, as the peers run one worker."""
    submit = res.find(system="stepwarden", store=st, workload="submit")
    out = [
        goal_over(res, st, "w1", submit, "submission alone"),
        goal_over(res, st, "w1", res.find(system="floor", store=st, workload="w1", workers=1), "raw floor"),
        goal_over(res, st, "w2", res.find(system="floor", store=st, workload="w2", workers=1), "raw floor"),
    ]
    return [g for g in out if g]


def summarise(res: Results) -> dict[str, Any]:
    out: dict[str, Any] = {"ratios": []}
    stores = sorted({s["store"] for s in res.series.values()})
    for st in stores:
        out["ratios"] += goals(res, st)
        for s in res.series.values():
            if (
                s["system"] != "stepwarden"
                or s["store"] != st
                or s["workload"] not in ("w1", "w2")
                or s.get("prefill")
            ):
                continue
            w, k = s["workload"], s["workers"]
            if s.get("sync"):  # the faster, less durable SQLite setting: compared with the peers only
                for name in PEERS:
                    r = ratio(s, res.find(system=name, store=st, workload=w))
                    if r:
                        what = f"stepwarden (synchronous={s['sync']}) {w} / {name}"
                        out["ratios"].append({"what": what, "store": st, "workers": k, **r})
                continue
            r = ratio(s, res.find(system="floor", store=st, workload=w, workers=k))
            if r:
                out["ratios"].append({"what": f"stepwarden {w} / raw floor", "store": st, "workers": k, **r})
            if w == "w1":
                r = ratio(s, res.find(system="stepwarden", store=st, workload="submit"))
                if r:
                    out["ratios"].append(
                        {"what": f"stepwarden {w} / submission alone", "store": st, "workers": k, **r}
                    )
                pre = next(
                    (
                        x
                        for x in res.series.values()
                        if x["system"] == "stepwarden"
                        and x["store"] == st
                        and x["workload"] == "w1"
                        and x["workers"] == k
                        and x.get("prefill")
                    ),
                    None,
                )
                r = ratio(pre, s)
                if r and pre is not None:
                    out["ratios"].append(
                        {
                            "what": f"stepwarden w1 after {pre['prefill']:,} finished tasks / empty store",
                            "store": st,
                            "workers": k,
                            **r,
                        }
                    )
            for name in PEERS:
                p = res.find(system=name, store=st, workload=w)
                r = ratio(s, p)
                if r:
                    out["ratios"].append({"what": f"stepwarden {w} / {name}", "store": st, "workers": k, **r})
    return out


def fmt(f: dict[str, float] | None, unit: str = "") -> str:
    if f is None:
        return "—"
    if f["n"] == 1:
        return f"{f['median']:g}{unit}"
    return f"{f['median']:g}{unit} ({f['min']:g}-{f['max']:g})"


def markdown(res: Results, data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        f"# stepwarden benchmark — {data['date']}",
        "",
        f"Command: `{data['command']}`",
        "",
        "## Machine",
        "",
        f"- {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB memory, {m['platform']}",
        f"- Python {m['python']}; SQLite {m['sqlite']}; PostgreSQL {m.get('postgres') or '—'}",
        f"- load average at start {m['load_start']}, at end {m.get('load_end', '—')}",
        *([probed] if (probed := calibrate.line(m)) else []),
        f"- {m['note']}",
        "",
        f"stepwarden measured: commit {data.get('source', {}).get('commit', '?')}"
        + (
            f" with {data['source']['src_files_changed']} uncommitted file(s) under src/"
            if data.get("source", {}).get("src_files_changed")
            else ""
        ),
        "",
        "## Settings",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in data["settings"].items()]
    lines += [
        "",
        "Each figure: median (min-max) over the repetitions; a single value when there was one run.",
        "",
    ]
    lines += ["## Throughput (W1: one-step tasks, W2: three-step workflows)", ""]
    lines += [
        "| system | store | workload | workers | tasks/s | steps/s | submit calls/s | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in res.series.values():
        if s["workload"] not in ("w1", "w2", "submit"):
            continue
        errs = [r["error"] for r in s["runs"] if "error" in r]
        if s["workload"] == "submit":  # no tasks processed: only the rate of the calls
            lines.append(
                f"| {s['system']} (submission alone, no worker) | {s['store']} | W1's submissions | 0 "
                f"| — | — | {fmt(figure(s, 'submit_rate'))} | {len(errs) or ''} |"
            )
            continue
        label = series_label(s)
        lines.append(
            f"| {label} | {s['store']} | {s['workload'].upper()} | {s.get('workers', 1)} "
            f"| {fmt(figure(s, 'rate'))} | {fmt(figure(s, 'steps_per_s'))} | {fmt(figure(s, 'submit_rate'))} "
            f"| {len(errs) or ''} |"
        )
    lines += cpu_table(res, data["machine"].get("cores"))
    lines += batch_table(res)
    ratios = data["summary"]["ratios"]
    if ratios:
        lines += [
            "",
            "## Ratios (taken per repetition, in the same run)",
            "",
            "| ratio | store | sw workers | value |",
            "|---|---|---|---|",
        ]
        for r in ratios:
            lines.append(f"| {r['what']} | {r['store']} | {r['workers'] or '—'} | {fmt(r)} |")
    l1 = [s for s in res.series.values() if s["workload"] == "l1"]
    if l1:
        lines += [
            "",
            "## L1: submit → processed on an idle system (ms)",
            "",
            "| store | p50 | p99 | pickup p50 | pickup p99 |",
            "|---|---|---|---|---|",
        ]
        for s in l1:
            lines.append(
                f"| {s['store']} | {fmt(figure(s, 'p50_ms'))} | {fmt(figure(s, 'p99_ms'))} "
                f"| {fmt(figure(s, 'pickup_p50_ms'))} | {fmt(figure(s, 'pickup_p99_ms'))} |"
            )
    w3 = [s for s in res.series.values() if s["workload"] == "w3"]
    if w3:
        lines += [
            "",
            "## W3: SIGKILL the worker mid-run (rescue latency in s, from the kill to re-dispatch)",
            "",
            "| store | lost | duplicated executions | duplicated completions | orphaned steps "
            "| rescue first | median | last | all final after kill (s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for s in w3:
            ok = [r for r in s["runs"] if "error" not in r]

            def sub(field: str, rs: list[dict[str, Any]] = ok) -> dict[str, float] | None:
                return stat([r["rescue_s"][field] for r in rs if r["rescue_s"][field] is not None])

            lines.append(
                f"| {s['store']} | {fmt(figure(s, 'lost'))} | {fmt(figure(s, 'duplicated_executions'))} "
                f"| {fmt(figure(s, 'duplicated_completions'))} | {fmt(figure(s, 'orphaned_steps'))} "
                f"| {fmt(sub('first'))} | {fmt(sub('median'))} | {fmt(sub('last'))} "
                f"| {fmt(figure(s, 'all_final_after_kill_s'))} |"
            )
        lost = [
            (s["store"], r["rep"], u) for s in w3 for r in s["runs"] for u in r.get("unfinished_tasks", [])
        ]
        if lost:
            lines += [
                "",
                "Tasks that did not end `processed` (up to 5 per run): store, repetition, task, its events:",
                "",
            ]
            for store, rep, u in lost:
                events = "; ".join(u["events"])
                lines.append(
                    f"- {store}, rep {rep}: task {u['task_id']} `{u['state']}` ({u['last_error']}): {events}"
                )
    if res.peer_status:
        lines += [
            "",
            "## Peers",
            "",
            "| peer | version | store | status | settings |",
            "|---|---|---|---|---|",
        ]
        for name, st in res.peer_status.items():
            per_store = st.get("settings") or {"—": {}}
            for store, s in per_store.items():
                settings = "; ".join(f"{k}: {v}" for k, v in s.items())
                lines.append(f"| {name} | {st.get('version', '—')} | {store} | {st['status']} | {settings} |")
    errors = [(s, r) for s in res.series.values() for r in s["runs"] if "error" in r]
    if errors:
        lines += ["", "## Errors", ""]
        for s, r in errors:
            lines.append(f"- {s['system']} {s['store']} {s['workload']} rep {r['rep']}: {r['error'][:400]}")
    return "\n".join(lines) + "\n"


def series_label(s: dict[str, Any]) -> str:
    """A series' system, with what sets it apart: a prefilled store, a non-default SQLite sync."""
    return (
        str(s["system"])
        + (f" (+{s['prefill']:,} finished)" if s.get("prefill") else "")
        + (f" (synchronous={s['sync']})" if s.get("sync") else "")
    )


def cpu_table(res: Results, cores: int | None) -> list[str]:
    """Where each task's CPU goes (harness that submits, workers, PostgreSQL server) and how many
    of the machine's cores a run kept busy; then, per store, the most CPU a task may cost if issue
    5's W1 goal is to be reached on this machine's cores."""
    rows = [
        s
        for s in res.series.values()
        if s["system"] in ("stepwarden", "floor") and s["workload"] in ("w1", "w2", "submit")
        if figure(s, "cpu_submitter_ms")
    ]
    if not rows:
        return []
    lines = [
        "",
        "## CPU per task (ms) and cores busy",
        "",
        "CPU time (psutil) over the measured interval, divided by the tasks. *submitter*: the "
        "harness process, which submits (and polls the store for the end, every 20 ms); *workers' CPU*: "
        "the worker (or raw-floor consumer) processes; *server*: the PostgreSQL server's processes "
        "(on SQLite the store's work is inside the other two). *cores busy*: the total over the wall "
        "time.",
        "",
        "| system | store | workload | workers | submitter | workers' CPU | server | total | cores busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        label = series_label(s)
        what = "W1's submissions, no worker" if s["workload"] == "submit" else s["workload"].upper()
        lines.append(
            f"| {label} | {s['store']} | {what} | {s.get('workers', 1)} "
            + "".join(
                f"| {fmt(figure(s, f))} "
                for f in ("cpu_submitter_ms", "cpu_workers_ms", "cpu_server_ms", "cpu_total_ms", "cores_busy")
            )
            + "|"
        )
    for st, (peer, times) in GOALS.items():
        p = figure(res.find(system=peer, store=st, workload="w1"), "rate")
        if p is None or not cores:
            continue
        goal = p["median"] * times
        spent = [
            (s["workers"], f)
            for s in rows
            if s["system"] == "stepwarden"
            and s["store"] == st
            and s["workload"] == "w1"
            and not s.get("prefill")
            and not s.get("sync")
            and (f := figure(s, "cpu_total_ms"))
        ]
        if not spent:
            continue
        by = "; ".join(f"with {k} worker(s) {f['median']:g} ms" for k, f in sorted(spent, key=lambda x: x[0]))
        lines.append("")
        lines.append(
            f"- {st}: issue 5's W1 goal ({times:g}x {peer}'s median W1, {goal:,.0f} tasks/s) leaves "
            f"{cores} cores / {goal:,.0f} = {cores / goal * 1000:.3f} ms of CPU per task; "
            f"stepwarden's W1 spent {by}."
        )
    return lines


def batch_table(res: Results) -> list[str]:
    """Replies per reply transaction in stepwarden's W1/W2 runs, from the workers' own metrics."""
    rows = [
        s
        for s in res.series.values()
        if s["system"] == "stepwarden" and s["workload"] in ("w1", "w2") and figure(s, "replies_per_batch")
    ]
    if not rows:
        return []
    lines = [
        "",
        "## Replies per reply transaction (stepwarden)",
        "",
        "The agents' replies over the transactions that carried them during the measured interval "
        "(`stepwarden_worker_requests_completed_total` / `stepwarden_worker_reply_batches_total`, "
        "scraped from each worker before and after). With no-op calls, near the slots per worker "
        "when they answer together; far below, they answer in groups that pay a commit each.",
        "",
        "| system | store | workload | workers | replies per transaction |",
        "|---|---|---|---|---|",
    ]
    for s in rows:
        lines.append(
            f"| {series_label(s)} | {s['store']} | {s['workload'].upper()} | {s.get('workers', 1)} "
            f"| {fmt(figure(s, 'replies_per_batch'))} |"
        )
    return lines


def source() -> dict[str, Any]:
    """Which stepwarden was measured: the commit, and whether src/ had uncommitted changes."""

    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=str(ROOT), capture_output=True, text=True, timeout=30)
        return r.stdout.strip()

    with contextlib.suppress(Exception):
        dirty = [x for x in git("status", "--porcelain", "--", "src").splitlines() if x.strip()]
        return {"commit": git("rev-parse", "--short", "HEAD"), "src_files_changed": len(dirty)}
    return {}


def machine(dbs: Databases | None, work: Path | None = None) -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 1024 / 1024, 1)
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": mem,
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "postgres": dbs.pg_version() if dbs else None,
        "platform": platform.platform(),
        "load_start": [round(x, 2) for x in os.getloadavg()],
        **(calibrate.probe(work / "calibrate") if work else {}),
        "note": "a shared 2-core machine: other work (test suites, other sessions) was running "
        "during the run, "
        "so absolute figures are noisy; compare by the ratios, which are taken within each repetition",
    }


# -- main --------------------------------------------------------------------------------------------
def csv(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"]
    if allowed:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise SystemExit(f"unknown: {', '.join(bad)}; choose from {', '.join(allowed)}")
    return items


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="1 repetition of W1, W2, L1, the floor and submission alone, 1 worker",
    )
    ap.add_argument("--stores", default="sqlite,postgres")
    ap.add_argument(
        "--workloads", default=None, help=f"comma-separated, from {','.join(WORKLOADS)} (default all)"
    )
    ap.add_argument("--peers", default=",".join(PEERS), help="comma-separated peers, or none")
    ap.add_argument(
        "--reps", type=int, default=None, help="repetitions of every figure (default 3; quick: 1)"
    )
    ap.add_argument("--tasks", type=int, default=2000, help="tasks per W1/W2 run")
    ap.add_argument("--peer-tasks", type=int, default=None, help="tasks per peer W1/W2 run (default --tasks)")
    ap.add_argument(
        "--workers", default=None, help="stepwarden worker processes to try (default 1,2; quick: 1)"
    )
    ap.add_argument(
        "--concurrency", type=int, default=8, help="agent slots per worker process, and the peers'"
    )
    ap.add_argument(
        "--prefill", type=int, default=None, help="also W1 after N finished tasks (default 100000; quick: 0)"
    )
    ap.add_argument(
        "--floor-threads", type=int, default=None, help="threads per floor consumer (default 1 SQLite, 4 PG)"
    )
    ap.add_argument("--l1-tasks", type=int, default=None, help="tasks per L1 run (default 60; quick: 30)")
    ap.add_argument("--w3-tasks", type=int, default=200)
    ap.add_argument("--w3-kill-after", type=float, default=1.0)
    ap.add_argument("--w3-budget", type=float, default=30.0, help="the slow step's complete-by, seconds")
    ap.add_argument("--w3-step", type=float, default=0.2, help="seconds the slow step takes")
    ap.add_argument("--dbos-poll", type=float, default=0.05, help="DBOS queue polling_interval_sec")
    ap.add_argument("--postgres", default=None, help="admin URL of a PostgreSQL server (default: start one)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--tag", default=None, help="suffix of the result files: bench-<date>-<tag>")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (stores, worker logs)")
    ap.add_argument(
        "--sqlite-normal",
        action="store_true",
        help="also W1/W2 on SQLite with synchronous=NORMAL (no fsync per commit; Huey, like "
        "stepwarden, runs SQLite's default FULL)",
    )
    a = ap.parse_args()
    # End cleanly (workers, peers, the PostgreSQL server we started) on SIGTERM and SIGINT, even
    # when started in the background, where SIGINT arrives ignored.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)

    quick = a.quick
    workloads = (
        csv(a.workloads, WORKLOADS)
        if a.workloads
        else (["w1", "w2", "l1", "floor", "submit"] if quick else list(WORKLOADS))
    )
    stores = csv(a.stores, STORES)
    peers = csv(a.peers, tuple(PEERS))
    reps = a.reps or (1 if quick else 3)
    worker_counts = [int(x) for x in csv(a.workers or ("1" if quick else "1,2"))]
    prefill = a.prefill if a.prefill is not None else (0 if quick else 100_000)
    l1_tasks = a.l1_tasks or (30 if quick else 60)
    date = dt.date.today().isoformat()
    stem = f"bench-{date}" + (f"-{a.tag}" if a.tag else "")
    out = Path(a.out)

    work = Path(tempfile.mkdtemp(prefix="stepwarden-bench-"))
    dbs = Databases(work, a.postgres, need_pg="postgres" in stores)
    # Also at exit: a failure before the measurements (a peer that cannot be installed) left the
    # throwaway PostgreSQL running after the harness ended.
    atexit.register(dbs.close)
    settings = {
        "tasks per W1/W2 run": a.tasks,
        "tasks per peer W1/W2 run": a.peer_tasks or a.tasks,
        "repetitions": reps,
        "stepwarden workers": f"{' and '.join(map(str, worker_counts))} worker process(es), each "
        f"`stepwarden worker --app benchapp:app --concurrency {a.concurrency}` "
        "(all roles; scheduler batch 50, "
        "defaults otherwise); the same on both stores",
        "stepwarden stores": "SQLite WAL synchronous=FULL (default); PostgreSQL 16 with fsync on, "
        "LISTEN/NOTIFY on (default), pool of 4",
        "submission": "one `App.submit` call per task from the harness process while the workers run; "
        "`submit`: the same calls with no worker running (the rate W1 cannot pass)",
        "timing": "from just before the first submit to the last `processed` event (database clock)",
        "floor": f"same number of consumer processes as stepwarden workers, "
        f"{a.floor_threads or '1 (SQLite) / 4 (PostgreSQL)'} thread(s) each; one transaction per job "
        "(claim + complete; W2: + insert of the chain's next job); producer inserts one job (W2: one "
        "three-job chain's first) per call",
        "peers": f"one worker process with {a.concurrency} concurrent slots each, "
        "own venv under bench/.peers/",
        "L1": f"bench/latency.py's procedure, {l1_tasks} tasks per run, one worker with default settings",
        "W3": f"{a.w3_tasks} tasks of one {a.w3_step:g} s step (complete_by {a.w3_budget:g} s), "
        f"1 worker --concurrency {a.concurrency}, SIGKILL {a.w3_kill_after:g} s after the first submit, "
        "a fresh worker started at once",
        "prefill": f"{prefill:,} finished one-step tasks copied in by SQL before a W1 run"
        if prefill
        else "off",
    }
    meta = {
        "date": date,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(dbs, work),
        "source": source(),
        "settings": settings,
        "workloads": workloads,
        "stores": stores,
    }
    res = Results(out / f"{stem}.json", out / f"{stem}.md", meta)
    log(f"writing {res.path_json} and {res.path_md}; scratch in {work}")

    peer_py: dict[str, Path] = {}
    for name in peers:
        if not any(s in stores for s in PEERS[name]["stores"]):
            continue
        py, why = ensure_peer(name)
        if py is None:
            res.peer_status[name] = {"status": f"not run: {why}"}
            log(f"peer {name}: {why}")
        else:
            peer_py[name] = py
            res.peer_status[name] = {"status": "ok", "version": peer_versions(py, name)}

    # fn is called with no arguments; `...` because the lambdas below bind loop variables as
    # defaults, which mypy cannot match against `[]`.
    def measure(key: dict[str, Any], rep: int, fn: Callable[..., dict[str, Any]]) -> None:
        label = " ".join(f"{k}={v}" for k, v in key.items())
        log(f"rep {rep}: {label}")
        try:
            value = fn()
        except Exception as e:
            log(f"  failed: {e!r}")
            traceback.print_exc()
            res.add(key, rep, None, f"{type(e).__name__}: {e}")
            return
        log("  " + json.dumps({k: v for k, v in value.items() if k != "settings"}))
        if "settings" in value and key["system"] in res.peer_status:
            res.peer_status[key["system"]].setdefault("settings", {})[key["store"]] = value.pop("settings")
        res.add(key, rep, value)

    try:
        for rep in range(1, reps + 1):
            for st in stores:
                for k in worker_counts:
                    if "w1" in workloads:
                        measure(
                            {"system": "stepwarden", "store": st, "workload": "w1", "workers": k},
                            rep,
                            lambda st=st, k=k: stepwarden_throughput(
                                dbs, st, "w1", a.tasks, k, a.concurrency
                            ),
                        )
                    # The floor: W1's whenever it is asked for, W2's when W2 runs too.
                    floors = [
                        w for w in ("w1", "w2") if "floor" in workloads and (w == "w1" or w in workloads)
                    ]
                    for w in floors:
                        threads = a.floor_threads or (4 if st == "postgres" else 1)
                        measure(
                            {"system": "floor", "store": st, "workload": w, "workers": k, "threads": threads},
                            rep,
                            lambda st=st, w=w, k=k, t=threads: floor_throughput(dbs, st, w, a.tasks, k, t),
                        )
                    if "w2" in workloads:
                        measure(
                            {"system": "stepwarden", "store": st, "workload": "w2", "workers": k},
                            rep,
                            lambda st=st, k=k: stepwarden_throughput(
                                dbs, st, "w2", a.tasks, k, a.concurrency
                            ),
                        )
                    if st == "sqlite" and a.sqlite_normal:
                        for w in ("w1", "w2"):
                            if w in workloads:
                                measure(
                                    {
                                        "system": "stepwarden",
                                        "store": st,
                                        "workload": w,
                                        "workers": k,
                                        "sync": "NORMAL",
                                    },
                                    rep,
                                    lambda st=st, k=k, w=w: stepwarden_throughput(
                                        dbs, st, w, a.tasks, k, a.concurrency, sync="NORMAL"
                                    ),
                                )
                    if prefill and "w1" in workloads:
                        measure(
                            {
                                "system": "stepwarden",
                                "store": st,
                                "workload": "w1",
                                "workers": k,
                                "prefill": prefill,
                            },
                            rep,
                            lambda st=st, k=k: stepwarden_throughput(
                                dbs, st, "w1", a.tasks, k, a.concurrency, prefill=prefill
                            ),
                        )
                if "submit" in workloads:
                    measure(
                        {"system": "stepwarden", "store": st, "workload": "submit", "workers": 0},
                        rep,
                        lambda st=st: stepwarden_submit_alone(dbs, st, a.tasks),
                    )
                for name, py in peer_py.items():
                    if st not in PEERS[name]["stores"]:
                        continue
                    for w in ("w1", "w2"):
                        if w not in workloads:
                            continue
                        measure(
                            {"system": name, "store": st, "workload": w, "workers": 1},
                            rep,
                            lambda st=st, w=w, name=name, py=py: peer_throughput(
                                dbs, py, name, st, w, a.peer_tasks or a.tasks, a.concurrency, a.dbos_poll
                            ),
                        )
                if "l1" in workloads:
                    measure(
                        {"system": "stepwarden", "store": st, "workload": "l1", "workers": 1},
                        rep,
                        lambda st=st: stepwarden_latency(dbs, st, l1_tasks),
                    )
                if "w3" in workloads:
                    measure(
                        {"system": "stepwarden", "store": st, "workload": "w3", "workers": 1},
                        rep,
                        lambda st=st: stepwarden_rescue(
                            dbs, st, a.w3_tasks, a.concurrency, a.w3_kill_after, a.w3_budget, a.w3_step
                        ),
                    )
    finally:
        res.meta["machine"]["load_end"] = [round(x, 2) for x in os.getloadavg()]
        res.save()
        dbs.close()
        if not a.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"kept {work}")
    print(res.path_md.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
