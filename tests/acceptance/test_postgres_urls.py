"""A PostgreSQL URL that cannot work fails at once with one line: exit 2 when the URL itself is
malformed (nothing to retry), exit 1 when the server refuses it (no such database or role) — not
after the pool's ten seconds of retries, and without the pool's warnings on stderr."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from .helpers import SW, Procs, assert_one_error_line, sw, wait_until


def _with(url: str, *, path: str | None = None, user: str | None = None, query: str = "") -> str:
    parts = urlsplit(url)
    netloc = parts.netloc
    if user is not None:
        netloc = f"{user}@{netloc.split('@', 1)[-1]}"
    return urlunsplit(parts._replace(netloc=netloc, path=path or parts.path, query=query))


@pytest.mark.parametrize(
    ("case", "code", "says"),
    [
        ("unknown-database", 1, 'database "sw_no_such_db" does not exist'),
        ("unknown-role", 1, 'role "sw_no_such_role" does not exist'),
        ("bad-sslmode", 2, "invalid sslmode value"),
        ("bad-sslmode-of-a-host-not-resolved", 2, 'invalid sslmode value: "bogus"'),
        ("bad-gssencmode", 2, 'invalid gssencmode value: "maybe"'),
        ("unknown-uri-option", 2, 'invalid URI query parameter: "sw_no_such_option"'),
        ("unclosed-ipv6-bracket", 2, "bad PostgreSQL URL"),
        ("bad-connect-timeout", 2, "bad value for connect_timeout: 'abc'"),
    ],
)
def test_a_url_that_cannot_work_fails_at_once_in_one_line(
    pg_url: str, tmp_path: Path, case: str, code: int, says: str
) -> None:
    url = {
        "unknown-database": _with(pg_url, path="/sw_no_such_db"),
        "unknown-role": _with(pg_url, user="sw_no_such_role"),
        "bad-sslmode": _with(pg_url, query="sslmode=bogus"),
        "bad-sslmode-of-a-host-not-resolved": "postgresql://nosuchhost.invalid/db?sslmode=bogus",
        "bad-gssencmode": _with(pg_url, query="gssencmode=maybe"),
        "unknown-uri-option": _with(pg_url, query="sw_no_such_option=1"),
        "unclosed-ipv6-bracket": "postgresql://[::1/db",
        "bad-connect-timeout": _with(pg_url, query="connect_timeout=abc"),  # was overridden by ours
    }[case]
    r = sw("--db", url, "tasks", cwd=tmp_path)
    line = assert_one_error_line(r, code)
    assert says in line
    assert r.elapsed < 8, f"took {r.elapsed:.1f}s: the pool's retries were waited for"
    assert "WARNING" not in r.stderr


def test_a_server_that_never_suits_is_waited_for_then_named_with_its_reason(
    pg_url: str, tmp_path: Path
) -> None:
    """A refusal that is not the server's FATAL (no server that satisfies target_session_attrs, a
    host name not resolved yet) is waited for, as a restarting server is; when the wait ends, the
    line gives libpq's reason, not the pool's "initialization incomplete"."""
    r = sw("--db", _with(pg_url, query="target_session_attrs=read-only"), "tasks", cwd=tmp_path)
    line = assert_one_error_line(r, 1)
    assert "session is not read-only" in line and "still failing after 10 s" in line, line
    assert "pool initialization" not in line


def _with_password(url: str, password: str) -> tuple[str, str]:
    """``url`` with a password in its user part (the server's own, if the URL has one: a test
    server that trusts local connections ignores one it did not ask for)."""
    parts = urlsplit(url)
    if parts.password:
        return url, parts.password
    user = parts.username or "postgres"
    netloc = f"{user}:{password}@{parts.netloc.split('@', 1)[-1]}"
    return urlunsplit(parts._replace(netloc=netloc)), password


@pytest.mark.parametrize("where", ["user part", "query"])
def test_init_and_a_worker_never_show_the_password(
    pg_url: str, tmp_path: Path, procs: Procs, where: str
) -> None:
    """`init` printed the store's URL as given, and a worker's start line logged it: a password
    in it went to the terminal and to every log collector. Both mask it, as error lines did."""
    if where == "user part":
        url, secret = _with_password(pg_url, "sw-secret-9f3e")
    else:  # the server's own password, if its URL has one, moved to the query
        parts = urlsplit(pg_url)
        secret = parts.password or "sw-secret-9f3e"
        user = parts.username or "postgres"
        url = _with(pg_url, user=user, query=f"password={secret}")
    r = sw("--db", url, "init", cwd=tmp_path)
    assert r.returncode == 0, str(r)
    assert "store ready: postgresql://" in r.stdout and "***" in r.stdout, str(r)
    assert secret not in r.stdout + r.stderr, str(r)
    w = procs.start([str(SW), "--db", url, "worker", "--roles", "scheduler"], "worker")
    wait_until(lambda: "starting: roles=scheduler" in procs.log_of(w) or None, 30, "the start line")
    log = procs.log_of(w)
    assert "store=postgresql://" in log and secret not in log, log
