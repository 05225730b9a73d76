"""Three fake remote services (inventory, payments, shipping) behind one local HTTP server.

The demo needs services that misbehave the way real ones do -- flaky, slow past any deadline, sometimes
refusing for good -- yet reproducibly, so a failed run can be replayed with the same seed. Every failure
decision is therefore a pure function of (seed, op, idempotency key, call number) rather than of timing or
request interleaving. The server also keeps an honest ledger of what was really applied and undone, which
is the ground truth the demo's consistency check compares against the task table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, Literal, NoReturn

from ..parent import die_with_parent

__all__ = ["SERVICE_OPS", "FakeServices", "Reply", "main", "serve_in_thread"]

#: service name -> (forward op, undo op)
SERVICE_OPS: dict[str, tuple[str, str]] = {
    "inventory": ("reserve", "release"),
    "payments": ("charge", "refund"),
    "shipping": ("create", "cancel"),
}

Decision = Literal["ok", "transient", "hang", "permanent"]

_MAX_BODY = 1 << 20


@dataclass
class _Effect:
    service: str
    op: str
    order_id: object
    applied: int = 0
    undone: int = 0
    calls: int = 0
    tombstoned: bool = False
    rejected: bool = False
    result: dict[str, object] | None = None


@dataclass(frozen=True)
class Reply:
    """What a call decided; ``withhold`` means the effect happened but the reply must be lost (a hang)."""

    status: int
    body: dict[str, object]
    withhold: bool = False


class FakeServices:
    """In-memory state of all three services, independent of HTTP so the rules can be reasoned about alone."""

    def __init__(
        self,
        seed: int | str = 0,
        transient_rate: float = 0.0,
        hang_rate: float = 0.0,
        permanent_rate: float = 0.0,
        unsafe: bool = False,
    ) -> None:
        for name, rate in (("transient", transient_rate), ("hang", hang_rate), ("permanent", permanent_rate)):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} rate must be within [0, 1], got {rate}")
        self.seed = str(seed)
        self.transient_rate = transient_rate
        self.hang_rate = hang_rate
        self.permanent_rate = permanent_rate
        self.unsafe = unsafe
        self._lock = threading.Lock()
        self._effects: dict[str, _Effect] = {}
        self._op_calls: dict[tuple[str, str], int] = {}

    @staticmethod
    def route(service: str, op: str) -> bool | None:
        """True for a forward op, False for an undo op, None if no such endpoint exists."""
        ops = SERVICE_OPS.get(service)
        if ops is None or op not in ops:
            return None
        return op == ops[0]

    def decide(self, op: str, key: str, n: int, forward: bool) -> Decision:
        # A fresh RNG per (op, key, n) keeps the outcome of the n-th call fixed no matter how calls for
        # other keys interleave with it, which is what makes a seeded run replayable.
        u = random.Random(f"{self.seed}:{op}:{key}:{n}").random()
        if u < self.transient_rate:
            return "transient"
        if u < self.transient_rate + self.hang_rate:
            return "hang"
        if forward and u < self.transient_rate + self.hang_rate + self.permanent_rate:
            return "permanent"
        return "ok"

    def call(self, service: str, op: str, key: str, body: dict[str, Any]) -> Reply:
        forward = self.route(service, op)
        if forward is None:
            return Reply(404, {"error": f"no such endpoint: {service}/{op}"})
        with self._lock:
            effect = self._effects.get(key)
            if effect is None:
                effect = _Effect(service=service, op=SERVICE_OPS[service][0], order_id=body.get("order_id"))
                self._effects[key] = effect
            effect.calls += 1
            n = self._op_calls.get((op, key), 0) + 1
            self._op_calls[(op, key)] = n
            decision = self.decide(op, key, n, forward)
            if forward:
                return self._forward(effect, service, op, key, body, decision)
            return self._undo(effect, decision)

    def _forward(
        self, effect: _Effect, service: str, op: str, key: str, body: dict[str, Any], decision: Decision
    ) -> Reply:
        if effect.tombstoned:
            return Reply(409, {"error": "cancelled before applied"})
        if effect.rejected:
            return Reply(422, {"error": f"permanent: {op} refused"})
        if decision == "transient":
            return Reply(503, {"error": "transient"})
        replay = effect.result is not None and not self.unsafe
        if decision == "permanent" and not replay:
            # An idempotent service answers a replayed key from its store before any business rule runs,
            # so a refusal can only ever hit an effect that was never applied.
            effect.rejected = True
            return Reply(422, {"error": f"permanent: {op} refused"})
        if not replay:
            effect.applied += 1
            digest = hashlib.sha256(f"{self.seed}:{key}:{effect.applied}".encode()).hexdigest()[:10]
            effect.result = {
                "key": key,
                "service": service,
                "op": op,
                "order_id": body.get("order_id"),
                "ref": f"{service}-{digest}",
            }
        assert effect.result is not None
        return Reply(200, dict(effect.result), withhold=decision == "hang")

    @staticmethod
    def _undo(effect: _Effect, decision: Decision) -> Reply:
        if decision == "transient":
            return Reply(503, {"error": "transient"})
        withhold = decision == "hang"
        if effect.applied > effect.undone:
            effect.undone += 1
            return Reply(200, {"undone": True}, withhold=withhold)
        if effect.applied > 0:
            return Reply(200, {"undone": True}, withhold=withhold)
        # Remember the undo so a forward call still in flight (e.g. a hung attempt's retry) cannot land
        # after its compensation and leave an effect nobody will ever undo.
        effect.tombstoned = True
        return Reply(200, {"undone": False, "reason": "nothing applied"}, withhold=withhold)

    def ledger(self) -> dict[str, dict[str, object]]:
        with self._lock:
            return {
                key: {
                    "applied": e.applied,
                    "undone": e.undone,
                    "service": e.service,
                    "op": e.op,
                    "order_id": e.order_id,
                    "calls": e.calls,
                    "tombstoned": e.tombstoned,
                    "rejected": e.rejected,
                }
                for key, e in self._effects.items()
            }


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Agents open a connection per call; the stdlib default backlog of 5 drops SYNs under a burst and turns
    # them into multi-second client stalls that would masquerade as service hangs.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], services: FakeServices, hang_seconds: float) -> None:
        self.services = services
        self.hang_seconds = hang_seconds
        self.stopping = threading.Event()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that give up on a hung call are expected here, not worth a traceback.
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    # Bounds how long a client that connects and then says nothing can pin a handler thread.
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _srv(self) -> _Server:
        assert isinstance(self.server, _Server)
        return self.server

    def _send(self, status: int, payload: dict[str, object]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/ledger":
            self._send(200, {"effects": self._srv().services.ledger()})
        elif path == "/health":
            self._send(200, {"ok": True})
        else:
            self._send(404, {"error": f"not found: {path}"})

    def do_POST(self) -> None:
        srv = self._srv()
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        if len(parts) != 2 or FakeServices.route(parts[0], parts[1]) is None:
            self._send(404, {"error": f"not found: {self.path}"})
            return
        service, op = parts
        key = self.headers.get("Idempotency-Key", "").strip()
        if not key:
            self._send(400, {"error": "missing Idempotency-Key header"})
            return
        body = self._read_json()
        if body is None:
            return
        reply = srv.services.call(service, op, key, body)
        if reply.withhold:
            srv.stopping.wait(srv.hang_seconds)
        try:
            self._send(reply.status, reply.body)
        except ConnectionError:
            # The client gave up on a withheld reply long ago; the effect stands regardless.
            self.close_connection = True

    def _read_json(self) -> dict[str, Any] | None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if length < 0 or length > _MAX_BODY:
            self._send(400, {"error": "bad Content-Length"})
            return None
        try:
            body = json.loads(self.rfile.read(length)) if length else None
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            self._send(400, {"error": "body must be a JSON object"})
            return None
        if "order_id" not in body:
            self._send(400, {"error": "body must contain order_id"})
            return None
        return body


def _build(
    host: str,
    port: int,
    seed: int | str,
    transient_rate: float,
    hang_rate: float,
    permanent_rate: float,
    hang_seconds: float,
    unsafe: bool,
) -> _Server:
    services = FakeServices(seed, transient_rate, hang_rate, permanent_rate, unsafe)
    return _Server((host, port), services, hang_seconds)


# How often serve_forever notices a shutdown request; short so stopping (and every test teardown) is quick.
_POLL_SECONDS = 0.05


def _serve(server: _Server) -> threading.Thread:
    thread = threading.Thread(
        target=server.serve_forever, args=(_POLL_SECONDS,), name="stepwarden-demo-services", daemon=True
    )
    thread.start()
    return thread


def _stopper(server: _Server, thread: threading.Thread) -> Callable[[], None]:
    done = threading.Lock()

    def stop() -> None:
        if not done.acquire(blocking=False):
            return
        server.stopping.set()  # wakes any handler withholding a reply
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return stop


def serve_in_thread(
    seed: int | str = 0,
    transient_rate: float = 0.0,
    hang_rate: float = 0.0,
    permanent_rate: float = 0.0,
    hang_seconds: float = 30.0,
    unsafe: bool = False,
    host: str = "127.0.0.1",
    port: int = 0,
) -> tuple[str, Callable[[], None]]:
    """Start the services on a background thread; returns the base URL and an idempotent stop function."""
    server = _build(host, port, seed, transient_rate, hang_rate, permanent_rate, hang_seconds, unsafe)
    thread = _serve(server)
    bound_host, bound_port = server.server_address[:2]
    return f"http://{bound_host!s}:{bound_port}", _stopper(server, thread)


class _OneLineParser(argparse.ArgumentParser):
    """Bad input is one ``error:`` line and exit 2, as for ``stepwarden`` (argparse prints its
    usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n")


def _bounded(
    parse: Callable[[str], Any], low: float, high: float, expected: str, in_range: str
) -> Callable[[str], Any]:
    """An argument type: ``parse(text)`` within ``[low, high]`` (NaN fails both comparisons),
    else one line saying what was ``expected`` or the range a value must be ``in_range`` of."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{in_range}, got {text}")
        return value

    return convert


_rate = _bounded(float, 0.0, 1.0, "a number from 0 to 1", "rate must be within [0, 1]")
_port = _bounded(int, 0, 65535, "a whole number", "a port is within [0, 65535]")
_seconds = _bounded(float, 0.0, 86400.0, "a number of seconds", "seconds must be within [0, 86400]")


def _parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="python -m stepwarden.demo.services",
        description="Fake inventory, payments and shipping services with seeded failures.",
    )
    p.add_argument("--port", type=_port, required=True, help="port to listen on (0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--seed", default="0", help="seed for failure decisions (any string)")
    p.add_argument("--transient-rate", type=_rate, default=0.0, help="share of calls answered 503")
    p.add_argument("--hang-rate", type=_rate, default=0.0, help="share of calls applied but never answered")
    p.add_argument("--permanent-rate", type=_rate, default=0.0, help="share of forward calls refused (422)")
    p.add_argument(
        "--hang-seconds", type=_seconds, default=30.0, help="how long a hung reply is withheld (0 to 86400)"
    )
    p.add_argument(
        "--unsafe", action="store_true", help="ignore idempotency keys (to prove the ledger check works)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        server = _build(
            args.host,
            args.port,
            args.seed,
            args.transient_rate,
            args.hang_rate,
            args.permanent_rate,
            args.hang_seconds,
            args.unsafe,
        )
    except OSError as exc:
        print(f"cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    thread = _serve(server)
    stop = _stopper(server, thread)
    requested = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        requested.set()

    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    die_with_parent()  # the demo that started it, killed by SIGKILL: stop too (its handler is set)
    try:
        bound_host, bound_port = server.server_address[:2]
        print(f"listening on http://{bound_host!s}:{bound_port}", flush=True)
        # Serving happens on a worker thread so the main thread stays free to receive signals; a short
        # wait timeout keeps it responsive even where signal delivery does not interrupt waits.
        while not requested.wait(0.2):
            pass
    finally:
        stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
