"""Huey on SQLite: W1 (one-step tasks) and W2 (three-step pipelines) with no-op tasks.

As a module (``huey_bench.huey``) it is the application the consumer imports; as a script it
drives one measurement and prints ``RESULT {json}``. Run by bench/run.py with the Python of
``bench/.peers/huey``.

Completion is observed inside the consumer: a ``SIGNAL_COMPLETE`` handler counts the measured
final tasks and writes the time the last one finished to a file, so results are not stored and
no extra write is added to Huey's path.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from common import publish
from huey import SqliteHuey, signals

huey = SqliteHuey("bench", filename=os.environ.get("HUEY_BENCH_DB", ":memory:"), results=False)
_DONE = os.environ.get("HUEY_BENCH_DONE", "")
_EXPECT = {0: int(os.environ.get("HUEY_BENCH_WARM", "0")), 1: int(os.environ.get("HUEY_BENCH_EXPECT", "0"))}
_count = {0: 0, 1: 0}
_lock = threading.Lock()
FINAL = {"one", "step_c"}


@huey.task(name="one")
def one(m: int = 0) -> None:
    return None


@huey.task(name="step_a")
def step_a(m: int = 0) -> None:
    return None


@huey.task(name="step_b")
def step_b(*_: object, m: int = 0) -> None:
    return None


@huey.task(name="step_c")
def step_c(*_: object, m: int = 0) -> None:
    return None


@huey.signal(signals.SIGNAL_COMPLETE)
def _completed(signal: str, task: object) -> None:
    if getattr(task, "name", None) not in FINAL:
        return
    m = int((getattr(task, "kwargs", None) or {}).get("m", 0))
    with _lock:
        _count[m] += 1
        if _count[m] == _EXPECT[m] and _DONE:
            publish(Path(f"{_DONE}.{m}"), repr(time.time()))


def drive() -> None:
    from common import env as mkenv
    from common import parser, report, start, stop, tail, wait_until

    a = parser(__doc__).parse_args()
    work = Path(a.work)
    done = work / f"huey-done-{os.getpid()}"
    environ = mkenv(
        HUEY_BENCH_DB=a.db,
        HUEY_BENCH_DONE=str(done),
        HUEY_BENCH_WARM=str(a.warm),
        HUEY_BENCH_EXPECT=str(a.tasks),
    )
    os.environ.update(environ)
    import huey_bench as app  # this file again, as a module configured by the environment above

    settings = {
        "storage": "SqliteHuey (WAL, synchronous FULL: the default), results off",
        "consumer": f"1 process, -w {a.concurrency} -k thread, polling -d 0.01 -m 0.1 -b 1.15, -q",
        "w2": "pipeline step_a.s().then(step_b).then(step_c)",
        "delivery": "at most once (a task is deleted from the queue when dequeued)",
    }
    consumer_bin = str(Path(sys.executable).parent / "huey_consumer")
    log = work / "huey-consumer.log"
    proc = start(
        [
            consumer_bin,
            "huey_bench.huey",
            "-w",
            str(a.concurrency),
            "-k",
            "thread",
            "-d",
            "0.01",
            "-m",
            "0.1",
            "-b",
            "1.15",
            "-q",
        ],
        log,
        environ,
    )
    try:
        for _ in range(a.warm):
            if a.workload == "w1":
                app.one(m=0)
            else:
                app.huey.enqueue(app.step_a.s(m=0).then(app.step_b, m=0).then(app.step_c, m=0))
        wait_until(lambda: Path(f"{done}.0").exists(), 60, proc=proc)
        t0 = time.time()
        for _ in range(a.tasks):
            if a.workload == "w1":
                app.one(m=1)
            else:
                app.huey.enqueue(app.step_a.s(m=1).then(app.step_b, m=1).then(app.step_c, m=1))
        submitted = time.time()
        wait_until(lambda: Path(f"{done}.1").exists(), a.timeout, proc=proc)
        end = float(Path(f"{done}.1").read_text())
    except Exception as e:
        report(error=f"{type(e).__name__}: {e}", log=tail(log), settings=settings)
        return
    finally:
        stop(proc, sig=2)  # SIGINT is Huey's graceful signal
    report(t0=t0, submitted=submitted, end=end, settings=settings)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    drive()
