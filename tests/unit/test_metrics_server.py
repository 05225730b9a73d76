"""The worker's metrics server (``--metrics-port``): ``/metrics`` only, silent clients dropped,
connections bounded. Found by review: every path answered the metrics, and each silent
connection held a thread of the worker for as long as the client kept it open (300 held 300)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from stepwarden.metrics import http_server
from stepwarden.metrics.http_server import serve_metrics


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    monkeypatch.setattr(http_server._Handler, "timeout", 2.0)
    registry = CollectorRegistry()
    Counter("probe", "A counter to see.", registry=registry).inc(3)
    server = serve_metrics(registry, "127.0.0.1", 0)
    try:
        yield "127.0.0.1", int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def handler_threads() -> int:
    return sum(1 for t in threading.enumerate() if "process_request_thread" in t.name)


def test_only_the_metrics_path_answers_the_metrics(served: tuple[str, int]) -> None:
    host, port = served
    r = httpx.get(f"http://{host}:{port}/metrics", timeout=5)
    assert r.status_code == 200 and "probe_total 3.0" in r.text
    for path in ("/", "/nope", "/metrics/x"):
        r = httpx.get(f"http://{host}:{port}{path}", timeout=5)
        assert r.status_code == 404 and "probe_total" not in r.text, path


def test_a_silent_client_is_dropped_and_connections_at_once_are_bounded(served: tuple[str, int]) -> None:
    host, port = served
    before = handler_threads()
    silent = [socket.create_connection((host, port), timeout=5) for _ in range(http_server.MAX_CLIENTS + 4)]
    try:
        for s in silent:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest of the request
        held = time.monotonic() + 5
        while handler_threads() - before < http_server.MAX_CLIENTS:  # it has taken them all in
            assert time.monotonic() < held, handler_threads() - before
            time.sleep(0.01)
        assert handler_threads() - before == http_server.MAX_CLIENTS  # the 4 more were closed
        # Past the bound a connection is closed unanswered; within it, a silent one is dropped
        # once it has said nothing for the handler's timeout (2 s here): each ends, none hangs.
        deadline = time.monotonic() + 10
        for s in silent:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(1024) == b""
        # With them gone, a scrape is served again.
        assert httpx.get(f"http://{host}:{port}/metrics", timeout=5).status_code == 200
    finally:
        for s in silent:
            s.close()


def test_a_dropped_client_leaves_no_traceback_on_stderr(
    served: tuple[str, int], capfd: pytest.CaptureFixture[str]
) -> None:
    """socketserver printed a traceback for each client dropped by the timeout (wsgiref's
    handler does not catch it): one per silent connection, among the worker's log lines."""
    host, port = served
    s = socket.create_connection((host, port), timeout=10)
    try:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        assert s.recv(1024) == b""  # dropped after the handler's timeout
    finally:
        s.close()
    assert "Traceback" not in capfd.readouterr().err
