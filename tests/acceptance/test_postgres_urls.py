"""A PostgreSQL URL that cannot work fails at once with one line: exit 2 when the URL itself is
malformed (nothing to retry), exit 1 when the server refuses it (no such database or role) — not
after the pool's ten seconds of retries, and without the pool's warnings on stderr."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from .helpers import assert_one_error_line, sw


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
