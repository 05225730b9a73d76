"""What the lease keeper does around the leader's own work (LEAD2, LEAD3, LEAD5, LEAD6, LEAD7):
a work that waits between rounds, raises, returns, or will not stop; an acquire whose answer
came too late to trust, or never comes; the keeper itself cancelled.

Fake time as in ``test_leader`` (TTL 5 s, renew every 1 s, margin 1 s, retry every 1 s, stall
after 3 s); the keeper starts at monotonic 1000.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace
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


def test_a_loop_that_only_sleeps_keeps_one_term(tracked_store: Any, clock: FakeClock, fake_time: Any) -> None:
    """A loop that polls and waits with a plain ``lead.sleep``, never calling ``lead.progress``:
    its waits are idle, so it keeps its term (a version that counted every wait after a round
    with no progress reported gave the lease up every ``stall_after`` and campaigned again)."""
    polls: list[float] = []

    async def poll(lead: Leadership) -> None:
        while True:
            polls.append(clock.monotonic())
            await lead.sleep(1.0)

    async def body() -> None:
        ks = Keepers(fake_time)
        keeper = LeaseKeeper(tracked_store, LEASE, "A", poll, settings=S, clock=clock)
        try:
            ks.start(keeper)
            await fake_time.run_for(20.5)
            assert keeper.is_leader and keeper.terms_held == 1
            assert len(polls) == 21
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
        # It waits a brief stop write's bound (real time) for a grant that may still come
        await asyncio.wait_for(asyncio.shield(task), keeper.stop_writes.brief + 2)
        assert task.done() and task.exception() is None
        assert not keeper.is_leader

    run(body())


A_SETTINGS = replace(S, retry_every=1.5)


class MainPoolDown:
    """The store as a process sees it whose roles' pool cannot reach the database while its lease
    lane's own connection can (on PostgreSQL lease transactions have a connection of their own):
    once ``down``, every transaction but the lease lane's raises."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.down = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)  # acquire, renew, resign: the lease lane

    def _check(self, fn: Any = None) -> None:
        if self.down and getattr(fn, "stepwarden_lane", "main") != "lease":
            raise ConnectionError("couldn't get a connection after 5.00 sec")

    async def transact(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._check(fn)
        return await self.store.transact(fn, *args, **kwargs)

    async def sweep_expired(self, *args: Any) -> Any:
        self._check()
        return await self.store.sweep_expired(*args)


def test_a_supervisor_whose_sweeps_all_fail_gives_its_lease_to_one_that_can_sweep(
    tracked_store: Any, clock: FakeClock, fake_time: Any, dispatch_requests: Any
) -> None:
    """A's pool cannot reach the store, its lease connection can. Each failed sweep was followed
    by ``lead.sleep``, which marked progress: A kept the lease for good (still leading after 60 s,
    B never led) and the expired attempt was never rescued. Now A gives the lease up once
    stall_after (3 s) has passed since it last did any work, and B rescues the attempt."""
    [task_id] = dispatch_requests(tracked_store, 1, budget=2.0)  # complete-by: 1002 (monotonic)
    sick = MainPoolDown(tracked_store)
    sick.down = True
    every_second = SupervisorSettings(interval=1.0, retention=None)
    sup_a = Supervisor(sick, "A", clock=clock, settings=every_second)  # type: ignore[arg-type]
    sup_b = Supervisor(tracked_store, "B", clock=clock, settings=every_second)
    # A campaigns again 1.5 s after it gives up, B every second: never on the same fake instant,
    # where which of the two wins was up to the threads (A won once under load in CI).
    a = LeaseKeeper(sick, "supervisor", "A", sup_a.lead, settings=A_SETTINGS, clock=clock)  # type: ignore[arg-type]
    b = LeaseKeeper(tracked_store, "supervisor", "B", sup_b.lead, settings=S, clock=clock)

    async def body() -> None:
        ks = Keepers(fake_time)
        try:
            ks.start(a)
            await fake_time.settle()
            ks.start(b)
            await fake_time.run_for(3.0)
            assert a.is_leader and not b.is_leader  # within stall_after: A still leads
            await fake_time.run_for(7.0)
            assert not a.is_leader and b.is_leader
            assert a.terms_held == 1 and b.terms_held == 1
        finally:
            await ks.close()

    run(body())
    start = 1_700_000_000.0  # the FakeClock's wall time at monotonic 1000
    # A's sweeps fail from +0 on and the waits after them count: the term's start is its last
    # progress, so the renewal at +4 finds 4 s without any and A resigns; B, campaigning every
    # second, leads from +5.
    [(term_a, holder_a, got_a, ended_a), (term_b, holder_b, got_b, _)] = terms(tracked_store)
    assert (term_a, holder_a, got_a, ended_a) == (1, "A", start, start + 4.0)
    assert (term_b, holder_b, got_b) == (2, "B", start + 5.0)
    assert sup_a.rescued == 0 and sup_b.rescued == 1
    rescued = tracked_store.transact_sync(
        lambda tx: tx.sql("SELECT actor FROM events WHERE task_id = ? AND kind = 'rescued'", (task_id,))
    )
    assert [r["actor"] for r in rescued] == ["B"]


def test_an_alert_dispatcher_whose_rounds_all_fail_gives_its_lease_to_one_that_can_deliver(
    tracked_store: Any, clock: FakeClock, fake_time: Any
) -> None:
    """The dispatcher reported progress after every round, failed or not: a dispatcher whose pool
    could not reach the store kept the alerts lease and nothing was delivered. Now its lease
    goes to B, which delivers the alert."""
    from stepwarden.alerts import ALERT_LEASE, Alert, AlertDispatcher, AlertSettings, CallableSink
    from stepwarden.store.records import alert

    got: list[tuple[str, int]] = []

    def sink(who: str) -> CallableSink:
        async def send(a: Alert) -> None:
            got.append((who, a.id))

        return CallableSink(send, name="pager")

    sick = MainPoolDown(tracked_store)
    every_second = AlertSettings(interval=1.0)
    d_a = AlertDispatcher(sick, [sink("A")], "A", clock=clock, settings=every_second)  # type: ignore[arg-type]
    d_b = AlertDispatcher(tracked_store, [sink("B")], "B", clock=clock, settings=every_second)
    # A campaigns again 1.5 s after it gives up, B every second: never on the same fake instant,
    # where which of the two wins was up to the threads (A won once under load in CI).
    a = LeaseKeeper(sick, ALERT_LEASE, "A", d_a.lead, settings=A_SETTINGS, clock=clock)  # type: ignore[arg-type]
    b = LeaseKeeper(tracked_store, ALERT_LEASE, "B", d_b.lead, settings=S, clock=clock)

    async def body() -> None:
        ks = Keepers(fake_time)
        try:
            ks.start(a)
            await fake_time.settle()  # A leads, has registered its sink and done a round
            sick.down = True
            made = tracked_store.transact_sync(lambda tx: alert(tx, "task_error", None, "charge", "declined"))
            ks.start(b)
            await fake_time.run_for(3.0)
            assert a.is_leader and got == []
            await fake_time.run_for(7.0)
            assert not a.is_leader and b.is_leader and a.terms_held == 1
            assert got == [("B", made["id"])]
        finally:
            await ks.close()
            d_a.close()
            d_b.close()

    run(body())


def test_a_wait_after_a_failed_round_counts_towards_a_stall(
    tracked_store: Any, clock: FakeClock, fake_time: Any
) -> None:
    """An application's loop that catches its errors and waits with ``lead.sleep(s, failed=True)``
    after each failed round, as the docs show: the wait restarted the stall clock, so a loop that
    never got anything done kept its lease."""
    rounds: list[float] = []

    async def failing(lead: Leadership) -> None:
        while True:
            rounds.append(clock.monotonic())
            with contextlib.suppress(ConnectionError):
                raise ConnectionError("the service is down")
            await lead.sleep(1.0, failed=True)

    async def body() -> None:
        ks = Keepers(fake_time)
        keeper = LeaseKeeper(tracked_store, LEASE, "A", failing, settings=S, clock=clock)
        try:
            ks.start(keeper)
            # The term's start (1000) is its last progress: the renewal at +3 finds 3 s, not
            # more than stall_after; the one at +4 finds 4 s.
            await fake_time.run_for(3.5)
            assert keeper.is_leader and keeper.terms_held == 1
            await fake_time.run_for(1.0)
            assert not keeper.is_leader
            assert rounds[:4] == [1000.0, 1001.0, 1002.0, 1003.0]
        finally:
            await ks.close()

    run(body())
    [(term, holder, _, ended)] = terms(tracked_store)[:1]
    assert (term, holder) == (1, "A") and ended is not None


@pytest.mark.parametrize("live", [True, False], ids=["beats-again", "stays-silent"])
def test_a_term_begun_as_the_store_comes_back_waits_before_judging_heartbeats(
    tracked_store: Any, clock: FakeClock, fake_time: Any, dispatch_requests: Any, live: bool
) -> None:
    """REL3: in an outage no worker can beat. A supervisor whose term began as the store came back
    judged at once by heartbeats a minute old, and took live workers for dead: their steps were
    retried beside the calls still running. Heartbeats are judged once the store has answered for
    HEARTBEATS_SETTLE (5 s): a live worker has beaten again by then; a silent one is rescued."""
    from stepwarden.supervisor import HEARTBEATS_SETTLE

    [task_id] = dispatch_requests(tracked_store, 1, budget=600.0)
    asyncio.run(tracked_store.worker_beat("W", ["agent"], ["svc"]))
    assert len(asyncio.run(tracked_store.claim_requests("W", ["svc"], 1))) == 1
    clock.advance(60.0)  # the outage: nobody beat, nobody led
    sup = Supervisor(tracked_store, "A", clock=clock, settings=SupervisorSettings(interval=1.0))
    keeper = LeaseKeeper(tracked_store, "supervisor", "A", sup.lead, settings=S, clock=clock)

    async def body() -> None:
        ks = Keepers(fake_time)
        try:
            ks.start(keeper)
            for second in range(12):
                await fake_time.run_for(1.0)
                if second == 0:
                    assert keeper.is_leader
                    assert sup.rescued == 0, "judged by a heartbeat a minute old, at once"
                if live and second >= 1:
                    await tracked_store.worker_beat("W", ["agent"], ["svc"])  # its pool is back
                if second < HEARTBEATS_SETTLE - 1:
                    assert sup.rescued == 0, f"rescued {second + 1} s into the term"
        finally:
            await ks.close()

    run(body())
    assert sup.rescued == (0 if live else 1)
    rescued = tracked_store.transact_sync(
        lambda tx: tx.sql("SELECT detail FROM events WHERE task_id = ? AND kind = 'rescued'", (task_id,))
    )
    assert len(rescued) == (0 if live else 1)


def test_a_read_of_the_owners_that_waited_out_an_outage_restarts_the_heartbeat_settle(
    tracked_store: Any, clock: FakeClock, dispatch_requests: Any
) -> None:
    """A read that waited (a pool's connection, a short outage) and then went through finds every
    heartbeat as old as its wait and a beat more. A wait of half of dead_after or more restarts
    the settle, so the silent worker is judged only once beats have had time to come through;
    with the bound at dead_after itself, a 2 s wait (dead_after 3 s) judged at once."""
    from stepwarden.store import transitions
    from stepwarden.supervisor import HEARTBEATS_SETTLE

    dispatch_requests(tracked_store, 1, budget=600.0)
    asyncio.run(tracked_store.worker_beat("W", ["agent"], ["svc"]))
    assert len(asyncio.run(tracked_store.claim_requests("W", ["svc"], 1))) == 1
    got = asyncio.run(tracked_store.acquire_lease("supervisor", "A", 1e6))
    assert got is not None
    term = int(got[0])
    clock.advance(10.0)  # W is silent from here on

    class SlowOwners:
        """The store, except that reading the owners takes ``slow`` seconds of the clock."""

        slow = 2.0

        def __getattr__(self, name: str) -> Any:
            return getattr(tracked_store, name)

        async def transact(self, fn: Any, *args: Any, **kw: Any) -> Any:
            if fn is transitions.owners_in_flight:
                clock.advance(self.slow)
            return await tracked_store.transact(fn, *args, **kw)

    slow = SlowOwners()
    sup = Supervisor(slow, "A", clock=clock, settings=SupervisorSettings(dead_after=3.0))  # type: ignore[arg-type]
    assert asyncio.run(sup.sweep(term)).rescued == 0, "judged right after a read that waited 2 s"
    slow.slow = 0.0
    for _ in range(int(HEARTBEATS_SETTLE) - 1):
        clock.advance(1.0)
        assert asyncio.run(sup.sweep(term)).rescued == 0
    clock.advance(1.0)
    assert asyncio.run(sup.sweep(term)).rescued == 1  # settled, and W is still silent
