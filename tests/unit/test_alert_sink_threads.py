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
    release = threading.Event()
    names: list[str] = []

    def stuck(alert: Any) -> None:
        names.append(threading.current_thread().name)
        release.wait(30)

    async def deliver() -> None:
        sink = CallableSink(stuck, timeout=0.2)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sink.send(None), timeout=sink.timeout)  # type: ignore[arg-type]  # as the dispatcher does

    started = time.monotonic()
    try:
        asyncio.run(deliver())
        took = time.monotonic() - started
    finally:
        release.set()  # let the thread end: this test's own process must not wait for it either
    assert took < 2.0, f"asyncio.run waited {took:.1f}s for the sink's thread"
    assert names and names[0].startswith(SINK_THREAD_PREFIX)


def test_the_worker_command_exits_despite_a_stuck_sink_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(30,), name=f"{SINK_THREAD_PREFIX}_0")
    thread.start()
    exits: list[int] = []
    monkeypatch.setattr("stepwarden.cli.os._exit", exits.append)
    try:
        cli._exit_despite_stuck_threads()
    finally:
        release.set()
        thread.join(5)
    assert exits == [0]
