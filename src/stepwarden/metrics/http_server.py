"""The HTTP server of a worker's own metrics (``stepwarden worker --metrics-port``).

prometheus_client's ``start_http_server`` answered every path with the metrics, and gave each
connection a thread of its own for as long as the client kept it open, with no bound on either:
300 silent connections held 300 threads (found by review). Harmless on loopback, it is the worker
process itself that ``--metrics-host`` exposes beyond it. Here: ``/metrics`` only (404 else),
a client that sends nothing for :data:`IDLE_TIMEOUT` is dropped, and past :data:`MAX_CLIENTS`
connections at once a new one is closed unanswered. The metrics are rendered by
prometheus_client's own WSGI app, so their text is the same.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

IDLE_TIMEOUT = 10.0  # seconds a client may stay silent before its connection is dropped
MAX_CLIENTS = 16  # connections served at once; a scraper needs one

log = logging.getLogger("stepwarden.metrics")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class _Handler(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT  # socketserver sets it on the connection

    def log_message(self, format: str, *args: Any) -> None:
        return None  # not a line per scrape in the worker's log


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 64  # the listen backlog: socketserver's 5 left clients in SYN retries

    def __init__(self, address: tuple[Any, ...], handler: type[WSGIRequestHandler], *, family: int) -> None:
        self.address_family = family
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # too many at once: closed, not queued
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Not socketserver's traceback on the worker's stderr: a client dropped for its silence
        (the handler's timeout, which wsgiref does not catch) or gone is nothing to report."""
        log.debug("metrics: a request from %s ended early", client_address, exc_info=True)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _only_metrics(app: WsgiApp) -> WsgiApp:
    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found: the metrics are at /metrics\n"]
        return app(environ, start_response)

    return serve


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve ``registry`` at ``http://HOST:PORT/metrics`` from a daemon thread; the bind's errors
    (an address that does not resolve or is not this machine's, a port taken) are raised here."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server = _Server((str(address[0]), int(address[1])), _Handler, family=family)
    server.set_app(_only_metrics(make_wsgi_app(registry)))
    threading.Thread(target=server.serve_forever, name="stepwarden-metrics", daemon=True).start()
    return server
