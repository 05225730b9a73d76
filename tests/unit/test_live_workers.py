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


def test_a_worker_killed_without_a_word_leaves_the_metrics_but_stays_listed_as_silent(
    store: Store, clock: FakeClock
) -> None:
    """A SIGKILLed worker never records its stop. Its row stays until the leader prunes it (days
    later), and ``/metrics`` counted it live all that while: in ``stepwarden_workers``, with its
    own ``worker`` series of heartbeat age and breakers (a crash-looping deployment added one more
    at each restart). Past ``SILENT_AFTER`` it is no live worker; an operator's listing still shows
    it, marked silent."""
    from prometheus_client.parser import text_string_to_metric_families

    from stepwarden.metrics import StoreMetrics
    from stepwarden.store.agents import SILENT_AFTER

    killed, live = "killed:1:aaaaaa", "live:2:bbbbbb"
    asyncio.run(store.worker_beat(killed, ["agent"], ["svc"], breakers={"svc": "open"}))
    clock.advance(SILENT_AFTER + 1)
    asyncio.run(store.worker_beat(live, ["agent"], ["svc"], breakers={"svc": "closed"}))

    metrics = StoreMetrics(store)
    store.transact_sync(metrics.refresh)
    text = metrics.render().decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert killed not in text, [s for s in samples if killed in s.labels.values()]
    ages = [s for s in samples if s.name == "stepwarden_worker_heartbeat_age_seconds"]
    assert [s.labels["worker"] for s in ages] == [live]
    breakers = [s for s in samples if s.name == "stepwarden_breaker_state"]
    assert [(s.labels["worker"], s.value) for s in breakers] == [(live, 0)]
    workers = {s.labels["role"]: s.value for s in samples if s.name == "stepwarden_workers"}
    assert workers["agent"] == 1
    assert {s.labels["agent"]: s.value for s in samples if s.name == "stepwarden_breakers_open"} == {"svc": 0}

    listed = {w["id"]: w for w in store.transact_sync(views.list_workers)}
    assert listed[killed]["silent"] and listed[killed]["heartbeat_age"] == SILENT_AFTER + 1
    assert not listed[live]["silent"] and listed[live]["heartbeat_age"] == 0
    only_live = store.transact_sync(views.list_workers, False, False)
    assert [w["id"] for w in only_live] == [live]
