"""The agents' thread pools (``stepwarden.daemon_pool``): what ``ThreadPoolExecutor`` gave them
(results, exceptions, a bound on threads, queued calls dropped at shutdown), on threads that do
not hold the process at its exit."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import pytest

from stepwarden.daemon_pool import DaemonPool


def test_calls_give_their_results_and_exceptions_on_at_most_max_workers_named_threads() -> None:
    pool = DaemonPool(2, "stepwarden-agent-t")
    gate = threading.Event()
    names: set[str] = set()

    def call(n: int) -> int:
        names.add(threading.current_thread().name)
        gate.wait(5)
        if n == 3:
            raise KeyboardInterrupt("a BaseException goes to the caller, not the thread")
        return n * 10

    futures = [pool.submit(call, n) for n in range(5)]
    time.sleep(0.2)
    assert len(pool._threads) == 2 and all(t.daemon for t in pool._threads)
    gate.set()
    assert [f.result(5) for f in futures[:3]] == [0, 10, 20]
    with pytest.raises(KeyboardInterrupt):
        futures[3].result(5)
    assert futures[4].result(5) == 40
    assert names <= {"stepwarden-agent-t_0", "stepwarden-agent-t_1"}
    # An idle thread takes the next call: no third thread.
    assert pool.submit(lambda: "again").result(5) == "again"
    assert len(pool._threads) == 2
    pool.shutdown()


def test_shutdown_cancels_the_queued_calls_and_refuses_new_ones() -> None:
    pool = DaemonPool(1, "t")
    gate = threading.Event()
    running = pool.submit(gate.wait, 5)
    queued = pool.submit(lambda: "never")
    time.sleep(0.1)
    pool.shutdown(wait=False, cancel_futures=True)
    with pytest.raises(CancelledError):
        queued.result(1)
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)
    gate.set()
    assert running.result(5) is True  # the running call runs on
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in pool._threads)


def test_the_idle_threads_of_a_pool_dropped_without_shutdown_end() -> None:
    """As ThreadPoolExecutor's: a sink dropped without close() left its idle threads for good."""
    for _ in range(5):
        pool = DaemonPool(1, "stepwarden-test-dropped")
        assert pool.submit(lambda: 1).result(5) == 1
        del pool
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("stepwarden-test-dropped") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the dropped pools' threads did not end"
        time.sleep(0.02)


def test_a_call_that_never_returns_does_not_hold_the_process_at_its_exit(tmp_path: Path) -> None:
    """With ThreadPoolExecutor the interpreter's exit joined the thread: the process never ended."""
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            """
            import threading, time
            from stepwarden.daemon_pool import DaemonPool
            started = threading.Event()
            pool = DaemonPool(1, "stepwarden-agent-hang")
            pool.submit(lambda: (started.set(), time.sleep(3600)))
            started.wait(10)
            pool.shutdown(wait=False, cancel_futures=True)
            print("returning", flush=True)
            """
        )
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "returning", done
    assert time.monotonic() - started < 30


def test_an_application_running_a_worker_exits_though_a_plain_operation_never_returns(tmp_path: Path) -> None:
    """A worker run from Python (not the CLI, which exits with ``os._exit``): once it stopped and
    ``asyncio.run`` returned, the interpreter's exit joined the agent's pool thread, and the
    process hung for as long as the call, for good here (AGT4/AGT7: a plain function cannot be
    interrupted; docs/operating.md "Calls left running")."""
    script = tmp_path / "embedded.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, sys, threading, time
            from stepwarden import App, Step
            from stepwarden.agent import AgentSettings

            app = App(sys.argv[1])
            agent = app.agent("a", concurrency=1)
            entered = threading.Event()

            @agent.operation
            def hang(req):
                entered.set()
                time.sleep(3600)

            app.workflow("w", [Step("s1", "a.hang", complete_by=60)])

            async def main():
                stop = asyncio.Event()
                worker = app.worker(agent=AgentSettings(shutdown_grace=0.5))
                run = asyncio.create_task(worker.run(stop))
                await app.submit_async("w", {})
                while not entered.is_set():
                    await asyncio.sleep(0.05)
                stop.set()
                await run

            asyncio.run(main())
            app.close()
            print("returned", flush=True)
            """
        )
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), f"sqlite:///{tmp_path / 'store.db'}"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0 and done.stdout.strip() == "returned", done
    assert time.monotonic() - started < 60


def test_an_application_exits_though_a_plain_alert_sink_never_returns(tmp_path: Path) -> None:
    """A plain CallableSink runs in a thread of the sink's own, which a stuck delivery (a dead
    host, no timeout of its own) kept from the interpreter's exit, as the agents' did."""
    script = tmp_path / "sink.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, time
            from stepwarden.alerts import Alert, CallableSink

            sink = CallableSink(lambda alert: time.sleep(3600))
            alert = Alert(1, "task_error", 1, "s1", "boom", time.time())

            async def main():
                try:
                    await asyncio.wait_for(sink.send(alert), 0.5)
                except asyncio.TimeoutError:
                    print("timed out", flush=True)

            asyncio.run(main())
            sink.close()
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "timed out", done
