"""The raw-SQL floor for W1 and W2: a hand-written job queue in Python with no framework, the same
driver as stepwarden (``sqlite3`` / ``psycopg``), for comparison in the same run.

- One producer (the caller of :func:`produce`, in bench/run.py's process) inserts the jobs one per
  call, one committed transaction each, as an application would. A job is the first step of a
  chain of ``steps`` (1 for W1, 3 for W2).
- Consumers (``python bench/floor.py consume ...``, one or more processes of one or more threads)
  claim and complete each job in ONE transaction: on PostgreSQL ``SELECT ... FOR UPDATE SKIP
  LOCKED`` then ``UPDATE``; on SQLite ``BEGIN IMMEDIATE``, ``SELECT``, ``UPDATE`` (WAL,
  ``synchronous=FULL``). A job that is not its chain's last step also inserts the next step's job
  in that transaction, queued behind the jobs already waiting: the least a durable pipeline can do
  (W2: one insert and three claim-and-complete transactions per workflow). An idle consumer checks
  for work with a plain read and sleeps 1 ms.
- Elapsed: from just before the first insert to the last ``done_at`` (host clock, written by the
  consumer at completion) of a chain's last step.
"""

from __future__ import annotations

import argparse
import signal
import sqlite3
import threading
import time
from typing import Any

SQLITE_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY, state TEXT NOT NULL, payload TEXT NOT NULL,"
    " step INTEGER NOT NULL DEFAULT 0, steps INTEGER NOT NULL DEFAULT 1,"
    " created_at REAL NOT NULL, done_at REAL)",
    "CREATE INDEX IF NOT EXISTS jobs_queued ON jobs (id) WHERE state = 'queued'",
]
PG_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS jobs (id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
    " state TEXT NOT NULL,"
    " payload TEXT NOT NULL, step INTEGER NOT NULL DEFAULT 0, steps INTEGER NOT NULL DEFAULT 1,"
    " created_at DOUBLE PRECISION NOT NULL, done_at DOUBLE PRECISION)",
    "CREATE INDEX IF NOT EXISTS jobs_queued ON jobs (id) WHERE state = 'queued'",
]


def is_pg(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def sqlite_path(url: str) -> str:
    return url[len("sqlite:///") :] if url.startswith("sqlite:///") else url


def connect(url: str) -> Any:
    if is_pg(url):
        import psycopg

        return psycopg.connect(url, autocommit=True)
    conn = sqlite3.connect(sqlite_path(url), isolation_level=None, timeout=30, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


def setup(url: str) -> None:
    conn = connect(url)
    for stmt in PG_SCHEMA if is_pg(url) else SQLITE_SCHEMA:
        conn.execute(stmt)
    conn.close()


def produce(url: str, n: int, payload: str = "{}", steps: int = 1) -> tuple[float, float]:
    """Insert ``n`` jobs (chains of ``steps``), one committed transaction per call; returns (start,
    end) on the host clock."""
    conn = connect(url)
    sql = _param(url, "INSERT INTO jobs (state, payload, steps, created_at) VALUES ('queued', ?, ?, ?)")
    t0 = time.time()
    for _ in range(n):
        conn.execute(sql, (payload, steps, time.time()))
    t1 = time.time()
    conn.close()
    return t0, t1


# How many chains are finished (their last step done), and when the last of them finished.
FINISHED = "SELECT count(*) FROM jobs WHERE state = 'done' AND step = steps - 1"
LAST_DONE = "SELECT max(done_at) FROM jobs WHERE state = 'done' AND step = steps - 1"

CLAIM = "SELECT id, payload, step, steps FROM jobs WHERE state = 'queued' ORDER BY id LIMIT 1"
COMPLETE = "UPDATE jobs SET state = 'done', done_at = ? WHERE id = ?"
NEXT = "INSERT INTO jobs (state, payload, step, steps, created_at) VALUES ('queued', ?, ?, ?, ?)"
# psycopg's placeholders, made once rather than per job
PG_COMPLETE, PG_NEXT = COMPLETE.replace("?", "%s"), NEXT.replace("?", "%s")


def _param(url: str, sql: str) -> str:
    return sql.replace("?", "%s") if is_pg(url) else sql


def _complete(conn: Any, row: Any, complete: str, next_step: str) -> None:
    """Complete the claimed job ``row`` and queue its chain's next step, in the caller's transaction."""
    job, payload, step, steps = row
    conn.execute(complete, (time.time(), job))
    if step + 1 < steps:
        conn.execute(next_step, (payload, step + 1, steps, time.time()))


def _consume_pg(url: str, stop: threading.Event, done: list[int]) -> None:
    conn = connect(url)
    n = 0
    while not stop.is_set():
        with conn.transaction():
            row = conn.execute(CLAIM + " FOR UPDATE SKIP LOCKED").fetchone()
            if row is not None:
                _complete(conn, row, PG_COMPLETE, PG_NEXT)
        if row is None:
            time.sleep(0.001)
        else:
            n += 1
    conn.close()
    done.append(n)


def _consume_sqlite(url: str, stop: threading.Event, done: list[int]) -> None:
    conn = connect(url)
    n = 0
    while not stop.is_set():
        if conn.execute("SELECT 1 FROM jobs WHERE state = 'queued' LIMIT 1").fetchone() is None:
            time.sleep(0.001)
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            row = conn.execute(CLAIM).fetchone()
            if row is not None:
                _complete(conn, row, COMPLETE, NEXT)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        if row is not None:
            n += 1
    conn.close()
    done.append(n)


def consume(url: str, threads: int) -> None:
    """Claim and complete jobs until SIGTERM/SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    target = _consume_pg if is_pg(url) else _consume_sqlite
    done: list[int] = []
    workers = [threading.Thread(target=target, args=(url, stop, done)) for _ in range(threads)]
    for w in workers:
        w.start()
    while not stop.wait(0.2):
        if not any(w.is_alive() for w in workers):
            break
    stop.set()
    for w in workers:
        w.join(timeout=10)
    print(f"consumed {sum(done)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consume", help="run one consumer process until SIGTERM")
    c.add_argument("--db", required=True, help="sqlite:///PATH or postgresql://...")
    c.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.cmd == "consume":
        consume(a.db, a.threads)


if __name__ == "__main__":
    main()
