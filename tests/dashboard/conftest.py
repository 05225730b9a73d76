"""Fixtures of the dashboard tests: a store on both dialects holding the demo's workflow and tasks
in known states, made through the store's own transitions (no worker, no clock games)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from stepwarden.demo.app import app as demo_app
from stepwarden.store import Store, open_store
from stepwarden.store import transitions as tr
from stepwarden.store.core import _register

WORKFLOW = demo_app.workflows["process-order"]
HOSTILE = "<img src=x onerror=alert(1)>\"'&<script>alert('x')</script>"


def order(order_id: str) -> dict[str, Any]:
    return {"order_id": order_id, "sku": "SKU-1", "quantity": 1, "amount_cents": 100}


@dataclass
class Scene:
    store: Store
    url: str

    def submit(self, correlation_id: str) -> int:
        task_id, _ = self.store.transact_sync(
            tr.submit,
            WORKFLOW,
            json.dumps(order(correlation_id)),
            correlation_id=correlation_id,
            idempotency_key=None,
            priority=0,
            reply_to=None,
        )
        return task_id

    def dispatch(self) -> int:
        return self.store.transact_sync(tr.claim_and_dispatch, "sched-1:1:aaaaaa", 100)

    def reply_all(self, agent: str, outcome: str, error: str | None = None, result: Any = None) -> int:
        """Take every queued request of ``agent`` and reply ``outcome`` to each; then apply."""

        async def take_and_reply() -> int:
            msgs = await self.store.claim_requests("agent-1:2:bbbbbb", [agent], 100)
            for m in msgs:
                await self.store.send_reply("agent-1:2:bbbbbb", m.id, outcome, result, error)
            return len(msgs)

        n = asyncio.run(take_and_reply())
        self.store.transact_sync(tr.apply_replies, "sched-1:1:aaaaaa", 100, random.Random(0))
        return n

    def errored(self, correlation_id: str, error: str = "inventory.reserve refused: unknown SKU") -> int:
        """A task whose first step got a permanent error: task ``error``, step ``failed``, one alert."""
        task_id = self.submit(correlation_id)
        self.dispatch()
        self.reply_all("inventory", "error", error)
        return task_id

    def state(self, task_id: int) -> str:
        return str(
            self.store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks WHERE id = ?", (task_id,)))[
                0
            ]["state"]
        )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """An empty SQLite store, for tests of what the dashboard decides before it reads anything
    (body limits, tokens): they need a store to build the app on, and one dialect is enough."""
    s = open_store(f"sqlite:///{tmp_path / 'bare.db'}")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def scene(store_url: str) -> Iterator[Scene]:
    store = open_store(store_url)
    store.transact_sync(_register, [WORKFLOW], "dashboard-test")
    try:
        yield Scene(store, store_url)
    finally:
        store.close()
