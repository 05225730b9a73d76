"""The store contract runs on every store: each test here gets ``store`` on SQLite AND PostgreSQL,
with the database clock driven by the test's :class:`FakeClock` (``sw_now()`` on SQLite, a
transaction-local setting read by ``now`` on PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stepwarden.clock import FakeClock
from stepwarden.store import Store, open_store


@pytest.fixture
def store(store_url: str, clock: FakeClock) -> Iterator[Store]:
    s = open_store(store_url, clock=clock)
    yield s
    s.close()
