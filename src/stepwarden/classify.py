"""The default failure classifier: the rules a user's operation is judged by when its agent gives
no ``classify`` of its own (AGT5).

An exception an operation raises is either ``"transient"`` (retried inside the attempt, with
back-off) or ``"permanent"`` (an error reply at once). The rules grew past what reads well inside
``agent_definition.py``, so they live here; ``stepwarden.agent.default_classify`` is this one.
The user-facing summary is in docs/concepts.md, "How failures are classified".
"""

from __future__ import annotations

import asyncio
import errno
import re
import socket
import sys
from collections.abc import Callable
from types import ModuleType

from .errors import Permanent, Transient

TRANSIENT, PERMANENT = "transient", "permanent"

# An OSError with one of these errnos is a network failure that heals on its own: the peer is
# restarting (ECONNREFUSED), a connection was dropped or cut (ECONNRESET, ECONNABORTED, ENETRESET,
# EPIPE), a route or interface is briefly gone (EHOSTUNREACH, ENETUNREACH, ENETDOWN, EHOSTDOWN), a
# connect or read timed out (ETIMEDOUT), or the kernel is short of a resource for a moment (EAGAIN,
# "try again", the same number as EWOULDBLOCK; ENOBUFS). Python already raises some of them as
# ConnectionError or TimeoutError subclasses; the others (EHOSTUNREACH, ENETUNREACH, ...) come as a
# bare OSError. File and permission errors (ENOENT, EACCES, EISDIR, ...) are not here: they are
# bugs or configuration, which do not heal by retrying. Names this platform lacks are skipped.
_HEALING_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "ECONNREFUSED",
        "ECONNRESET",
        "ECONNABORTED",
        "ENETRESET",
        "EPIPE",
        "EHOSTUNREACH",
        "ENETUNREACH",
        "ENETDOWN",
        "EHOSTDOWN",
        "ETIMEDOUT",
        "EAGAIN",
        "ENOBUFS",
    )
    if hasattr(errno, name)
)

# Third-party HTTP and network clients (requests, urllib3, aiohttp, redis, ...) raise their own
# classes, often not derived from the builtin ConnectionError or TimeoutError (requests'
# ConnectionError and Timeout derive from IOError). An exception is transient if a class in its
# MRO, defined outside ``builtins``, has one of these names; no library is imported to check it.
# Examples: requests.exceptions.ConnectionError / Timeout / ConnectTimeout / ReadTimeout;
# urllib3.exceptions.TimeoutError / ConnectTimeoutError / ReadTimeoutError / NewConnectionError;
# aiohttp.ClientConnectionError / ServerTimeoutError / ServerDisconnectedError.
# (requests' SSLError derives from its ConnectionError, so it is retried too, as httpx's is.)
TRANSIENT_CLASS_NAMES = frozenset(
    {
        "ConnectionError",
        "Timeout",
        "TimeoutError",
        "ConnectTimeout",
        "ReadTimeout",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "NewConnectionError",
        "ClientConnectionError",
        "ServerTimeoutError",
        "ServerDisconnectedError",
    }
)

# Third-party clients' "the server answered with an HTTP status" errors, recognised the same way
# (a class so named in the MRO, outside ``builtins``), then judged by the status they carry, read
# by duck typing: requests' ``HTTPError`` (``exc.response.status_code``), aiohttp's
# ``ClientResponseError`` (``exc.status``), the OpenAI-style SDKs' ``APIStatusError``
# (``exc.status_code``). Without a status (urllib3's ``HTTPError`` is the base of all its errors,
# a requests ``HTTPError`` may carry no response) the rule says nothing and the others decide.
STATUS_CLASS_NAMES = frozenset({"HTTPError", "HTTPStatusError", "ClientResponseError", "APIStatusError"})

# PostgreSQL's error codes (SQLSTATE) that a retry can outlive, for a driver's error that carries
# one (psycopg 3 ``exc.sqlstate``, psycopg2 ``exc.pgcode``): class 08 (the connection failed or was
# lost), 57P01-57P03 (the server is shutting down or starting), 53300 (too many connections),
# 40001 and 40P01 (a serialization failure, a deadlock: the transaction may simply be run again),
# 57014 and 55P03 (a statement_timeout or lock_timeout ran out: timeouts, as everywhere here).
# A psycopg ``OperationalError`` with no code is the client's own failure to connect or to keep
# the connection (refused, reset, timed out), and is transient too.
_HEALING_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300", "40001", "40P01", "57014", "55P03"})

# The server's FATAL refusals at connect that are configuration, which no retry heals (psycopg
# gives them no SQLSTATE): no such database or role, authentication failed, pg_hba.conf. Any other
# FATAL (starting up, shutting down, not accepting connections yet, terminating the connection,
# too many clients, ...) a retry may outlive: listed the other way round, a refusal the list did
# not name (a standby "not yet accepting connections") was judged permanent.
_REFUSED_AT_CONNECT = re.compile(
    r"FATAL:.*(does not exist|authentication failed|pg_hba\.conf|no password supplied"
    r"|permission denied|not permitted to log in)",
    re.S,
)

# How many ``raise ... from`` links are followed below the exception raised.
MAX_CAUSES = 5


# How many exceptions of an exception group (nested groups flattened) are looked at.
MAX_LEAVES = 100


def default_classify(exc: BaseException) -> str:
    """``"transient"`` or ``"permanent"`` (AGT5); the rules are listed in docs/concepts.md,
    "How failures are classified". Give an agent ``classify=`` to judge its failures otherwise.

    Timeouts, connection and network errors (builtin, standard library, httpx, and by class name
    other clients'; PostgreSQL drivers' by SQLSTATE), HTTP 5xx, 408, 425 and 429 (urllib's,
    httpx's, and other clients' status errors), and :class:`Transient` are worth retrying;
    :class:`Permanent`, other HTTP statuses, and anything else (a bug does not heal by retrying)
    are not. An exception raised ``from`` a transient one is transient. An exception group (a
    ``TaskGroup`` fan-out) is permanent if any of its exceptions is judged permanent by a rule
    (:class:`Permanent`, a 404), else transient if any is transient, else permanent.
    """
    return _along_causes(exc, MAX_CAUSES, set()) or PERMANENT


def error_text(e: BaseException) -> str:
    """``str(e)``, or, when that raises (a broken ``__str__``, one that returns no text), a
    note that says so. The text of an error is read to report it; a failure to read it must not
    become a failure of its own: the reply that reports it would never be sent, and the request
    would stay taken until complete-by, its permanent failure retried at every attempt."""
    try:
        return str(e)
    except Exception as broken:  # a BaseException (a stop) is not ours to swallow
        return f"<its text could not be read: {type(broken).__name__} in {type(e).__name__}.__str__>"


def shown(value: object) -> str:
    """``repr(value)``, or a note that it could not be read (see :func:`error_text`)."""
    try:
        return repr(value)
    except Exception as broken:
        return f"<a {type(value).__name__} whose repr raised {type(broken).__name__}>"


def judge(classify: Callable[[BaseException], object], exc: BaseException) -> tuple[str, str | None]:
    """``(kind, trouble)``: what an agent's ``classify`` says of ``exc`` (of a :class:`Permanent` or
    :class:`Transient`, what the operation said, unasked). A classify that raises,
    or returns anything but ``"transient"`` or ``"permanent"``, is a bug of the agent's: the
    failure is then permanent, at once (an error reply, not silence until complete-by, nor a
    retry the author never asked for), and ``trouble`` says why, for the error text."""
    if isinstance(exc, Permanent | Transient):
        # The operation's own word, whatever the agent's classify would say: the docs promise
        # "raise Permanent in the operation" works with any classify (a classify written for
        # library errors, returning "transient" for the rest, retried a declined card).
        return (PERMANENT if isinstance(exc, Permanent) else TRANSIENT), None
    try:
        kind = classify(exc)
    except Exception as e:  # a BaseException (a stop) is not classify's to swallow
        return PERMANENT, f"classify raised {type(e).__name__}: {error_text(e)}"
    if isinstance(kind, str) and kind in (TRANSIENT, PERMANENT):
        return (TRANSIENT if kind == TRANSIENT else PERMANENT), None
    return PERMANENT, f"classify returned {shown(kind)}, not 'transient' or 'permanent'"


def _along_causes(exc: BaseException, links: int, seen: set[int]) -> str | None:
    """The first verdict along ``exc`` and its ``__cause__`` chain (at most ``links`` links, each
    exception once); None when no rule has one (the caller's default: permanent)."""
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        verdict = _verdict(current, links, seen)
        if verdict is not None:
            return verdict
        if links <= 0:
            break
        links -= 1
        current = current.__cause__
    return None


def _group(exc: BaseExceptionGroup[BaseException], links: int, seen: set[int]) -> str | None:
    """A group's verdict from its leaves (nested groups flattened, at most ``MAX_LEAVES``): one
    leaf judged permanent by a rule (the author's :class:`Permanent`, a service's 4xx) makes the
    group permanent, as a retry would meet the same answer; else one transient leaf (a
    ConnectionError among the fan-out's calls) makes it transient; else no verdict."""
    verdicts: set[str | None] = set()
    stack: list[BaseException] = list(exc.exceptions)
    looked = 0
    while stack and looked < MAX_LEAVES:
        leaf = stack.pop()
        if isinstance(leaf, BaseExceptionGroup):
            if id(leaf) not in seen:
                seen.add(id(leaf))
                stack.extend(leaf.exceptions)
            continue
        looked += 1
        # One `seen` for all the leaves: an exception two leaves share (a common cause) is
        # judged once, and its verdict is in `verdicts` already.
        verdicts.add(_along_causes(leaf, links, seen))
    if PERMANENT in verdicts:
        return PERMANENT
    return TRANSIENT if TRANSIENT in verdicts else None


def _verdict(exc: BaseException, links: int, seen: set[int]) -> str | None:
    """What the rules say about ``exc`` alone, or None: then its cause decides.

    A verdict of permanent here (Permanent, an HTTP status not worth retrying) is final: the
    cause of an answer the service gave, or of a failure the author called permanent, is moot.
    """
    if isinstance(exc, Permanent):
        return PERMANENT
    if isinstance(exc, Transient):
        return TRANSIENT
    if isinstance(exc, BaseExceptionGroup):
        return _group(exc, links, seen)
    urllib_error = sys.modules.get("urllib.error")
    if isinstance(exc, _class(urllib_error, "HTTPError")):  # before URLError and OSError: it is both
        code = getattr(exc, "code", None)
        return _status(code) if isinstance(code, int) else None
    if isinstance(exc, _class(urllib_error, "URLError")):
        reason = getattr(exc, "reason", None)  # an exception (socket.timeout is TimeoutError) or a message
        # The reason counts as one link, as a cause does, so nested URLErrors stay bounded too.
        if (
            isinstance(reason, BaseException)
            and links > 0
            and _along_causes(reason, links - 1, seen) == TRANSIENT
        ):
            return TRANSIENT
        return None
    if isinstance(exc, TimeoutError | ConnectionError | socket.gaierror):
        return TRANSIENT
    http_client = sys.modules.get("http.client")
    if isinstance(exc, _class(http_client, "RemoteDisconnected") + _class(http_client, "IncompleteRead")):
        return TRANSIENT
    if isinstance(exc, OSError) and exc.errno in _HEALING_ERRNOS:
        return TRANSIENT
    httpx = sys.modules.get("httpx")
    if isinstance(exc, _class(httpx, "HTTPStatusError")):
        return _status(exc.response.status_code)  # type: ignore[attr-defined]  # httpx's, by _class
    if isinstance(exc, _class(httpx, "TransportError")):
        return TRANSIENT
    foreign = [c for c in type(exc).__mro__ if c.__module__ != "builtins"]
    if any(c.__name__ in TRANSIENT_CLASS_NAMES for c in foreign):
        return TRANSIENT
    if isinstance(exc, asyncio.IncompleteReadError):  # the peer closed mid-read (StreamReader)
        return TRANSIENT
    if any(c.__name__ in STATUS_CLASS_NAMES for c in foreign):
        code = _status_of(exc)
        if code is not None:
            return _status(code)
    return _database_verdict(exc, foreign)


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status a client's error carries, if it carries one (see STATUS_CLASS_NAMES)."""
    response = getattr(exc, "response", None)
    for holder in (exc, response):
        for name in ("status_code", "status"):
            code = getattr(holder, name, None) if holder is not None else None
            if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599:
                return code
    return None


def _database_verdict(exc: BaseException, foreign: list[type]) -> str | None:
    """PostgreSQL drivers' errors that a retry can outlive (see _HEALING_SQLSTATES); None otherwise:
    a constraint violation or a syntax error does not heal by retrying."""
    code = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    if isinstance(code, str):
        return TRANSIENT if code.startswith("08") or code in _HEALING_SQLSTATES else None
    from_psycopg = any(c.__module__.split(".")[0] in ("psycopg", "psycopg2") for c in foreign)
    if from_psycopg and any(c.__name__ == "OperationalError" for c in foreign):
        # No code: the client could not connect, or lost the connection; but psycopg also
        # reports the server's refusal at connect (FATAL) without its code, and a database or
        # role that does not exist, or a password refused, is configuration, not a blip.
        return PERMANENT if _REFUSED_AT_CONNECT.search(_text(exc)) else TRANSIENT
    return None


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return ""


def _class(module: ModuleType | None, name: str) -> tuple[type, ...]:
    """``(module.name,)``, or ``()`` if the module was never imported: then no exception of that
    class can exist, and the rule needs no import (http.client alone pulls in the email package,
    a fifth of a CLI command's start)."""
    cls = getattr(module, name, None)
    return (cls,) if isinstance(cls, type) else ()


def _status(code: int) -> str:
    """HTTP status rule: the server is failing or asks to come back later (5xx, 408 Request
    Timeout, 425 Too Early, 429 Too Many Requests) is transient; any other status is permanent."""
    return TRANSIENT if code >= 500 or code in (408, 425, 429) else PERMANENT
