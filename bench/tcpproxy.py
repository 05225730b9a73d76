"""A small TCP proxy on the loopback interface that cuts or black-holes its connections on command.

Put it between processes and a server (here: stepwarden workers and PostgreSQL) to inject the
network faults a real deployment sees:

- ``reset``: every open connection is aborted at once, both sides, with a TCP RST (SO_LINGER 0),
  as when a firewall, a NAT table or a pooler drops them;
- ``stall SECONDS``: nothing is forwarded in either direction and new connections are held
  (accepted, but not connected upstream) for that long -- a black hole; then everything resumes
  where it was, so a stalled statement completes late rather than failing.

Use it as a library (``TcpProxy`` in an asyncio loop, or ``ProxyThread`` from blocking code) or as
a process driven by one-line commands on standard input, each answered by one JSON line::

    python bench/tcpproxy.py --upstream 127.0.0.1:5432 [--listen 127.0.0.1:0]
    listening on 127.0.0.1:41234
    > stall 3            {"ok": true, "stalled_for": 3.0}
    > reset              {"ok": true, "reset": 12}
    > stats              {"ok": true, "open": 10, "accepted": 40, ...}
    > quit               {"ok": true}

The process exits when its standard input closes, so it never outlives the harness that started it.
Only loopback addresses are accepted, for listening and for the upstream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import socket
import struct
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["ProxyThread", "TcpProxy", "main"]

T = TypeVar("T")
_CHUNK = 65536
_MAX_STALL = 120.0


def _check_loopback(host: str, what: str) -> None:
    if host == "localhost":
        return
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{what} {host!r} is not a loopback address; this proxy stays on 127.0.0.1")


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST, not a FIN: what a dropped connection looks like to both ends."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Conn:
    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self) -> None:
        _abort(self.client)
        if self.upstream is not None:
            _abort(self.upstream)
        for t in self.tasks:
            t.cancel()


class TcpProxy:
    """Forward ``listen_host:listen_port`` to ``upstream``; ``reset()`` and ``stall()`` inject faults."""

    def __init__(
        self, upstream_host: str, upstream_port: int, listen_host: str = "127.0.0.1", listen_port: int = 0
    ) -> None:
        _check_loopback(upstream_host, "upstream")
        _check_loopback(listen_host, "listen address")
        self.upstream = (upstream_host, upstream_port)
        self.listen = (listen_host, listen_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._resume: asyncio.TimerHandle | None = None
        self.counts = {"accepted": 0, "resets": 0, "connections_reset": 0, "stalls": 0, "upstream_errors": 0}
        self.bytes = {"up": 0, "down": 0}

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._handle, self.listen[0], self.listen[1], backlog=256)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer)
        self._conns.add(conn)
        self.counts["accepted"] += 1
        try:
            await self._flowing.wait()  # a black hole holds new connections too
            if writer.transport.is_closing():
                return
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 10)
            except (OSError, TimeoutError):
                self.counts["upstream_errors"] += 1
                _abort(writer)
                return
            conn.upstream = up_writer
            conn.tasks = [
                asyncio.create_task(self._pump(reader, up_writer, "up")),
                asyncio.create_task(self._pump(up_reader, writer, "down")),
            ]
            await asyncio.wait(conn.tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._conns.discard(conn)
            for t in conn.tasks:
                t.cancel()
            for w in (writer, conn.upstream):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                await self._flowing.wait()  # stalled: hold the bytes; TCP back-pressure does the rest
                writer.write(data)
                self.bytes[way] += len(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                if writer.can_write_eof():
                    writer.write_eof()

    def reset(self) -> int:
        """Abort every open connection (both sides, RST); returns how many."""
        conns = list(self._conns)
        for c in conns:
            c.abort()
        self._conns.clear()
        self.counts["resets"] += 1
        self.counts["connections_reset"] += len(conns)
        return len(conns)

    def stall(self, seconds: float) -> float:
        """Forward nothing and hold new connections for ``seconds`` (bounded), then resume."""
        seconds = max(0.0, min(float(seconds), _MAX_STALL))
        loop = asyncio.get_running_loop()
        if self._resume is not None:
            self._resume.cancel()
        self._flowing.clear()
        self._resume = loop.call_later(seconds, self._flowing.set)
        self.counts["stalls"] += 1
        return seconds

    def stats(self) -> dict[str, Any]:
        return {
            "open": len(self._conns),
            "stalled": not self._flowing.is_set(),
            **self.counts,
            "bytes_up": self.bytes["up"],
            "bytes_down": self.bytes["down"],
        }

    async def close(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
        self._flowing.set()
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            c.abort()
        self._conns.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)


class ProxyThread:
    """A :class:`TcpProxy` on its own event loop thread, driven from blocking code."""

    def __init__(self, upstream_host: str, upstream_port: int, listen_host: str = "127.0.0.1") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcpproxy", daemon=True)
        self._thread.start()
        self.proxy = self._call(TcpProxy(upstream_host, upstream_port, listen_host).start())
        self.port = self.proxy.port

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def reset(self) -> int:
        async def go() -> int:
            return self.proxy.reset()

        return self._call(go())

    def stall(self, seconds: float) -> float:
        async def go() -> float:
            return self.proxy.stall(seconds)

        return self._call(go())

    def stats(self) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            return self.proxy.stats()

        return self._call(go())

    def close(self) -> None:
        if not self._loop.is_running():
            return
        with contextlib.suppress(Exception):
            self._call(self.proxy.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    try:
        _check_loopback(host, "address")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return host, int(port)


def _command(proxy: TcpProxy, line: str) -> tuple[dict[str, Any], bool]:
    words = line.split()
    if not words:
        return {"ok": False, "error": "empty command"}, False
    cmd, args = words[0].lower(), words[1:]
    if cmd == "reset" and not args:
        return {"ok": True, "reset": proxy.reset()}, False
    if cmd == "stall" and len(args) == 1:
        try:
            seconds = float(args[0])
        except ValueError:
            return {"ok": False, "error": f"not a number of seconds: {args[0]!r}"}, False
        if not 0 <= seconds <= _MAX_STALL:
            return {"ok": False, "error": f"stall must be within [0, {_MAX_STALL:g}] seconds"}, False
        return {"ok": True, "stalled_for": proxy.stall(seconds)}, False
    if cmd == "stats" and not args:
        return {"ok": True, **proxy.stats()}, False
    if cmd == "quit" and not args:
        return {"ok": True}, True
    return {
        "ok": False,
        "error": f"unknown command {line.strip()[:80]!r}: reset | stall S | stats | quit",
    }, False


async def _serve(upstream: tuple[str, int], listen: tuple[str, int]) -> int:
    proxy = await TcpProxy(upstream[0], upstream[1], listen[0], listen[1]).start()
    print(f"listening on {listen[0]}:{proxy.port}", flush=True)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:
        try:
            for line in sys.stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
        finally:
            loop.call_soon_threadsafe(lines.put_nowait, None)  # EOF: our parent is gone or done

    threading.Thread(target=read_stdin, name="tcpproxy-stdin", daemon=True).start()
    try:
        while True:
            line = await lines.get()
            if line is None:
                break
            reply, done = _command(proxy, line)
            print(json.dumps(reply), flush=True)
            if done:
                break
    finally:
        await proxy.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="A loopback TCP proxy that resets or stalls connections on command."
    )
    p.add_argument("--upstream", type=_hostport, required=True, help="HOST:PORT to forward to (loopback)")
    p.add_argument(
        "--listen", type=_hostport, default=("127.0.0.1", 0), help="HOST:PORT (default 127.0.0.1:0)"
    )
    args = p.parse_args(argv)
    try:
        return asyncio.run(_serve(args.upstream, args.listen))
    except OSError as e:
        print(f"tcpproxy: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
