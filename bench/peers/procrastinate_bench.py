"""Procrastinate on PostgreSQL: W1 (one-step jobs) and W2 (three jobs in a chain) with no-op tasks.

As a module (``procrastinate_bench.app``) it is the application the worker imports; as a script it
drives one measurement and prints ``RESULT {json}``. Run by bench/run.py with the Python of
``bench/.peers/procrastinate``.

Procrastinate has no multi-step workflows: W2's first job defers the second at its end, and the
second the third (the usual recipe; the next job is not deferred in the same transaction as the
completion of the previous one). End time: the ``succeeded`` event of the last final job, from
Procrastinate's own ``procrastinate_events`` table (database clock).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import procrastinate

app = procrastinate.App(
    connector=procrastinate.PsycopgConnector(conninfo=os.environ.get("PROCRASTINATE_BENCH_DB", ""))
)


@app.task(name="one")
async def one() -> None:
    return None


@app.task(name="step_c")
async def step_c() -> None:
    return None


@app.task(name="step_b")
async def step_b() -> None:
    await step_c.defer_async()


@app.task(name="step_a")
async def step_a() -> None:
    await step_b.defer_async()


COUNT_SQL = (
    "SELECT count(*), max(id) FROM procrastinate_jobs "
    "WHERE task_name = %s AND status = 'succeeded' AND id > %s"
)
END_SQL = (
    "SELECT extract(epoch FROM max(e.at))::float8 FROM procrastinate_events e "
    "JOIN procrastinate_jobs j ON j.id = e.job_id "
    "WHERE j.task_name = %s AND e.type = 'succeeded' AND j.id > %s"
)


def drive() -> None:
    import psycopg
    from common import env as mkenv
    from common import parser, report, start, stop, tail, wait_until

    a = parser(__doc__).parse_args()
    work = Path(a.work)
    environ = mkenv(PROCRASTINATE_BENCH_DB=a.db)
    os.environ.update(environ)
    import procrastinate_bench as mod  # this file again, as a module configured by the environment above

    settings = {
        "storage": "PostgreSQL (procrastinate schema), LISTEN/NOTIFY on (default)",
        "worker": f"1 process, procrastinate worker --concurrency {a.concurrency} (async no-op tasks), "
        "--log-level=warning",
        "w2": "job a defers b at its end, b defers c (no native workflows)",
        "delivery": "at least once only with a stalled-job recipe the user writes",
    }
    final = "one" if a.workload == "w1" else "step_c"
    first = mod.one if a.workload == "w1" else mod.step_a
    mod.app.open()
    try:
        mod.app.schema_manager.apply_schema()
    except Exception as e:  # already applied
        if "already exists" not in str(e):
            raise
    log = work / "procrastinate-worker.log"
    proc = start(
        [
            sys.executable,
            "-m",
            "procrastinate",
            "--app=procrastinate_bench.app",
            "--log-level=warning",
            "worker",
            f"--concurrency={a.concurrency}",
        ],
        log,
        environ,
    )
    conn = psycopg.connect(a.db, autocommit=True)
    try:

        def count(after: int) -> tuple[int, int]:
            n, top = conn.execute(COUNT_SQL, (final, after)).fetchone()  # type: ignore[misc]
            return int(n), int(top or 0)

        for _ in range(a.warm):
            first.defer()
        wait_until(lambda: count(0)[0] >= a.warm, 60, every=0.05, proc=proc)
        warm_top = int(conn.execute("SELECT max(id) FROM procrastinate_jobs").fetchone()[0])  # type: ignore[index]
        t0 = time.time()
        for _ in range(a.tasks):
            first.defer()
        submitted = time.time()
        wait_until(lambda: count(warm_top)[0] >= a.tasks, a.timeout, every=0.02, proc=proc)
        end = float(conn.execute(END_SQL, (final, warm_top)).fetchone()[0])  # type: ignore[index]
    except Exception as e:
        report(error=f"{type(e).__name__}: {e}", log=tail(log), settings=settings)
        return
    finally:
        stop(proc)
        conn.close()
        mod.app.close()
    report(t0=t0, submitted=submitted, end=end, settings=settings)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    drive()
