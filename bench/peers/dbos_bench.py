"""DBOS Transact on SQLite or PostgreSQL: W1 (a workflow of one step) and W2 (three steps), no-op.

``python dbos_bench.py serve`` is the worker (one DBOS process; a queue with
``worker_concurrency`` slots); ``python dbos_bench.py --db ... --workload ...`` drives one
measurement: it enqueues through ``DBOSClient`` (one call per workflow, as another process of the
application would) and prints ``RESULT {json}``. Run by bench/run.py with the Python of
``bench/.peers/dbos``. End time: when polling ``workflow_status`` (every 50 ms) first sees every
measured workflow ``SUCCESS`` (its ``updated_at`` has only 1 s resolution on SQLite).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from dbos import DBOS

QUEUE = "bench"


@DBOS.step(name="noop")
def noop() -> None:
    return None


@DBOS.workflow(name="w_one")
def w_one() -> None:
    noop()


@DBOS.workflow(name="w_three")
def w_three() -> None:
    noop()
    noop()
    noop()


def serve() -> None:
    from common import publish

    url = os.environ["DBOS_BENCH_DB"]
    DBOS(config={"name": "stepwarden-bench", "system_database_url": url, "log_level": "WARNING"})
    DBOS.launch()
    DBOS.register_queue(
        QUEUE,
        worker_concurrency=int(os.environ.get("DBOS_BENCH_CONCURRENCY", "8")),
        polling_interval_sec=float(os.environ.get("DBOS_BENCH_POLL", "1.0")),
        on_conflict="always_update",
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    publish(Path(os.environ["DBOS_BENCH_READY"]), "ready")
    while not stop.wait(0.5):
        pass
    DBOS.destroy()


def drive() -> None:
    from common import env as mkenv
    from common import parser, report, start, stop, tail, wait_until
    from dbos import DBOSClient

    ap = parser(__doc__)
    ap.add_argument("--poll", type=float, default=1.0, help="the queue's polling_interval_sec")
    a = ap.parse_args()
    work = Path(a.work)
    ready = work / f"dbos-ready-{os.getpid()}"
    sqlite = not a.db.startswith("postgres")
    url = f"sqlite:///{a.db}" if sqlite else a.db
    environ = mkenv(
        DBOS_BENCH_DB=url,
        DBOS_BENCH_CONCURRENCY=str(a.concurrency),
        DBOS_BENCH_POLL=str(a.poll),
        DBOS_BENCH_READY=str(ready),
    )
    settings = {
        "storage": (
            "SQLite system database (DBOS defaults: rollback journal, synchronous FULL)"
            if sqlite
            else "PostgreSQL system database (DBOS defaults)"
        ),
        "worker": f"1 process, queue worker_concurrency={a.concurrency}, polling_interval_sec={a.poll}",
        "submit": "DBOSClient.enqueue, one call per workflow",
        "recovery": "a crashed executor's workflows resume only when an executor with the same id restarts",
    }
    name = "w_one" if a.workload == "w1" else "w_three"
    log = work / "dbos-worker.log"
    proc = start([sys.executable, __file__, "serve"], log, environ)
    table = "workflow_status" if sqlite else "dbos.workflow_status"
    client = None
    try:
        wait_until(ready.exists, 120, every=0.05, proc=proc)
        client = DBOSClient(system_database_url=url)
        if sqlite:
            import sqlite3

            conn = sqlite3.connect(a.db, isolation_level=None, timeout=30)
            ph = "?"
        else:
            import psycopg

            conn = psycopg.connect(a.db, autocommit=True)  # type: ignore[assignment]
            ph = "%s"
        # measured workflows get ids "m-N", warm-up ones "w-N" (created_at has 1 s resolution)
        done_sql = f"FROM {table} WHERE workflow_uuid LIKE {ph} AND status = 'SUCCESS'"

        def count(prefix: str) -> int:
            return int(conn.execute(f"SELECT count(*) {done_sql}", (prefix + "-%",)).fetchone()[0])

        for i in range(a.warm):
            client.enqueue({"workflow_name": name, "queue_name": QUEUE, "workflow_id": f"w-{i}"})
        wait_until(lambda: count("w") >= a.warm, 120, every=0.05, proc=proc)
        t0 = time.time()
        for i in range(a.tasks):
            client.enqueue({"workflow_name": name, "queue_name": QUEUE, "workflow_id": f"m-{i}"})
        submitted = time.time()
        # seen by polling (every 50 ms: DBOS's SQLite database is in rollback-journal mode, where a
        # reader holds writers off); DBOS's updated_at has only 1 s resolution on SQLite
        wait_until(lambda: count("m") >= a.tasks, a.timeout, every=0.05, proc=proc)
        end = time.time()
        conn.close()
    except Exception as e:
        report(error=f"{type(e).__name__}: {e}", log=tail(log), settings=settings)
        return
    finally:
        if client is not None:
            client.destroy()
        stop(proc)
    report(t0=t0, submitted=submitted, end=end, settings=settings)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if sys.argv[1:2] == ["serve"]:
        serve()
    else:
        drive()
