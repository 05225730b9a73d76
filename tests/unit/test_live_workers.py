"""views.live_workers: what the demo warns about (workers it did not start, live on its store)."""

from __future__ import annotations

import asyncio

from stepwarden.clock import FakeClock
from stepwarden.store import Store, views


def test_only_workers_not_stopped_with_a_fresh_heartbeat_count(store: Store, clock: FakeClock) -> None:
    beat = store.worker_beat
    asyncio.run(beat("old:1:aaaaaa", ["scheduler"], []))
    asyncio.run(beat("gone:2:bbbbbb", ["agent"], ["svc"]))
    asyncio.run(beat("gone:2:bbbbbb", ["agent"], ["svc"], stopped=True))
    assert store.transact_sync(views.live_workers, 3.0) == 1, "a stopped worker is not live"
    clock.advance(5.0)  # the database clock: the first one's heartbeat is now 5 s old
    asyncio.run(beat("new:3:cccccc", ["agent"], ["svc"]))
    assert store.transact_sync(views.live_workers, 3.0) == 1, "only the fresh heartbeat counts"
    assert store.transact_sync(views.live_workers, 10.0) == 2
