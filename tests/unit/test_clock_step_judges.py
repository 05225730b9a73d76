"""The database's clock steps (an NTP step, a resumed virtual machine on the database's host):
what the supervisor and the claim make of it, on the fake clock (``FakeClock.set_wall`` moves the
wall clock, the store's clock on SQLite, and leaves the monotonic clock alone).

The multi-process counterpart, with workers whose host clock is stepped for real, is
``tests/integration/test_clock_steps.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from stepwarden.clock import FakeClock
from stepwarden.leader import LeaseKeeper
from stepwarden.store import Store
from stepwarden.supervisor import Supervisor, SupervisorSettings


def _leader(store: Store) -> int:
    got = asyncio.run(store.acquire_lease("supervisor", "A", 1e6))
    assert got is not None
    return int(got[0])


def test_a_step_forward_of_the_database_clock_does_not_make_live_workers_look_dead(
    store: Store, clock: FakeClock, dispatch_requests: object
) -> None:
    """Every heartbeat ages at once by the step; a supervisor that swept before the workers' next
    beats presumed the live ones dead and had their steps run twice. It now also needs to have
    watched the heartbeat stay unchanged for half of dead_after on its own monotonic clock, which
    a live worker's next beat ends; a worker that really went silent is rescued as soon as before."""
    dispatch_requests(store, 1, budget=600.0)  # type: ignore[operator]
    asyncio.run(store.worker_beat("W", ["agent"], ["svc"]))
    assert len(asyncio.run(store.claim_requests("W", ["svc"], 1))) == 1
    term = _leader(store)
    sup = Supervisor(store, "A", clock=clock, settings=SupervisorSettings(dead_after=3.0))
    for _ in range(3):  # W beats every second; the supervisor sweeps every second
        clock.advance(1.0)
        asyncio.run(store.worker_beat("W", ["agent"], ["svc"]))
        assert asyncio.run(sup.sweep(term)).rescued == 0
    clock.advance(0.9)  # just before W's next beat ...
    clock.set_wall(clock.wall() + 3.5)  # ... the database's clock steps forward 3.5 s
    assert asyncio.run(sup.sweep(term)).rescued == 0, "a live worker taken for dead after a clock step"
    clock.advance(0.1)
    asyncio.run(store.worker_beat("W", ["agent"], ["svc"]))  # its next beat, on the new time
    clock.advance(0.9)
    assert asyncio.run(sup.sweep(term)).rescued == 0
    # Now W goes silent (its last beat 0.9 s ago): rescued once its heartbeat is older than
    # dead_after, as without the watch, which has seen the same beat all along.
    swept_at = []
    for _ in range(6):
        clock.advance(0.5)
        if asyncio.run(sup.sweep(term)).rescued:
            swept_at.append(clock.monotonic())
            break
    assert swept_at, "the silent worker was never rescued"
    [row] = store.transact_sync(
        lambda tx: tx.sql(
            "SELECT e.at - w.heartbeat_at AS silent FROM events e, workers w"
            " WHERE e.kind = 'rescued' AND w.id = 'W'"
        )
    )
    assert row["silent"] <= 3.0 + 0.5 + 1e-6, row  # within a sweep of dead_after


def test_a_heartbeat_first_seen_old_is_judged_after_the_watch(
    store: Store, clock: FakeClock, dispatch_requests: object
) -> None:
    """A worker the supervisor has not watched (its first sweep that sees it, after a step or a
    restart of the sweep) is judged half of dead_after later, not at once, and then rescued if its
    heartbeat did not move."""
    dispatch_requests(store, 1, budget=600.0)  # type: ignore[operator]
    asyncio.run(store.worker_beat("W", ["agent"], ["svc"]))
    assert len(asyncio.run(store.claim_requests("W", ["svc"], 1))) == 1
    term = _leader(store)
    clock.advance(10.0)  # W silent for 10 s before the supervisor first looks
    sup = Supervisor(store, "A", clock=clock, settings=SupervisorSettings(dead_after=3.0))
    assert asyncio.run(sup.sweep(term)).rescued == 0
    clock.advance(1.0)
    assert asyncio.run(sup.sweep(term)).rescued == 0  # watched for 1 s of the 1.5 s
    clock.advance(0.5)
    assert asyncio.run(sup.sweep(term)).rescued == 1


def test_a_step_forward_of_the_database_clock_does_not_hand_the_lease_to_a_campaigner(
    tracked_store: Any, clock: FakeClock, fake_time: Any
) -> None:
    """The supervisor's lease is taken from a holder presumed dead by its heartbeat's age: a step
    forward aged the live holder's heartbeat past dead_after, and a campaigner that looked before
    its next beat took the lease (fenced, so only a needless change of leader, whose successor then
    waits HEARTBEATS_SETTLE before it rescues anything). Now the campaigner must also have watched
    that heartbeat unchanged; the holder's next beat ends it."""
    from dataclasses import replace

    from test_leader import LEASE, Keepers, S, Work, beat, lease_row

    async def body() -> None:
        ks = Keepers(fake_time)
        a = LeaseKeeper(tracked_store, LEASE, "A", Work(clock), settings=S, clock=clock)
        b = LeaseKeeper(
            tracked_store, LEASE, "B", Work(clock), settings=replace(S, take_from_dead=3.0), clock=clock
        )
        try:
            beat(tracked_store, "A", clock.wall())
            ks.start(a)
            await fake_time.settle()
            ks.start(b)
            # A leads and beats every 1.5 s (a worker whose dead_after of 3 s is twice its
            # heartbeat); B campaigns every second, so it reads A's row between any two beats.
            for _ in range(4):
                await fake_time.run_for(1.5)
                beat(tracked_store, "A", clock.wall())
            assert (a.is_leader, b.is_leader) == (True, False)
            await fake_time.run_for(0.125)
            clock.set_wall(clock.wall() + 3.5)  # the database's clock steps forward
            await fake_time.run_for(1.375)  # B campaigns before A's next beat: its beat looks 4.5 s old
            for _ in range(3):
                beat(tracked_store, "A", clock.wall())
                await fake_time.run_for(1.5)
            assert (a.is_leader, b.is_leader) == (True, False), "the lease changed hands after a clock step"
            assert lease_row(tracked_store)["term"] == 1
        finally:
            await ks.close()

    asyncio.run(body())
