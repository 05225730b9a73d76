"""A plain-callable alert sink stuck in its thread (a webhook call with no timeout against a dead
host) must not keep a stopping worker alive: its delivery times out, the event loop closes at
once, and the worker command exits despite the thread."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from stepwarden import cli
from stepwarden.alerts import SINK_THREAD_PREFIX, CallableSink


def test_a_stuck_callable_sink_does_not_hold_the_event_loop_open() -> None:
    release, entered = threading.Event(), threading.Event()
    names: list[str] = []

    def stuck(alert: Any) -> None:
        names.append(threading.current_thread().name)
        entered.set()
        release.wait(30)

    sink = CallableSink(stuck, timeout=0.2)
    timed_out: list[float] = []

    async def deliver() -> None:
        call = asyncio.ensure_future(sink.send(None))  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while not entered.is_set():  # the call is under way in the sink's thread
            assert time.monotonic() < deadline, "the sink's call never started"
            await asyncio.sleep(0.01)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call, timeout=sink.timeout)  # as the dispatcher bounds a delivery
        timed_out.append(time.monotonic())

    try:
        asyncio.run(deliver())
        took = time.monotonic() - timed_out[0]
    finally:
        release.set()  # let the thread end: this test's own process must not wait for it either
        sink.close()
    # the thread is still stuck (for up to 30 s) when the loop closes: nothing waited for it
    assert took < 10.0, f"asyncio.run waited {took:.1f}s for the sink's thread"
    assert names and names[0].startswith(SINK_THREAD_PREFIX)


def test_the_worker_command_exits_despite_a_stuck_sink_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(30,), name=f"{SINK_THREAD_PREFIX}_0")
    thread.start()
    exits: list[int] = []
    monkeypatch.setattr("stepwarden.cli.os._exit", exits.append)
    monkeypatch.setattr("stepwarden.cli.logging.shutdown", lambda: None)  # this process goes on
    try:
        cli._exit_despite_stuck_threads()
    finally:
        release.set()
        thread.join(5)
    assert exits == [0]
