"""Agent breakers and instances on the dashboard and in its ``/metrics`` (AGT3, AGT6, OPS5).

The store is put in a known state through the store's own agent-health transactions: three
instances of ``inventory``, one of which judged itself unhealthy, and a breaker of ``payments``
opened by failures of two instances.
"""

from __future__ import annotations

import warnings

from stepwarden.dashboard.web import create_app
from stepwarden.store import agents as sa

from .conftest import Scene
from .test_metrics import parse, value

with warnings.catch_warnings():  # starlette's note about httpx, as in the other dashboard tests
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

A, B, C = "agent-a:1:aaaaaa", "agent-b:2:bbbbbb", "agent-c:3:cccccc"
RULES = sa.HealthRules(unhealthy_after=2, probe_after=30.0)


def arrange(scene: Scene) -> None:
    store = scene.store
    for w in (A, B, C):
        store.transact_sync(
            sa.register,
            w,
            [sa.InstanceSpec("inventory", 8, 3, 30.0), sa.InstanceSpec("payments", 4, 2, 30.0)],
        )

    def report(w: str, agent: str, ok: bool) -> sa.Verdict:
        r = sa.Report(agent, ok, None if ok else "connection refused")
        return store.transact_sync(sa.report, w, r, 2 if agent == "payments" else 3, 30.0, RULES)

    report(C, "inventory", False)
    report(A, "inventory", True)
    assert not report(C, "inventory", False).healthy  # C alone fails while A succeeds
    report(A, "payments", False)
    assert report(B, "payments", False).opened


def test_the_workers_page_shows_breakers_and_instances(scene: Scene) -> None:
    arrange(scene)
    with TestClient(create_app(scene.store, "t")) as c:
        html = c.get("/workers").text
        overview = c.get("/").text
    assert 'data-agent="payments" data-state="open"' in html
    assert 'data-agent="inventory" data-state="closed"' in html
    assert f'data-worker="{C}" data-agent="inventory" data-healthy="0"' in html
    assert f'data-worker="{A}" data-agent="inventory" data-healthy="1"' in html
    assert "connection refused" in html
    # the overview lists the open breaker once (it is shared), with the instance that opened it
    assert overview.count("breaker-open") == 1 and "payments" in overview and B in overview


def test_metrics_carry_the_shared_breakers_and_instance_health(scene: Scene) -> None:
    arrange(scene)
    with TestClient(create_app(scene.store, "t")) as c:
        m = parse(c.get("/metrics").text)
    assert value(m, "stepwarden_agent_breaker_state", agent="payments") == 2
    assert value(m, "stepwarden_agent_breaker_state", agent="inventory") == 0
    assert value(m, "stepwarden_agent_breaker_opens_total", agent="payments") == 1
    assert value(m, "stepwarden_agent_instance_healthy", agent="inventory", worker=C) == 0
    assert value(m, "stepwarden_agent_instance_healthy", agent="inventory", worker=A) == 1
    assert value(m, "stepwarden_agent_instance_capacity", agent="payments", worker=B) == 4
    assert value(m, "stepwarden_alerts_unacked", kind="breaker_opened") == 1
