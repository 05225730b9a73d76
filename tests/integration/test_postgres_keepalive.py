"""Every TCP connection the PostgreSQL store opens (the pool's, a caller's own transaction's, the
LISTEN session's) carries keepalives and a user timeout, so a partition ends it in about 30 s
instead of leaving a thread waiting on it for ever; read back from the sockets themselves."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

from stepwarden.store.base import WORK_CHANNELS
from stepwarden.store.postgres import PostgresStore


def _tcp_options_of_connections_to(
    port: int, leave_out: frozenset[str] = frozenset()
) -> dict[str, dict[str, int]]:
    """The TCP options of this process's sockets connected to ``port``, by socket inode, read with
    getsockopt on a duplicate of each descriptor (closing the duplicate leaves the connection
    alone). ``leave_out``: inodes of connections that were there before (other tests')."""
    found = {}
    for fd, inode in _socket_fds():
        if inode in leave_out:
            continue
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as s:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            if s.getpeername()[1] != port:
                continue
            found[inode] = {
                "keepalive": s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                "idle": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                "interval": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                "count": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                "user_timeout_ms": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
            }
    return found


def _socket_fds() -> Iterator[tuple[int, str]]:
    for entry in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(entry)
            if target.startswith("socket:"):
                yield int(entry.name), target


def _port(url: str) -> int:
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:  # CI's own server is always on 127.0.0.1
        pytest.skip(f"this test reads TCP sockets; {url} does not name a TCP host and port")
    return parts.port


def _with(url: str, **params: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(query=urlencode([*parse_qsl(parts.query), *params.items()])))


def _open_everything(url: str) -> list[dict[str, int]]:
    """Open a store on ``url``, check out every pooled connection (the lease lane's too) and a
    caller's own, and start LISTEN; the TCP options of each of its connections to the server
    while all of them are open."""
    port = _port(url)
    before = frozenset(_tcp_options_of_connections_to(port))
    store = PostgresStore(url)
    seen: list[dict[str, int]] = []

    async def main() -> None:
        stop = asyncio.Event()
        woken: list[str] = []
        listening = asyncio.create_task(store.listen(woken.append, stop, WORK_CHANNELS))
        deadline = asyncio.get_running_loop().time() + 10
        while len(woken) < len(WORK_CHANNELS):  # it wakes every channel once it listens
            assert asyncio.get_running_loop().time() < deadline, "LISTEN never started"
            await asyncio.sleep(0.01)
        with contextlib.ExitStack() as held:
            for _ in range(store.options.pool_size):
                held.enter_context(store.pool.connection())
            held.enter_context(store.lease_pool.connection())
            held.enter_context(store.connect())
            seen.extend(_tcp_options_of_connections_to(port, before).values())
        stop.set()
        await listening

    try:
        asyncio.run(main())
    finally:
        store.close()
    assert len(seen) == store.options.pool_size + 3, seen  # the pools' (roles, lease), a caller's, LISTEN's
    return seen


def test_every_connection_of_the_store_has_keepalives_and_a_user_timeout(pg_url: str) -> None:
    for options in _open_everything(pg_url):
        assert options == {"keepalive": 1, "idle": 10, "interval": 5, "count": 3, "user_timeout_ms": 30000}


def test_values_given_in_the_url_win(pg_url: str) -> None:
    url = _with(pg_url, keepalives_idle="42", tcp_user_timeout="12000", pool_size="1")
    for options in _open_everything(url):
        assert options == {"keepalive": 1, "idle": 42, "interval": 5, "count": 3, "user_timeout_ms": 12000}


def test_percent_encoded_libpq_parameters_reach_the_server_intact(pg_url: str) -> None:
    sep = "&" if "?" in pg_url else "?"
    store = PostgresStore(pg_url + sep + "options=-c%20statement_timeout%3D4321&application_name=my%20app")
    try:
        rows = store.transact_sync(
            lambda tx: tx.sql(
                "SELECT current_setting('statement_timeout') AS t, current_setting('application_name') AS a"
            )
        )
        assert (rows[0]["t"], rows[0]["a"]) == ("4321ms", "my app")
    finally:
        store.close()
