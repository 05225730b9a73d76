"""A PostgreSQL outage is a few lines in a worker's log, not a minute of warnings (REL3).

Found by review: 60 s of a stopped server gave each worker about 110 lines: psycopg_pool's warning
per reconnection try and per dead connection, and the LISTEN loop's warning per try (every 0.2 s
to 5 s). The roles, the lease keeper and the LISTEN loop now log an outage once at its start and
once at its end; the pool's repeating warnings pass once a minute per kind and pool.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from stepwarden.store import open_store
from stepwarden.store.pg_sessions import REPEAT_EVERY, _OnceAMinute


def record(msg: str, args: tuple[object, ...], at: float) -> logging.LogRecord:
    r = logging.LogRecord("psycopg.pool", logging.WARNING, __file__, 1, msg, args, None)
    r.created = at
    return r


def test_the_pools_repeating_warnings_pass_once_a_minute_per_kind_and_pool() -> None:
    f = _OnceAMinute()
    err = "error connecting in %r: %s"
    assert f.filter(record(err, ("stepwarden", "refused"), 1000.0))
    assert not f.filter(record(err, ("stepwarden", "refused"), 1001.0))
    assert f.filter(record(err, ("stepwarden-lease", "refused"), 1001.0))  # another pool

    class Ours:
        name = "stepwarden"

    class Conn:
        _pool = Ours()

    assert f.filter(record("discarding broken connection: %s", (Conn(),), 1001.0))  # another kind
    assert not f.filter(record("discarding broken connection: %s", (Conn(),), 1002.0))
    assert f.filter(record("pool %r is ready to use", ("stepwarden",), 1002.0))  # not a repeating one
    assert f.filter(record(err, ("stepwarden", "refused"), 1000.0 + REPEAT_EVERY))
    # found by review: another error of the same kind passes at once (a refusal, then a password)
    assert f.filter(record(err, ("stepwarden", "password authentication failed"), 1001.0 + REPEAT_EVERY))
    # ... and the application's own pools (the logger is the process's) are not ours to quiet
    assert all(f.filter(record(err, ("orders", "refused"), 2000.0 + i)) for i in range(3))

    class Theirs:
        name = "orders"

    class TheirConn:
        _pool = Theirs()

    assert all(
        f.filter(record("discarding broken connection: %s", (TheirConn(),), 2000.0 + i)) for i in range(3)
    )


def test_the_listen_loop_logs_an_outage_once_and_its_end_once(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(pg_url)
    real = store.dsn  # type: ignore[attr-defined]
    store.dsn = "postgresql://127.0.0.1:1/none?connect_timeout=2"  # type: ignore[attr-defined]
    woken: list[str] = []

    async def body() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(store.listen(woken.append, stop))
        deadline = asyncio.get_running_loop().time() + 10
        while not any("still lost" in r.getMessage() for r in caplog.records):  # a second refusal
            assert asyncio.get_running_loop().time() < deadline, "no second try"
            await asyncio.sleep(0.05)
        store.dsn = real  # type: ignore[attr-defined]
        deadline = asyncio.get_running_loop().time() + 10
        while not woken and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 10)

    try:
        with caplog.at_level(logging.DEBUG, logger="stepwarden.postgres"):
            asyncio.run(body())
    finally:
        store.close()
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if "LISTEN connection" in r.getMessage()]
    assert [level for level, _ in lines if level != "DEBUG"] == ["WARNING", "INFO"], lines
    assert "back after" in lines[-1][1] and len(lines) >= 3, lines  # the later tries at DEBUG
    assert woken, "listening again, it wakes the loops for what was sent meanwhile"
