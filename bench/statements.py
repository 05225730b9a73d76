"""Where the PostgreSQL server's time goes, statement by statement, in one W1 or W2 run.

    .venv/bin/python bench/statements.py --postgres postgresql://postgres@127.0.0.1:5499/postgres

Runs the harness's own W1 (or ``--workload w2``) once on a fresh database of the given server and
prints, for each statement the run executed more than ``--min-calls`` times, its calls and the
server's execution and planning time per task, from ``pg_stat_statements``. The server must load
that extension (``shared_preload_libraries = 'pg_stat_statements'``); the ``pgserver`` binaries
that ``bench/run.py`` starts by default do not ship it, so point this at a server that does
(Debian's ``postgresql`` package has it). The throughput it prints is one noisy run: use
``bench/run.py`` for figures; this is for deciding which statement to make cheaper.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import run as harness


class StatementDatabases(harness.Databases):
    """The harness's fresh databases, with ``pg_stat_statements`` reset in each, and read just
    before the harness drops it."""

    def __init__(self, work: Path, admin: str, min_calls: int) -> None:
        super().__init__(work, admin, need_pg=True)
        self.min_calls = min_calls
        self.rows: list[tuple[Any, ...]] = []

    def fresh(self, store: str, label: str) -> str:
        import psycopg

        url = super().fresh(store, label)
        with psycopg.connect(url, autocommit=True) as c:
            try:
                c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                c.execute("SELECT pg_stat_statements_reset()")
            except psycopg.Error as e:
                sys.exit(f"error: {self.admin} has no pg_stat_statements ({str(e).strip()})")
        return url

    def drop(self, url: str) -> None:
        import psycopg

        with psycopg.connect(url, autocommit=True) as c:
            self.rows = c.execute(
                "SELECT calls, total_exec_time, total_plan_time, rows, query FROM pg_stat_statements"
                " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND calls >= %s ORDER BY total_exec_time + total_plan_time DESC",
                (self.min_calls,),
            ).fetchall()
        super().drop(url)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--postgres", required=True, help="admin URL of a server with pg_stat_statements")
    ap.add_argument("--workload", choices=("w1", "w2"), default="w1")
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--min-calls", type=int, default=100)
    ap.add_argument("--json", dest="json_out", default=None, help="also write the rows to this file")
    a = ap.parse_args()

    import psycopg

    work = Path(tempfile.mkdtemp(prefix="stepwarden-statements-"))
    dbs = StatementDatabases(work, a.postgres, a.min_calls)
    try:
        out = harness.stepwarden_throughput(dbs, "postgres", a.workload, a.tasks, 1, a.concurrency)
    except psycopg.OperationalError as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), repr(e))
        sys.exit(f"error: cannot use {a.postgres}: {first}")
    finally:
        dbs.close()
        shutil.rmtree(work, ignore_errors=True)
    n = a.tasks
    rows = [
        {
            "calls": calls,
            "exec_us_per_task": round(exec_ms * 1000 / n, 1),
            "plan_us_per_task": round(plan_ms * 1000 / n, 1),
            "rows": nrows,
            "query": re.sub(r"\s+", " ", re.sub(r"--[^\n]*", "", query)).strip(),
        }
        for calls, exec_ms, plan_ms, nrows, query in dbs.rows
    ]
    print(f"{a.workload}: {out['rate']} tasks/s, {out['submit_rate']} submit calls/s (one run)")
    total = sum(r["exec_us_per_task"] + r["plan_us_per_task"] for r in rows)
    print(f"server time in statements: {total:.0f} us per task\n")
    print(f"{'calls':>6} {'exec us/task':>12} {'plan':>6} {'rows':>6}  statement")
    for r in rows:
        print(
            f"{r['calls']:>6} {r['exec_us_per_task']:>12} {r['plan_us_per_task']:>6} {r['rows']:>6}"
            f"  {r['query'][:110]}"
        )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"run": out, "statements": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
