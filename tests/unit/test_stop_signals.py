"""The worker command's SIGTERM and SIGINT (``cli._StopSignals``), without a process: the first
stops the worker, a second hurries it, but the same signal again within ``REPEAT_WINDOW`` of the
first is that first stop delivered twice (GNU ``timeout`` signals the process and then its
process group), not an operator's second signal. Time is a FakeClock's: the window is tested to
its edge without sleeping."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import cast

import pytest

from stepwarden.cli import REPEAT_WINDOW, _StopSignals
from stepwarden.clock import FakeClock
from stepwarden.worker import Worker


class FakeWorker:
    """What ``_StopSignals`` uses of a worker: its identity, where it notes the signal, ``hurry``."""

    identity = "w:1:abcdef"

    def __init__(self) -> None:
        self.stopped_by: str | None = None
        self.hurried = 0

    def hurry(self) -> None:
        self.hurried += 1


def signals(clock: FakeClock) -> tuple[_StopSignals, FakeWorker, asyncio.Event]:
    w = FakeWorker()
    stop = asyncio.Event()
    return _StopSignals(cast(Worker, w), stop, clock), w, stop


def test_the_first_signal_stops_the_worker_gracefully_and_names_itself(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stepwarden")
    got, w, stop = signals(clock)
    got.received("SIGTERM")
    assert stop.is_set() and w.stopped_by == "SIGTERM" and w.hurried == 0
    assert [r.getMessage() for r in caplog.records] == [
        "worker w:1:abcdef: SIGTERM: stopping gracefully; a second SIGTERM or SIGINT stops it without"
        " waiting for running calls"
    ]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_the_same_signal_again_within_the_window_is_the_same_stop(clock: FakeClock, name: str) -> None:
    got, w, _ = signals(clock)
    got.received(name)
    got.received(name)  # at once: the process, then its process group
    clock.advance(REPEAT_WINDOW - 0.01)
    got.received(name)
    assert w.hurried == 0 and w.stopped_by == name


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_the_same_signal_once_the_window_is_over_is_a_second_signal(clock: FakeClock, name: str) -> None:
    got, w, _ = signals(clock)
    got.received(name)
    clock.advance(REPEAT_WINDOW)  # the edge counts as over
    got.received(name)
    assert w.hurried == 1


def test_the_window_is_counted_from_the_first_signal_not_the_last(clock: FakeClock) -> None:
    """Repeats inside the window do not stretch it: an operator's second signal shortly after a
    doubled first one still hurries the worker."""
    got, w, _ = signals(clock)
    got.received("SIGTERM")
    clock.advance(0.2)
    got.received("SIGTERM")  # 0.2 s after the first: the same stop
    clock.advance(0.1)
    got.received("SIGTERM")  # 0.1 s after the last, 0.3 s after the first: a second signal
    assert w.hurried == 1


@pytest.mark.parametrize(("first", "second"), [("SIGTERM", "SIGINT"), ("SIGINT", "SIGTERM")])
def test_the_other_signal_is_always_a_second_signal(clock: FakeClock, first: str, second: str) -> None:
    """Ctrl-C after a service manager's SIGTERM is someone asking again, however soon it comes."""
    got, w, _ = signals(clock)
    got.received(first)
    got.received(second)  # no time at all in between
    assert w.hurried == 1 and w.stopped_by == first


def test_every_later_signal_is_passed_on_and_the_first_is_kept(clock: FakeClock) -> None:
    """A third signal is the worker's to ignore (``Worker.hurry`` changes nothing more); the stop
    keeps the first signal's name and time."""
    got, w, stop = signals(clock)
    got.received("SIGTERM")
    got.received("SIGINT")
    clock.advance(1.0)
    got.received("SIGTERM")
    assert w.hurried == 2 and w.stopped_by == "SIGTERM" and stop.is_set()


def test_the_worker_command_run_in_process_sets_the_stop_signals_back(tmp_path: Path) -> None:
    """The worker command ignores SIGTERM and SIGINT once it has stopped (a late signal ended a
    completed stop with 143 or 130), and as the process's own command it leaves them ignored
    for the interpreter's shutdown; run in-process (a test, an embedding program) it set them to
    ignored for good, and Ctrl-C no longer stopped the host. They are now set back."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import os, signal, threading
        from stepwarden.cli import main
        threading.Timer(2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        try:
            main(["--db", "sqlite:///{tmp_path / "w.db"}", "worker", "--roles", "scheduler,supervisor"])
        except SystemExit as e:
            print("exit", e.code)
        print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-2:] == ["True", "True"], p.stdout + p.stderr
