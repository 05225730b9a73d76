"""What a PostgreSQL URL asks of the store, and whether it can work at all: our own options
split off the libpq URL and checked (``?listen=``, ``pool_size=``, ``prepare=``, ``pooler=``), the
TCP keepalive defaults every connection gets, and the first connection that turns a URL that will
never work into one line at once. Kept apart from the store because all of it is settled before
the store opens a pool, and a URL's parts are wanted without a store (``bench/chaos.py`` connects
with the libpq part alone).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from ..errors import InputError, StoreError
from .base import redact_url

try:
    import psycopg
except ImportError:  # pragma: no cover - exercised only without the extra
    psycopg = None  # type: ignore[assignment]

URL_OPTIONS = ("listen", "pool_size", "prepare", "pooler")
MAX_POOL_SIZE = 1000
# A partition (packets dropped, not refused) gives a socket no error: a statement waits for an
# answer that never comes, a LISTEN connection for notifications, for as long as the kernel keeps
# the connection: about 15 minutes of retransmissions while data is unacknowledged, else until
# libpq's keepalives (on by default, with the kernel's timings: a first probe after 2 hours). These
# settings end such a connection within about 30 s of silence, so the pool replaces it and the
# transaction's caller sees an error it already handles (REL3), instead of a thread that never
# returns. A live server answers the probes at the TCP level, so a slow statement or a long wait
# on a lock is not cut short. Given in the URL, the user's values win; ignored for Unix sockets.
TCP_DEFAULTS = (
    ("keepalives", "1"),
    ("keepalives_idle", "10"),  # seconds of silence before the first probe
    ("keepalives_interval", "5"),
    ("keepalives_count", "3"),  # unanswered probes, then the connection is dead: 10 + 3 * 5 s
    ("tcp_user_timeout", "30000"),  # ms that sent data may stay unacknowledged
)
_ON = ("on", "1", "true", "yes")
_OFF = ("off", "0", "false", "no")


def parse_url(url: str) -> tuple[str, dict[str, str]]:
    """Split our own options (``?listen=off&pool_size=N&prepare=off&pooler=transaction``) off a
    libpq URL; the rest of the query string is libpq's and goes to the server as given."""
    try:
        urlsplit(url)
    except ValueError as e:  # e.g. an unclosed IPv6 bracket
        raise InputError(f"bad PostgreSQL URL: {e}") from None
    # Cut the text itself: urlunsplit would drop an empty host (postgresql:///db?host=/tmp).
    head, _, rest = url.partition("?")
    query, hash_, fragment = rest.partition("#")
    ours: dict[str, str] = {}
    theirs: list[str] = []
    # libpq's parameters are passed on exactly as written: decoding and encoding them again would
    # turn a %20 into a '+', which libpq does not read as a space (options=-c%20name%3Dvalue).
    for raw in filter(None, query.split("&")):
        key, _, value = raw.partition("=")
        if unquote(key) in URL_OPTIONS:
            ours[unquote(key)] = unquote(value)
        else:
            theirs.append(raw)
    return head + ("?" + "&".join(theirs) if theirs else "") + hash_ + fragment, ours


@dataclass(frozen=True)
class PgOptions:
    """How the store uses its connections, from the URL's options (and constructor overrides)."""

    conninfo: str
    listen: bool  # a LISTEN connection for wake-ups (else polling alone)
    prepare: bool  # server-side prepared statements
    pool_size: int
    pooled: bool  # behind a transaction-mode pooler: no session state at all
    tcp: tuple[tuple[str, str], ...] = ()  # TCP_DEFAULTS the URL does not set, for every connection


def _switch(opts: dict[str, str], key: str, default: bool) -> bool:
    value = opts.get(key)
    if value is None:
        return default
    if value.lower() in _ON:
        return True
    if value.lower() in _OFF:
        return False
    raise InputError(f"URL option {key}={value!r}: expected on or off")


def pg_options(
    url: str, *, listen: bool | None = None, prepare: bool | None = None, pool_size: int | None = None
) -> PgOptions:
    """Our URL options, checked, with their defaults.

    ``pooler=transaction``: the URL names a transaction-mode pooler (PgBouncer), which gives each
    transaction whatever server session is free. Nothing may then rely on a session: LISTEN is
    off, server-side prepared statements are off (``prepare=on`` keeps them, for a pooler that
    tracks them: PgBouncer >= 1.22 with ``max_prepared_statements`` > 0), and the session limits
    are set per transaction. ``pooler=session`` (or ``none``) changes nothing. ``listen`` and
    ``prepare`` also work alone; ``pool_size`` is this process's own pool (default 4).
    """
    conninfo, opts = parse_url(url)
    pooler = opts.get("pooler", "none").lower()
    if pooler == "statement":
        raise InputError(
            "URL option pooler=statement: a statement-mode pooler refuses multi-statement "
            "transactions, which every transition needs; use pool_mode = transaction"
        )
    if pooler not in ("transaction", "session", "none"):
        raise InputError(f"URL option pooler={opts['pooler']!r}: expected transaction, session or none")
    pooled = pooler == "transaction"
    listen_on = listen if listen is not None else _switch(opts, "listen", not pooled)
    if pooled and listen_on:
        raise InputError(
            "URL options pooler=transaction and listen=on: LISTEN needs a session of its own, "
            "which a transaction-mode pooler does not give; leave listen off (workers poll)"
        )
    try:
        size = pool_size or int(opts.get("pool_size", "4"))
    except ValueError:
        raise InputError(f"URL option pool_size={opts['pool_size']!r}: expected a whole number") from None
    if not 1 <= size <= MAX_POOL_SIZE:
        # Above it, the connections of one process would exhaust any server's max_connections
        # (100 by default): pool_size=100000 was accepted (found by review).
        raise InputError(f"URL option pool_size={size}: expected from 1 to {MAX_POOL_SIZE}")
    return PgOptions(
        conninfo=conninfo,
        listen=listen_on,
        prepare=prepare if prepare is not None else _switch(opts, "prepare", not pooled),
        pool_size=size,
        pooled=pooled,
        tcp=_tcp_defaults(conninfo),
    )


def _tcp_defaults(conninfo: str) -> tuple[tuple[str, str], ...]:
    """The :data:`TCP_DEFAULTS` that ``conninfo`` leaves unset (and that this libpq knows). A
    conninfo libpq cannot parse gets them all: the first connection then reports what is wrong with
    it, in one line. A ``service=`` entry's own settings are not seen here, so ours win over them."""
    given: dict[str, Any] = {}
    if psycopg is not None:
        with contextlib.suppress(psycopg.ProgrammingError):
            given = psycopg.conninfo.conninfo_to_dict(conninfo)
        if psycopg.pq.version() < 120000:  # libpq 10 and 11 reject tcp_user_timeout as unknown
            given["tcp_user_timeout"] = None
    return tuple((k, v) for k, v in TCP_DEFAULTS if k not in given)


def _first_connection(conninfo: str) -> str | None:
    """Fail at once, in one line, on a URL that cannot work: a malformed one is bad input (exit 2);
    a server that answers with an error (no such database, authentication failed) or a client
    setting libpq rejects will not get better by waiting. A server that cannot be reached
    (refused, timed out: perhaps restarting; a name not yet in DNS) is left to the pool's patient
    open; the reason is returned, for the message if the pool gives up too."""
    try:
        given = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as e:
        raise InputError(f"bad PostgreSQL URL: {_first_line(e)}") from None
    for key, allowed in _CLIENT_CHOICES.items():
        value = given.get(key)
        if value is not None and str(value) not in allowed:
            raise InputError(f'bad PostgreSQL URL {redact_url(conninfo)}: invalid {key} value: "{value}"')
    try:
        # The probe waits 5 s at most (less if the URL says less); a bad connect_timeout of the
        # URL's is bad input here, not a pool that never opens.
        probe_timeout = min(5, psycopg.conninfo.timeout_from_conninfo(given))
    except psycopg.ProgrammingError as e:
        raise InputError(f"bad PostgreSQL URL {redact_url(conninfo)}: {_first_line(e)}") from None
    try:
        psycopg.connect(conninfo, connect_timeout=probe_timeout).close()
    except psycopg.OperationalError as e:
        text = _first_line(e)
        if e.sqlstate is None and "invalid" in text and "value" in text:  # e.g. invalid sslmode value
            raise InputError(f"bad PostgreSQL URL {redact_url(conninfo)}: {text}") from None
        if "FATAL:" in text and not any(t in text for t in _TRANSIENT_FATAL):  # e.g. no such database
            raise StoreError(f"cannot connect to PostgreSQL at {redact_url(conninfo)}: {text}") from None
        return text
    return None


# Settings whose value libpq checks only once it has a host's address (psycopg resolves host names
# first): a mistyped one with a host that does not resolve yet waited out 10 s, and was reported as
# the host. Their values have not changed in libpq since they came (sslmode in 7.4).
_CLIENT_CHOICES = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
}

# A server's refusals that pass: it is starting, stopping or full. Any other FATAL at connect time
# (no such database or role, authentication failed) stays until someone changes something.
_TRANSIENT_FATAL = (
    "starting up",
    "shutting down",
    "recovery mode",
    "too many",
    "connection slots",
    "accepting connections",  # a standby not (yet) accepting connections
    "terminating connection",
)


def _first_line(e: BaseException) -> str:
    text = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
    return text[:400] or type(e).__name__
