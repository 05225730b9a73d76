"""The store's counters (OPS6) are exact and never go down: an event is counted once however late
its transaction commits (PostgreSQL gives ids before commit), and a prune that deletes events, or a
dashboard restart after it, lowers no total (Prometheus reads a lower total as a counter reset).

Every test runs on a fake clock that is also the database's clock (``open_store(clock=...)``), so
"6.5 s later" costs no time."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stepwarden import App, Step
from stepwarden.clock import FakeClock
from stepwarden.metrics import StoreMetrics, tally
from stepwarden.store import Store, open_store
from stepwarden.store import transitions as tr
from stepwarden.store.core import _register

from .conftest import WORKFLOW, Scene

DAY = 86400.0
SUP = "sup-1:1:cccccc"


def counters(metrics: StoreMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every counter sample of ``/metrics`` (``*_total``) as rendered, by name and labels."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        if fam.type == "counter":
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def stored_events(store: Store) -> dict[str, int]:
    rows = store.transact_sync(lambda tx: tx.sql("SELECT kind, COUNT(*) AS n FROM events GROUP BY kind"))
    return {r["kind"]: int(r["n"]) for r in rows}


@pytest.fixture
def app(pg_url: str, clock: FakeClock) -> Iterator[App]:
    app = App(pg_url, clock=clock)
    inv = app.agent("inv")

    @inv.operation
    def reserve(req: Any) -> int:
        return 1

    app.workflow("wf", [Step("s", "inv.reserve", complete_by=5)])
    try:
        yield app
    finally:
        app.close()


def test_on_postgres_an_event_committed_long_after_later_ones_is_counted_once(
    app: App, clock: FakeClock
) -> None:
    """The audit's scenario: a caller's block submits (its event takes id N), another task commits
    at once (id N+1), 6.5 s pass, the block commits. The reader used to move past N once N+1 was
    5 s old, and ``received`` stayed 1 for good while the store held 2."""
    metrics = StoreMetrics(app.store)

    def received() -> int:
        app.store.transact_sync(metrics.refresh)
        return metrics.tally.totals["received"]

    assert received() == 0
    with app.transaction() as tx:
        tx.submit("wf", {"slow": 1})
        app.submit("wf", {"fast": 1})
        clock.advance(6.5)
        # the committed one is counted at once, and once, while the block still holds the other
        assert received() == 1
        assert received() == 1
    assert received() == 2
    assert received() == 2
    assert stored_events(app.store)["received"] == 2
    assert counters(metrics)[("stepwarden_tasks_submitted_total", ())] == 2
    restarted = StoreMetrics(app.store)
    app.store.transact_sync(restarted.refresh)
    assert restarted.tally.totals["received"] == 2


def test_on_postgres_a_transaction_rolled_back_is_never_counted(app: App, clock: FakeClock) -> None:
    metrics = StoreMetrics(app.store)
    app.store.transact_sync(metrics.refresh)
    with pytest.raises(RuntimeError), app.transaction() as tx:
        tx.submit("wf", {"never": 1})
        app.submit("wf", {"kept": 1})
        clock.advance(6.5)
        app.store.transact_sync(metrics.refresh)
        raise RuntimeError("the caller's block fails")
    for _ in range(2):
        app.store.transact_sync(metrics.refresh)
    assert metrics.tally.totals == stored_events(app.store)
    assert metrics.tally.totals["received"] == 1


def test_reads_are_bounded_and_exact_across_batches_of_one_transaction(
    store_url: str, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many events of one transaction share its id on PostgreSQL: the reader pages by (transaction,
    id). With 2 rows a read and 2 reads a refresh, the backlog takes several refreshes, each
    counting a part, none counting a row twice."""
    monkeypatch.setattr(tally, "BATCH", 2)
    monkeypatch.setattr(tally, "ROUNDS", 2)
    store = open_store(store_url, clock=clock)
    try:
        store.transact_sync(_register, [WORKFLOW], "metrics-test")
        scene = Scene(store, store_url)
        metrics = StoreMetrics(store)
        store.transact_sync(metrics.refresh)

        def five(tx: Any) -> None:
            for i in range(5):
                tr.submit(
                    tx,
                    WORKFLOW,
                    json.dumps({"order_id": f"b{i}", "sku": "S", "quantity": 1, "amount_cents": 1}),
                    correlation_id=f"b{i}",
                    idempotency_key=None,
                    priority=0,
                    reply_to=None,
                )

        store.transact_sync(five)
        for i in range(3):
            scene.submit(f"o-{i}")
        scene.dispatch()
        want = stored_events(store)
        assert sum(want.values()) > 12  # more than a few refreshes read
        seen = [0]
        for _ in range(100):  # each refresh reads something new; a bound, not a wait
            store.transact_sync(metrics.refresh)
            seen.append(sum(metrics.tally.totals.values()))
            if metrics.tally.totals == want:
                break
        assert metrics.tally.totals == want, seen
        steps = [b - a for a, b in itertools.pairwise(seen)]
        # at most 2 x 2 rows behind the oldest running transaction, and 2 committed above it
        assert len(steps) > 2 and all(0 < n <= 6 for n in steps), seen
    finally:
        store.close()


def test_counters_never_go_down_when_the_prune_deletes_events_and_the_dashboard_restarts(
    store_url: str, clock: FakeClock
) -> None:
    """The totals were recomputed from the events stored, so a dashboard restarted after the
    leader pruned old tasks (and old task-less events) reported less than before: Prometheus took
    that for a counter reset. The prune now adds what it deletes to ``event_totals``."""
    store = open_store(store_url, clock=clock)
    try:
        store.transact_sync(_register, [WORKFLOW], "metrics-test")
        scene = Scene(store, store_url)
        got = asyncio.run(store.acquire_lease("supervisor", SUP, 1e9))  # a task-less event
        assert got is not None
        term = got[0]
        done = [scene.submit(f"done-{i}") for i in range(2)]
        scene.dispatch()
        for agent in ("inventory", "payments", "shipping"):
            scene.reply_all(agent, "ok", result={"ok": 1})
        assert [scene.state(i) for i in done] == ["processed", "processed"]
        scene.errored("kept")  # an error waits for an operator: never pruned
        running = StoreMetrics(store)
        store.transact_sync(running.refresh)
        before = counters(running)
        assert before[("stepwarden_tasks_finished_total", (("state", "processed"),))] == 2

        clock.advance(2 * DAY)
        assert store.transact_sync(tr.prune, SUP, "supervisor", term, DAY, 100) == 2
        pruned = store.transact_sync(tr.prune_records, SUP, "supervisor", term, DAY, 100)
        assert pruned["taskless_events"] >= 1
        assert sum(stored_events(store).values()) < sum(running.tally.totals.values())

        store.transact_sync(running.refresh)
        assert counters(running) == before, "the running reader's counters moved"
        restarted = StoreMetrics(store)
        store.transact_sync(restarted.refresh)
        after = counters(restarted)
        lower = {k: (v, after.get(k, 0.0)) for k, v in before.items() if after.get(k, 0.0) < v}
        assert not lower, f"counters went down after a restart: {lower}"
        assert after == before
    finally:
        store.close()


def test_on_postgres_a_long_transaction_holds_back_at_most_seen_max_rows_then_all_are_counted(
    app: App, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a write transaction stays open, the reader remembers the rows committed after it, up
    to SEEN_MAX; the rest wait for it to end. The bound was SEEN_MAX + BATCH - 1 (a whole batch
    read once below it); and once the transaction ends, every row is counted, once."""
    monkeypatch.setattr(tally, "SEEN_MAX", 3)
    monkeypatch.setattr(tally, "BATCH", 2)
    metrics = StoreMetrics(app.store)
    app.store.transact_sync(metrics.refresh)
    with app.transaction() as tx:
        tx.submit("wf", {"long": 1})  # holds the snapshot's xmin until the block ends
        for i in range(6):
            app.submit("wf", {"after": i})
        for _ in range(5):
            app.store.transact_sync(metrics.refresh)
            events = metrics.tally.events
            assert isinstance(events, tally._XactTail)
            assert len(events.seen) <= 3
        assert metrics.tally.totals["received"] == 3
    for _ in range(5):  # a bound, not a wait: each refresh reads what is final now
        app.store.transact_sync(metrics.refresh)
    assert metrics.tally.totals["received"] == 7 == stored_events(app.store)["received"]


def test_on_postgres_events_written_before_schema_7_are_counted_once_after_the_upgrade(pg_url: str) -> None:
    """Events stored before migration 0007 have no writer transaction id (NULL). A reader started
    after the upgrade counts them in its first total, and the events written after it as they
    come, each once."""
    empty = open_store(pg_url, migrate=False)
    empty.transact_sync(lambda tx: (tx.sql("DROP SCHEMA public CASCADE"), tx.sql("CREATE SCHEMA public")))
    empty.close()
    old: Any = open_store(pg_url, migrate=False)
    try:
        assert old.migrate(target=6) == 6
        old.transact_sync(
            lambda tx: [
                tx.sql("INSERT INTO events (task_id, kind, detail, at) VALUES (NULL, ?, NULL, 0)", (kind,))
                for kind in ("received", "received", "processed")
            ]
        )
        assert old.migrate(target=7) == 1
        assert (
            old.transact_sync(lambda tx: tx.sql("SELECT COUNT(*) AS n FROM events WHERE xact_id IS NULL"))[0][
                "n"
            ]
            == 3
        )
        metrics = StoreMetrics(old)
        old.transact_sync(metrics.refresh)
        assert dict(metrics.tally.totals) == {"received": 2, "processed": 1}
        old.transact_sync(
            lambda tx: tx.sql("INSERT INTO events (task_id, kind, at) VALUES (NULL, 'received', 0)")
        )
        for _ in range(2):
            old.transact_sync(metrics.refresh)
        assert dict(metrics.tally.totals) == {"received": 3, "processed": 1} == stored_events(old)
    finally:
        old.close()
