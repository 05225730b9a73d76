"""L1: latency from submit to processed for single tasks on an idle system, and the pickup part of
it, on SQLite and PostgreSQL, with LISTEN/NOTIFY on and off.

    .venv/bin/python bench/latency.py [--tasks 60] [--json bench/results/latency.json]

Times come from the store's own event log (database clock): ``received`` (submit committed),
``claimed`` (a scheduler picked it up), ``processed``. One worker process, all roles, idle
between tasks (each task is submitted after the previous one finished, plus a random pause so
submissions do not line up with the poll interval).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def run_case(url: str, tasks: int, label: str) -> dict[str, Any]:
    from benchapp import app

    from stepwarden.store import open_store
    from stepwarden.store.core import _register

    store = open_store(url)
    store.transact_sync(_register, list(app.workflows.values()), "bench")
    app.use_store(store)
    env = dict(os.environ, PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stepwarden",
            "--db",
            url,
            "--log-level",
            "WARNING",
            "worker",
            "--app",
            "benchapp:app",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    rng = random.Random(1)
    try:
        warm = app.submit("one", {})
        app.wait(warm, timeout=30, poll=0.005)
        ids = []
        for _ in range(tasks):
            time.sleep(rng.uniform(0.05, 0.3))
            tid = app.submit("one", {})
            app.wait(tid, timeout=30, poll=0.002)
            ids.append(tid)
        rows = store.transact_sync(
            lambda tx: tx.sql(
                "SELECT task_id, kind, at FROM events WHERE kind IN ('received', 'claimed', 'processed') "
                "AND task_id >= ? ORDER BY id",
                (ids[0],),
            )
        )
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
        store.close()
    at: dict[int, dict[str, float]] = {}
    for r in rows:
        at.setdefault(r["task_id"], {}).setdefault(r["kind"], r["at"])
    pickup = [1000 * (a["claimed"] - a["received"]) for a in at.values()]
    total = [1000 * (a["processed"] - a["received"]) for a in at.values()]
    return {
        "case": label,
        "tasks": len(total),
        "pickup_ms": {
            "p50": round(pct(pickup, 50), 1),
            "p99": round(pct(pickup, 99), 1),
            "mean": round(statistics.mean(pickup), 1),
        },
        "submit_to_processed_ms": {
            "p50": round(pct(total, 50), 1),
            "p99": round(pct(total, 99), 1),
            "mean": round(statistics.mean(total), 1),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=60)
    ap.add_argument("--json", default=None, help="write the results here too")
    ap.add_argument("--postgres", default=None, help="admin URL of a server to use (default: start one)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stepwarden-bench-"))
    results = [run_case(f"sqlite:///{work / 'l1.db'}", a.tasks, "sqlite")]
    pg = None
    admin = a.postgres
    if admin is None:
        from stepwarden.testing.postgres import LocalPostgres

        pg = LocalPostgres(work / "pg", durable=True).start()
        admin = pg.url()
    try:
        import psycopg

        for listen in ("on", "off"):
            db = f"l1_{listen}"
            with psycopg.connect(admin, autocommit=True) as c:
                c.execute(f"DROP DATABASE IF EXISTS {db}")
                c.execute(f"CREATE DATABASE {db}")
            base = admin.rsplit("/", 1)[0]
            results.append(run_case(f"{base}/{db}?listen={listen}", a.tasks, f"postgres, LISTEN {listen}"))
    finally:
        if pg is not None:
            pg.stop()
    print(f"{'case':<22} {'pickup p50':>11} {'p99':>8} {'submit->processed p50':>22} {'p99':>8}   (ms)")
    for r in results:
        print(
            f"{r['case']:<22} {r['pickup_ms']['p50']:>11} {r['pickup_ms']['p99']:>8} "
            f"{r['submit_to_processed_ms']['p50']:>22} {r['submit_to_processed_ms']['p99']:>8}"
        )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"machine": machine(), "results": results}, indent=2))
    return 0


def machine() -> dict[str, Any]:
    import platform

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


if __name__ == "__main__":
    sys.exit(main())
