"""What one reply batch costs a worker, by batch size: the transaction that records a worker's own
replies, applies them (the steps complete, the next ones are dispatched) and takes the next
requests for the slots they free (``Store.send_replies_and_take``), run in this process alone.

No worker, no submitter, no agents: three-step workflows are submitted first, their first steps
dispatched and taken, then the replies are sent in batches of each size until every workflow is
processed. For each size it prints the wall time and this process's CPU time per batch and per
step, so the fixed part of a batch (the hop to the store's thread, round trips, statements,
commit) shows apart from the part that grows with its replies. Run from the repository root:

    .venv/bin/python bench/batchcost.py                          # both stores, sizes 1,4,8,16
    .venv/bin/python bench/batchcost.py --stores postgres --sizes 8 --workflows 2000

PostgreSQL is a throwaway server (as bench/run.py starts it: fsync on) unless ``--postgres``
names an admin URL; SQLite is a fresh file with the default ``synchronous=FULL``. These figures
locate costs; throughput is bench/run.py's to measure (W2 runs the same batches under load).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run as harness  # bench/run.py: Databases, open_app

from stepwarden.store import RequestMsg

ME = "batchcost"


def measure(url: str, workflows: int, size: int) -> dict[str, float]:
    app, store = harness.open_app(url)
    try:
        return asyncio.run(_batches(app, store, workflows, size))
    finally:
        store.close()


async def _batches(app: Any, store: Any, workflows: int, size: int) -> dict[str, float]:
    """The replies in batches of ``size``, each through ``Store.send_replies_and_take`` as a
    worker sends them (the hop to the store's thread included), until every workflow is done."""
    pending = await _first_steps(app, store, workflows)
    batches = steps = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while pending:
        now, pending = pending[:size], pending[size:]
        replies = [(m.id, "ok", None, None) for m in now]
        _, taken = await store.send_replies_and_take(ME, replies, {"noop": len(now)})
        pending += taken
        batches += 1
        steps += len(now)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "size": size,
        "batches": batches,
        "wall_us_per_batch": wall / batches * 1e6,
        "cpu_us_per_batch": cpu / batches * 1e6,
        "wall_us_per_step": wall / steps * 1e6,
    }


async def _first_steps(app: Any, store: Any, workflows: int) -> list[RequestMsg]:
    """Submit the workflows and dispatch and take their first steps, as a worker's scheduler does."""
    await store.register_workflows(list(app.workflows.values()), ME)
    for _ in range(workflows):
        app.submit("three", {})
    taken: list[RequestMsg] = []
    while True:
        _, claimed, got = await store.schedule_and_take(ME, 64, {"noop": 64})
        taken += got
        if not claimed and not got:
            return taken


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", default="sqlite,postgres")
    ap.add_argument("--sizes", default="1,4,8,16", help="replies per batch, comma-separated")
    ap.add_argument("--workflows", type=int, default=600, help="three-step workflows per size")
    ap.add_argument("--postgres", default=None, metavar="ADMIN_URL", help="a server of your own")
    args = ap.parse_args()
    stores = [s for s in args.stores.split(",") if s]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not set(stores) <= {"sqlite", "postgres"} or not sizes or min(sizes) < 1 or args.workflows < 1:
        ap.error("--stores is a subset of sqlite,postgres; --sizes and --workflows are positive")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally: the server stops
    with tempfile.TemporaryDirectory(prefix="stepwarden-batchcost-") as work:
        dbs = harness.Databases(Path(work), args.postgres, "postgres" in stores)
        try:
            head = ("store", "size", "batches", "wall/batch", "cpu/batch", "wall/step")
            print("{:9} {:>5} {:>8} {:>11} {:>10} {:>10}".format(*head))
            for store in stores:
                for size in sizes:
                    url = dbs.fresh(store, f"batch{size}")
                    r = measure(url, args.workflows, size)
                    dbs.drop(url)
                    print(
                        f"{store:9} {size:5d} {r['batches']:8d} {r['wall_us_per_batch']:9.0f}us "
                        f"{r['cpu_us_per_batch']:8.0f}us {r['wall_us_per_step']:8.0f}us",
                        flush=True,
                    )
        finally:
            dbs.close()  # the throwaway server, if it started one


if __name__ == "__main__":
    main()
