"""What the lease keeper does around the leader's own work (LEAD2, LEAD3, LEAD5, LEAD6, LEAD7):
a work that waits between rounds, raises, returns, or will not stop; an acquire whose answer
came too late to trust, or never comes; the keeper itself cancelled.

Fake time as in ``test_leader`` (TTL 5 s, renew every 1 s, margin 1 s, retry every 1 s, stall
after 3 s); the keeper starts at monotonic 1000.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from test_leader import LEASE, Flaky, Keepers, S, Work, run, terms

from stepwarden.clock import FakeClock
from stepwarden.leader import MAX_FAILURE_PAUSE, Leadership, LeaseKeeper, LeaseSettings
from stepwarden.supervisor import Supervisor, SupervisorSettings


class SlowAcquire(Flaky):
    """The store answering an acquire ``delay`` seconds after it committed (a slow round trip, a
    lock it waited on), or never (``hang``: a connection that went dark)."""

    def __init__(self, store: Any, clock: FakeClock) -> None:
        super().__init__(store, clock)
        self.delay = 0.0
        self.hang_acquire = False

    async def acquire_lease(self, *args: Any) -> Any:
        got = await self.store.acquire_lease(*args)
        if self.hang_acquire:
            await asyncio.Event().wait()
        await self.clock.sleep(self.delay)
        return got


def test_a_leader_that_sleeps_between_rounds_is_not_a_stall(
    tracked_store: Any, clock: FakeClock, fake_time: Any
) -> None:
    """The documented loop (work, then wait a minute) under ``stall_after`` 3 s: the waits went
    unreported, so the keeper cancelled the work as stalled, resigned and ran it again every
    few seconds."""
    rounds: list[tuple[int, float]] = []

    async def report(lead: Leadership) -> None:
        while True:
            rounds.append((lead.term, clock.monotonic()))
            lead.progress()
            await lead.sleep(10)

    async def body() -> None:
        ks = Keepers(fake_time)
        keeper = LeaseKeeper(tracked_store, LEASE, "A", report, settings=S, clock=clock)
        try:
            ks.start(keeper)
            await fake_time.run_for(35.0)
            assert rounds == [(1, 1000.0), (1, 1010.0), (1, 1020.0), (1, 1030.0)]
            assert keeper.is_leader and keeper.terms_held == 1
        finally:
            await ks.close()

    run(body())


def test_a_supervisor_interval_above_stall_after_keeps_one_term(
    tracked_store: Any, clock: FakeClock, fake_time: Any
) -> None:
    """The supervisor slept its interval unreported: with interval 5 s and stall_after 3 s it gave
    its lease up after every sweep (five terms in 20 s)."""

    async def body() -> None:
        ks = Keepers(fake_time)
        sup = Supervisor(tracked_store, "A", clock=clock, settings=SupervisorSettings(interval=5.0))
        sweeps: list[float] = []
        sup.on_sweep = lambda r, seconds: sweeps.append(clock.monotonic())
        keeper = LeaseKeeper(tracked_store, "supervisor", "A", sup.lead, settings=S, clock=clock)
        try:
            ks.start(keeper)
            await fake_time.run_for(20.5)
            assert keeper.terms_held == 1 and keeper.is_leader
            assert sweeps == [1000.0, 1005.0, 1010.0, 1015.0, 1020.0]
        finally:
            await ks.close()

    run(body())


def test_a_term_acquired_past_its_trust_window_never_starts_the_work(
    tracked_store: Any, clock: FakeClock, fake_time: Any
) -> None:
    """The acquire committed at +0 and its answer came at +4.5, after trust (ttl - margin = 4 s)
    ended: the work used to start on that term anyway, for a first slice, before the keeper
    noticed. Now the term is resigned unused, and the next campaign leads normally."""
    work = Work(clock)
    slow = SlowAcquire(tracked_store, clock)
    slow.delay = 4.5

    async def body() -> None:
        ks = Keepers(fake_time)
        keeper = LeaseKeeper(slow, LEASE, "A", work, settings=S, clock=clock)  # type: ignore[arg-type]
        try:
            ks.start(keeper)
            await fake_time.run_for(5.0)
            assert work.started == [] and not keeper.is_leader and keeper.terms_held == 0
            assert [(t, ended is not None) for t, _, _, ended in terms(tracked_store)] == [(1, True)]
            slow.delay = 0.0
            await fake_time.run_for(2.0)
            assert keeper.is_leader and work.started and work.started[0][0] == 2
        finally:
            await ks.close()

    run(body())


def test_work_that_keeps_raising_is_logged_with_its_traceback_and_retried_more_slowly(
    tracked_store: Any, clock: FakeClock, fake_time: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """It was logged at INFO without a traceback and run again every retry_every (11 runs in 10 s).
    Now each failure is an ERROR with its traceback, and the pause doubles: 1, 2, 4, 8 s."""
    starts: list[float] = []

    async def broken(lead: Leadership) -> None:
        starts.append(clock.monotonic())
        raise RuntimeError("boom")

    async def body() -> None:
        ks = Keepers(fake_time)
        keeper = LeaseKeeper(tracked_store, LEASE, "A", broken, settings=S, clock=clock)
        try:
            ks.start(keeper)
            await fake_time.run_for(20.0)
        finally:
            await ks.close()
        assert starts == [1000.0, 1001.0, 1003.0, 1007.0, 1015.0]
        assert keeper.failures == 5

    with caplog.at_level(logging.INFO, logger="stepwarden.leader"):
        run(body())
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 5 and all(r.exc_info and r.exc_info[1] is not None for r in errors)
    assert "raised (3 term(s) in a row); campaigning again in 4s" in errors[2].getMessage()


def test_the_pause_after_failures_is_capped() -> None:
    keeper = LeaseKeeper(None, LEASE, "A", Work(FakeClock()), settings=S)  # type: ignore[arg-type]
    keeper.failures = 40
    assert keeper._pause() == MAX_FAILURE_PAUSE
    slow = LeaseKeeper(None, LEASE, "A", Work(FakeClock()), settings=LeaseSettings(retry_every=90.0))  # type: ignore[arg-type]
    slow.failures = 3
    assert slow._pause() == 90.0  # never below retry_every


def test_work_that_returns_is_run_again_at_the_next_term_without_slowing_down(
    tracked_store: Any, clock: FakeClock, fake_time: Any
) -> None:
    """A leader's work is a loop: one that returns gives the lease up and is started again when
    this process wins it back (docs/operating.md says so)."""
    starts: list[tuple[int, float]] = []

    async def once(lead: Leadership) -> None:
        starts.append((lead.term, clock.monotonic()))

    async def body() -> None:
        ks = Keepers(fake_time)
        keeper = LeaseKeeper(tracked_store, LEASE, "A", once, settings=S, clock=clock)
        try:
            ks.start(keeper)
            await fake_time.run_for(2.5)
            assert starts == [(1, 1000.0), (2, 1001.0), (3, 1002.0)] and keeper.failures == 0
        finally:
            await ks.close()

    run(body())


def test_work_that_swallows_its_cancellation_is_not_run_twice(
    tracked_store: Any, clock: FakeClock, fake_time: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The renewal is refused (another holder); the work catches CancelledError and goes on. The
    keeper used to wait for it forever, still calling itself leader. Now it stops leading at once,
    says so at ERROR, and does not campaign (start a second copy) while the first still runs."""
    cut = Flaky(tracked_store, clock)
    runs: list[float] = []
    release = asyncio.Event()

    async def stubborn(lead: Leadership) -> None:
        runs.append(clock.monotonic())
        while not release.is_set():
            try:
                lead.progress()
                await clock.sleep(0.25)
            except asyncio.CancelledError:
                pass

    async def body() -> None:
        ks = Keepers(fake_time)
        keeper = LeaseKeeper(cut, LEASE, "A", stubborn, settings=S, clock=clock)  # type: ignore[arg-type]
        try:
            ks.start(keeper)
            await fake_time.run_for(1.5)
            cut.refuse = True
            await fake_time.run_for(1.0)  # refused at +2
            assert not keeper.is_leader
            cut.refuse = False
            await fake_time.run_for(20.0)
            assert runs == [1000.0] and not keeper.is_leader
            released = clock.monotonic()
            release.set()  # the first copy ends by itself: only now is the work started again
            await fake_time.run_for(3.0)
            assert len(runs) > 1 and released < runs[1] <= released + 1.5
            assert [t for t, *_ in terms(tracked_store)][:2] == [1, 2]
        finally:
            release.set()
            await ks.close()

    with caplog.at_level(logging.ERROR, logger="stepwarden.leader"):
        run(body())
    assert any("has not ended 5s after it was cancelled" in r.getMessage() for r in caplog.records)


def test_cancelling_the_keeper_while_its_work_cleans_up_is_not_swallowed(
    tracked_store: Any, clock: FakeClock, fake_time: Any
) -> None:
    """The keeper stops leading (its renewal refused) and waits for its cancelled work to clean
    up; cancelled meanwhile (a worker's shutdown), it absorbed its own cancellation with the
    work's and campaigned on: it took term 2."""
    cut = Flaky(tracked_store, clock)

    async def slow_to_stop(lead: Leadership) -> None:
        try:
            while True:
                lead.progress()
                await clock.sleep(0.25)
        except asyncio.CancelledError:
            await clock.sleep(0.5)  # cleanup that takes a while
            raise

    async def body() -> None:
        keeper = LeaseKeeper(cut, LEASE, "A", slow_to_stop, settings=S, clock=clock)  # type: ignore[arg-type]
        task = asyncio.create_task(keeper.run(asyncio.Event()))
        try:
            await fake_time.run_for(1.5)
            cut.refuse = True
            await fake_time.run_for(0.625)  # refused at +2: the work is cleaning up until +2.5
            assert not keeper.is_leader and not task.done()
            cut.refuse = False
            task.cancel()
            await fake_time.run_for(5.0)
            assert task.done() and task.cancelled()
            assert keeper.terms_held == 1 and [t for t, *_ in terms(tracked_store)] == [1]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    run(body())


def test_stop_ends_a_campaign_whose_acquire_never_answers(
    tracked_store: Any, clock: FakeClock, fake_time: Any
) -> None:
    """An acquire on a connection that went dark (no answer, no error) held run() past stop."""
    hung = SlowAcquire(tracked_store, clock)
    hung.hang_acquire = True

    async def body() -> None:
        keeper = LeaseKeeper(hung, LEASE, "A", Work(clock), settings=S, clock=clock)  # type: ignore[arg-type]
        stop = asyncio.Event()
        task = asyncio.create_task(keeper.run(stop))
        await fake_time.run_for(1.0)
        assert not task.done()
        stop.set()
        await fake_time.run_for(0.5)
        assert task.done() and task.exception() is None
        assert not keeper.is_leader

    run(body())
