"""Real worker processes on one store, started and ended by the tests.

``cluster`` gives each test its own store and execution log in ``tmp_path`` (a
:class:`harness.Cluster`: the harness is a module of its own, which tests import); workers are
``python -m stepwarden worker --app itapp:app`` subprocesses whose output goes to files there.
Every process a test starts is ended by pid when the test ends (SIGCONT in case it was stopped,
SIGTERM, then SIGKILL after a deadline), and when a test fails its report carries the workers'
logs and a snapshot of the store.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster


@pytest.fixture
def cluster(tmp_path: Path, store_url: str) -> Iterator[Cluster]:
    """Worker processes on one store: every integration test runs on SQLite and on PostgreSQL."""
    c = Cluster(tmp_path, store_url)
    try:
        yield c
    finally:
        c.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    if rep.when == "call" and rep.failed:
        c = getattr(item, "funcargs", {}).get("cluster")
        if isinstance(c, Cluster):
            rep.sections.append(("workers and store", c.report()))
    return rep


@pytest.fixture
def pg_cluster(tmp_path: Path, pg_url: str) -> Iterator[Cluster]:
    """Worker processes on PostgreSQL only, for what only PostgreSQL has (LISTEN, connection faults)."""
    c = Cluster(tmp_path, pg_url)
    try:
        yield c
    finally:
        c.close()
