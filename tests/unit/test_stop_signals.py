"""The worker command's SIGTERM and SIGINT (``cli._StopSignals``), without a process: the first
stops the worker, a second hurries it, but the same signal again within ``REPEAT_WINDOW`` of the
first is that first stop delivered twice (GNU ``timeout`` signals the process and then its
process group), not an operator's second signal. Time is a FakeClock's: the window is tested to
its edge without sleeping."""

from __future__ import annotations

import asyncio
import logging
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
