"""Alert delivery with real roles running (OPS4): a slow, failing webhook never holds them back.

Two in-process workers of one application (all roles, one webhook sink) run on the store while
tasks fail for good, each raising a ``task_error`` alert. The webhook receiver on 127.0.0.1 takes a
second to answer and fails the first requests with HTTP 500. Meanwhile other tasks keep being
processed at full speed; in the end each alert reached the webhook exactly once, sent by one
process (the holder of the ``alerts`` lease).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from stepwarden import App, Backoff, Permanent, Request, Step, WorkerSettings
from stepwarden.alerts import AlertSettings, WebhookSink
from stepwarden.store import views

pytestmark = pytest.mark.timeout(120)

FAILURES = 4
HANG = 1.0


class SlowHook:
    """Answers every request after ``HANG`` seconds: HTTP 500 for the first ``FAILURES``, then 200."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[float, int, dict[str, Any]]] = []  # (answered at, status, alert)
        self.started = threading.Event()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                hook.started.set()
                time.sleep(HANG)
                with hook.lock:
                    status = 500 if len(hook.requests) < FAILURES else 200
                    hook.requests.append((time.monotonic(), status, body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def delivered(self) -> list[int]:
        with self.lock:
            return [body["id"] for _, status, body in self.requests if status == 200]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook() -> Iterator[SlowHook]:
    h = SlowHook()
    yield h
    h.close()


def make_app(url: str, hook_url: str) -> App:
    app = App(url)
    svc = app.agent("svc", concurrency=16)

    @svc.operation
    async def ok(req: Request) -> dict[str, Any]:
        return {"task": req.task_id}

    @svc.operation
    async def refuse(req: Request) -> None:
        raise Permanent("card declined")

    app.workflow("good", [Step("ok", "svc.ok", complete_by=10)])
    app.workflow("bad", [Step("refuse", "svc.refuse", complete_by=10)])
    app.alert_sink(WebhookSink(hook_url, timeout=5, backoff=Backoff(initial=0.2, maximum=0.5, jitter=0.0)))
    return app


async def until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
    return got


def test_a_failing_slow_webhook_delivers_each_alert_once_and_never_blocks_the_roles(
    store_url: str, hook: SlowHook
) -> None:
    app = make_app(store_url, hook.url)
    settings = WorkerSettings(alerts=AlertSettings(interval=0.1))
    workers = [app.worker(settings), app.worker(settings)]

    async def main() -> tuple[list[int], float]:
        stop = asyncio.Event()
        runs = [asyncio.create_task(w.run(stop)) for w in workers]
        try:
            bad = [await app.submit_async("bad", {}) for _ in range(3)]
            await until(hook.started.is_set, 20, "the first webhook call")
            # The webhook is answering slowly and with errors now; the roles go on regardless.
            began = time.monotonic()
            good = [await app.submit_async("good", {}, reply_to="web") for _ in range(30)]
            for t in good:
                assert (await app.wait_for_result_async(t, 20)).ok
            took = time.monotonic() - began
            assert len(hook.delivered()) == 0, "the webhook was still failing while the tasks ran"
            await until(lambda: len(hook.delivered()) >= len(bad), 60, "every alert to be delivered")
            await asyncio.sleep(0.5)  # time for a duplicate, if there were one
            return bad, took
        finally:
            stop.set()
            await asyncio.gather(*runs)

    try:
        bad, took = asyncio.run(main())
        assert took < HANG * FAILURES, f"30 one-step tasks took {took:.2f}s next to a failing webhook"
        alerts = app.alerts()
        assert sorted(a["task_id"] for a in alerts) == sorted(bad)
        assert {a["kind"] for a in alerts} == {"task_error"}
        assert sorted(hook.delivered()) == sorted(a["id"] for a in alerts)  # each once
        assert len(hook.requests) == FAILURES + len(alerts)
        deliveries = [d for a in alerts for d in a["deliveries"]]
        assert sum(d["attempts"] for d in deliveries) == FAILURES + len(alerts)
        assert all(d["sink"] == "webhook" and d["delivered_at"] for d in deliveries)
        senders = app.store.transact_sync(
            lambda tx: tx.sql("SELECT DISTINCT delivered_by FROM alert_deliveries")
        )
        leases = {x["name"]: x for x in app.store.transact_sync(views.list_leases)}
        ids = {w.identity for w in workers}
        assert [s["delivered_by"] for s in senders] == [leases["alerts"]["holder"]]
        assert leases["alerts"]["holder"] in ids
        assert [w.alert_keeper.terms_held for w in workers if w.alert_keeper].count(1) == 1
    finally:
        app.close()
