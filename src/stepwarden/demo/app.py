"""The demo's application: the pattern's own e-commerce example (SPEC section 4).

reserve stock -> charge payment -> arrange shipping, each with its compensation, against the
fake services of :mod:`stepwarden.demo.services` at ``STEPWARDEN_DEMO_SERVICES`` (a base URL).
Every call carries the step's idempotency key, so a retried or rescued attempt never applies an
effect twice, and a compensation carries the key of the effect it undoes.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from stepwarden import App, Backoff, Permanent, Request, Retry, Step

app = App()
inventory = app.agent("inventory", concurrency=16)
payments = app.agent("payments", concurrency=16)
shipping = app.agent("shipping", concurrency=16)

_clients: dict[int, httpx.AsyncClient] = {}


def services_url() -> str:
    return os.environ.get("STEPWARDEN_DEMO_SERVICES", "http://127.0.0.1:8765").rstrip("/")


def _client() -> httpx.AsyncClient:
    import asyncio

    loop_id = id(asyncio.get_running_loop())
    client = _clients.get(loop_id)
    if client is None:
        # One connection per request: the fake services speak HTTP/1.0, and a cancelled call at
        # complete-by must not leave a half-read connection in a pool.
        client = httpx.AsyncClient(
            base_url=services_url(),
            timeout=httpx.Timeout(30.0),
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        _clients[loop_id] = client
    return client


async def _call(service: str, op: str, req: Request) -> Any:
    order = req.input if isinstance(req.input, dict) else {}
    body = {
        "order_id": order.get("order_id"),
        "sku": order.get("sku"),
        "quantity": order.get("quantity"),
        "amount_cents": order.get("amount_cents"),
        "attempt": req.attempt,
    }
    r = await _client().post(f"/{service}/{op}", json=body, headers={"Idempotency-Key": req.idempotency_key})
    if r.status_code in (402, 409, 422):
        raise Permanent(f"{service}.{op} refused: {r.text[:200]}")
    r.raise_for_status()  # 5xx: transient, retried inside the attempt
    return r.json()


@inventory.operation
async def reserve(req: Request) -> Any:
    return await _call("inventory", "reserve", req)


@inventory.operation
async def release(req: Request) -> Any:
    return await _call("inventory", "release", req)


@payments.operation
async def charge(req: Request) -> Any:
    return await _call("payments", "charge", req)


@payments.operation
async def refund(req: Request) -> Any:
    return await _call("payments", "refund", req)


@shipping.operation
async def create(req: Request) -> Any:
    return await _call("shipping", "create", req)


@shipping.operation
async def cancel(req: Request) -> Any:
    return await _call("shipping", "cancel", req)


_retry = Retry(
    max_failures=3,
    backoff=Backoff(initial=0.2, maximum=2.0),
    tries=3,
    in_attempt=Backoff(initial=0.05, maximum=0.5),
    escalation="compensate",
)

# complete_by covers the whole attempt, queueing included: 4 s leaves room for a backlog of 200
# orders on a busy 2-core machine, while a hang (20 s) still expires and is rescued.
app.workflow(
    "process-order",
    [
        # An unknown SKU is the operator's to fix (error + alert); repeated timeouts are undone.
        Step(
            "reserve",
            "inventory.reserve",
            complete_by=4.0,
            retry=_retry,
            compensate="inventory.release",
            on_error="error",
        ),
        Step(
            "charge",
            "payments.charge",
            complete_by=4.0,
            retry=_retry,
            compensate="payments.refund",
            on_error="compensate",
        ),
        Step(
            "ship",
            "shipping.create",
            complete_by=4.0,
            retry=_retry,
            compensate="shipping.cancel",
            on_error="compensate",
        ),
    ],
)
