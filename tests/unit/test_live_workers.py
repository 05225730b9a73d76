"""views.live_workers: what the demo warns about (workers it did not start, live on its store)."""

from __future__ import annotations

import asyncio
import json

import pytest

from stepwarden.clock import FakeClock
from stepwarden.store import Store, views


def test_only_workers_not_stopped_with_a_fresh_heartbeat_count(store: Store, clock: FakeClock) -> None:
    beat = store.worker_beat
    asyncio.run(beat("old:1:aaaaaa", ["scheduler"], []))
    asyncio.run(beat("gone:2:bbbbbb", ["agent"], ["svc"]))
    asyncio.run(beat("gone:2:bbbbbb", ["agent"], ["svc"], stopped=True))
    assert store.transact_sync(views.live_workers, 3.0) == ["old:1:aaaaaa"], "a stopped worker is not live"
    clock.advance(5.0)  # the database clock: the first one's heartbeat is now 5 s old
    asyncio.run(beat("new:3:cccccc", ["agent"], ["svc"]))
    assert store.transact_sync(views.live_workers, 3.0) == ["new:3:cccccc"], "only the fresh heartbeat counts"
    assert store.transact_sync(views.live_workers, 10.0) == ["new:3:cccccc", "old:1:aaaaaa"]


def test_a_worker_killed_without_a_word_leaves_the_metrics_but_stays_listed_as_silent(
    store: Store, clock: FakeClock
) -> None:
    """A SIGKILLed worker never records its stop. Its row stays until the leader prunes it (days
    later), and ``/metrics`` counted it live all that while: in ``stepwarden_workers``, with its
    own ``worker`` series of heartbeat age and breakers (a crash-looping deployment added one more
    at each restart). Past ``SILENT_AFTER`` it is no live worker; an operator's listing still shows
    it, marked silent."""
    from prometheus_client.parser import text_string_to_metric_families

    from stepwarden.liveness import SILENT_AFTER
    from stepwarden.metrics import StoreMetrics

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
    assert (listed[killed]["state"], listed[live]["state"]) == ("silent", "live")
    only_live = store.transact_sync(views.list_workers, False, False)
    assert [w["id"] for w in only_live] == [live]
    assert [w["state"] for w in only_live] == ["live"]


def test_the_cli_table_and_the_dashboard_mark_a_silent_worker(
    store: Store, clock: FakeClock, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator reading ``stepwarden workers`` or the dashboard's workers page sees which worker
    died without a word: its row is not stopped, so without the mark it would pass for live."""
    import warnings

    from stepwarden.cli_render import workers_table
    from stepwarden.cli_views import _show
    from stepwarden.dashboard.web import create_app
    from stepwarden.liveness import SILENT_AFTER

    with warnings.catch_warnings():  # starlette's note about httpx, as in the dashboard tests
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    killed, live, gone = "killed:1:aaaaaa", "live:2:bbbbbb", "gone:3:cccccc"
    asyncio.run(store.worker_beat(killed, ["agent"], ["svc"]))
    asyncio.run(store.worker_beat(gone, ["scheduler"], []))
    asyncio.run(store.worker_beat(gone, ["scheduler"], [], stopped=True))
    clock.advance(SILENT_AFTER + 30)
    asyncio.run(store.worker_beat(live, ["agent"], ["svc"]))

    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: pytest-xdist's workers say 80
    rows = store.transact_sync(views.list_workers, True)
    states = {w["id"]: w["state"] for w in rows}
    assert states == {killed: "silent", live: "live", gone: "stopped"}, states
    workers_table(rows)
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines[killed][1] == "silent" and "(1.5m" in lines[killed], lines[killed]
    assert lines[live][1] == "live" and "(0.0s" in lines[live], lines[live]
    assert lines[gone][1] == "stopped", lines[gone]
    # `stepwarden workers --json` prints the same rows: the state is in them, as the table shows it.
    _show(rows, True, "workers_table")
    printed = {w["id"]: w for w in json.loads(capsys.readouterr().out)}
    assert {k: w["state"] for k, w in printed.items()} == states
    assert printed[killed]["silent"] and not printed[gone]["silent"] and not printed[live]["silent"]

    with TestClient(create_app(store, "t")) as c:
        html = c.get("/workers").text
    assert f'data-worker="{killed}" data-silent="1"' in html
    assert f'data-worker="{live}" data-silent="0"' in html
    assert html.count(">silent</span>") == 1 and ">silent</span>=" not in html
    assert 'data-silent="1" data-state="silent"' in html and 'data-state="live"' in html
    # No stray "key=value" of a row's fields (the loop that printed `silent=True` is gone).
    assert 'class="kv small"' not in html
