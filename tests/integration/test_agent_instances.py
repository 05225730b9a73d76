"""Agent instances and health with real worker processes (AGT3, AGT6; issue 6, acceptance 3).

Two failures, two answers:

- one instance's calls fail (``HEALTHAPP_BROKEN=1`` in its environment) while the others' succeed:
  that instance marks itself unhealthy, stops pulling, and every task completes on the others;
- the service fails for everyone (a flag file the test creates): the shared breaker opens for all
  instances at once, one ``breaker_opened`` alert is raised, and after the file is removed a trial
  call closes the breaker and the backlog completes.

Both are checked in the store, through the CLI, and in ``/metrics`` (each worker's own, with
``--metrics-port 0``, and the store-wide families the dashboard serves). Every wait is on a
condition with a deadline.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import healthapp
import httpx
import pytest
from harness import Cluster, WorkerProc
from prometheus_client.parser import text_string_to_metric_families

from stepwarden import App
from stepwarden.metrics import StoreMetrics

pytestmark = pytest.mark.timeout(180)


class Instance:
    """A worker process running ``healthapp:app``, with its metrics URL."""

    def __init__(self, cluster: Cluster, name: str, **env: str) -> None:
        self.proc: WorkerProc = cluster.start(
            name, app="healthapp:app", args=("--metrics-port", "0"), env=env
        )
        self.identity = self.proc.identity

        def served() -> str | None:
            m = re.search(r"worker metrics on (\S+)", self.proc.log_text())
            return m.group(1) if m else None

        self.url: str = cluster.wait(served, 20, f"{name}'s metrics URL")

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return parse(httpx.get(self.url, timeout=10).text)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value}, with the official parser."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return m.get((name, tuple(sorted(labels.items()))))


def store_metrics(cluster: Cluster) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The store-wide families the dashboard's ``/metrics`` serves, read the same way."""
    sm = StoreMetrics(cluster.store)
    cluster.store.transact_sync(sm.refresh)
    return parse(sm.render().decode())


@pytest.fixture
def app(cluster: Cluster) -> Iterator[App]:
    a = healthapp.make_app(cluster.url)
    yield a
    a.close()


def submit(app: App, n: int) -> list[int]:
    return [app.submit("call", {"i": i}) for i in range(n)]


def all_processed(cluster: Cluster, ids: list[int]) -> bool:
    rows = cluster.sql(f"SELECT state FROM tasks WHERE id IN ({','.join(map(str, ids))})")
    return len(rows) == len(ids) and all(r["state"] == "processed" for r in rows)


def instances(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {i["worker"]: i for i in cluster.cli("agents", "--json")["instances"]}


def breaker(cluster: Cluster) -> dict[str, Any]:
    b: dict[str, Any]
    [b] = cluster.cli("agents", "--json")["breakers"]
    return b


def test_an_instance_whose_calls_fail_while_others_succeed_stops_pulling(cluster: Cluster, app: App) -> None:
    good = [Instance(cluster, "good-1"), Instance(cluster, "good-2")]
    warm = submit(app, 8)
    cluster.wait(lambda: all_processed(cluster, warm), 60, "the warm-up tasks")
    bad = Instance(cluster, "bad", HEALTHAPP_BROKEN="1")
    ids: list[int] = []

    def unhealthy_while_fed() -> bool:
        """Keep work coming until the broken instance has failed often enough to judge itself."""
        if not instances(cluster)[bad.identity]["healthy"]:
            return True
        if not ids or all_processed(cluster, ids[-20:]):
            ids.extend(submit(app, 20))
        return False

    # the broken instance marks itself unhealthy (its own calls fail while the others' succeed)
    cluster.wait(unhealthy_while_fed, 90, "the broken instance unhealthy")
    cluster.wait(lambda: all_processed(cluster, ids), 90, "every task processed")
    seen = instances(cluster)
    assert not seen[bad.identity]["healthy"] and "no route" in seen[bad.identity]["last_error"]
    assert all(seen[g.identity]["healthy"] for g in good)
    # the work went to the healthy instances; the broken one answered nothing but hand-backs
    ok_by = {r["sent_by"] for r in cluster.sql("SELECT sent_by FROM replies WHERE outcome = 'ok'")}
    assert bad.identity not in ok_by and ok_by <= {g.identity for g in good}
    taken_before = len(cluster.sql("SELECT id FROM requests WHERE taken_by = ?", bad.identity))
    # ... and it stopped pulling: more work goes to the others, it only probes once per cool-off
    started = time.monotonic()
    more = submit(app, 40)
    cluster.wait(lambda: all_processed(cluster, more), 60, "the second batch processed")
    taken_after = len(cluster.sql("SELECT id FROM requests WHERE taken_by = ?", bad.identity))
    probes_allowed = (time.monotonic() - started) / healthapp.COOL_OFF + 1
    assert taken_after - taken_before <= probes_allowed, (taken_before, taken_after, probes_allowed)
    # it was not the service: the shared breaker never opened, and no alert
    b = breaker(cluster)
    assert (b["state"], b["opens"]) == ("closed", 0)
    assert [a for a in cluster.cli("alerts", "--json") if a["kind"] == "breaker_opened"] == []
    assert [e["actor"] for e in cluster.events(kind="instance_unhealthy")] == [bad.identity]

    # visible in /metrics: the broken instance's own, and the store's view
    assert sample(bad.metrics(), "stepwarden_worker_agent_healthy", agent="remote") == 0
    for g in good:
        assert sample(g.metrics(), "stepwarden_worker_agent_healthy", agent="remote") == 1
        assert sample(g.metrics(), "stepwarden_worker_breaker_state", agent="remote") == 0
    m = store_metrics(cluster)
    assert sample(m, "stepwarden_agent_instance_healthy", agent="remote", worker=bad.identity) == 0
    for g in good:
        assert sample(m, "stepwarden_agent_instance_healthy", agent="remote", worker=g.identity) == 1
    assert sample(m, "stepwarden_agent_breaker_state", agent="remote") == 0


def test_a_failing_service_opens_the_shared_breaker_for_all_and_it_closes_after_recovery(
    cluster: Cluster, app: App, tmp_path: Path
) -> None:
    down = tmp_path / "service-down"
    workers = [Instance(cluster, f"w{i}", HEALTHAPP_DOWN_FILE=str(down)) for i in range(3)]
    warm = submit(app, 9)
    cluster.wait(lambda: all_processed(cluster, warm), 60, "the warm-up tasks")

    down.touch()  # the service goes down for everyone
    ids = submit(app, 30)
    cluster.wait(lambda: breaker(cluster)["state"] != "closed", 60, "the shared breaker to open")

    # every instance sees it (its mirror is open or half-open) and fails fast: /metrics of each
    def all_see_it() -> bool:
        states = [sample(w.metrics(), "stepwarden_worker_breaker_state", agent="remote") for w in workers]
        return all(s is not None and s >= 1 for s in states)

    cluster.wait(all_see_it, 30, "every worker's /metrics to show the breaker open")
    m = store_metrics(cluster)
    assert (sample(m, "stepwarden_agent_breaker_state", agent="remote") or 0) >= 1
    assert sample(m, "stepwarden_agent_breaker_opens_total", agent="remote") == 1
    # while it is open, calls stop: at most one trial per cool-off reaches the service
    taken = len(cluster.sql("SELECT id FROM requests WHERE state = 'taken'"))
    assert taken <= 1

    # exactly one alert, raised by the instance that opened it
    alerts = [a for a in cluster.cli("alerts", "--json") if a["kind"] == "breaker_opened"]
    assert len(alerts) == 1 and "remote" in alerts[0]["message"]
    assert breaker(cluster)["opened_by"] in {w.identity for w in workers}

    down.unlink()  # the service recovers
    cluster.wait(lambda: breaker(cluster)["state"] == "closed", 60, "the breaker to close after a trial")
    cluster.wait(lambda: all_processed(cluster, ids), 90, "the backlog processed after recovery")
    closed = cluster.events(kind="breaker_closed")
    assert len(closed) == 1 and closed[0]["actor"] in {w.identity for w in workers}
    # still one alert: re-openings after failed trials raise none
    assert len([a for a in cluster.cli("alerts", "--json") if a["kind"] == "breaker_opened"]) == 1
    assert breaker(cluster)["opens"] == 1

    def all_closed() -> bool:
        return all(
            sample(w.metrics(), "stepwarden_worker_breaker_state", agent="remote") == 0 for w in workers
        )

    cluster.wait(all_closed, 30, "every worker's /metrics to show the breaker closed")
    m = store_metrics(cluster)
    assert sample(m, "stepwarden_agent_breaker_state", agent="remote") == 0
    for w in workers:
        assert sample(m, "stepwarden_agent_instance_healthy", agent="remote", worker=w.identity) == 1
