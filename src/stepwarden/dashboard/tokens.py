"""The operator token: the one rule for what a token is, and the limit on guessing it.

**The rule.** A token is compared without its surrounding whitespace, wherever it comes from: the
configured one (``--token``, ``STEPWARDEN_DASHBOARD_TOKEN``, or ``--token-file``: a value read from
a file, with its trailing newline), the ``Authorization: Bearer`` header (spaces or tabs around
it), and the sign-in form (a pasted value with spaces around it). A configured token must then be
printable ASCII with no space or control character inside (a Bearer header cannot carry anything
else intact), else the dashboard refuses to start, with one line saying why and never the token
itself. An empty value means no token: the dashboard is read-only. One shorter than 16 characters
is accepted with a warning.

**The limit.** A pause after each wrong token does not slow guesses sent in parallel, and a pause
taken in turn holds every waiting request (unbounded memory), while the right token, answered at
once, tells the guesser at once: what must be limited is how many tokens are *checked*.
:class:`GuessLimiter` allows ``burst`` wrong tokens, coming back at ``per_second``, over every
client together; while none is left, a presented token is refused (429, ``Retry-After``) without
being checked. Nothing waits in a queue, so the right token is never behind wrong ones: it is
checked at once whenever an allowance is left, and uses none. A flood of wrong tokens from one
address would otherwise keep every other client out as long as it lasts: an address that sent no
wrong token in the last ``remember`` seconds may use a small reserve (``spare_per_second``), which
an address that guessed wrong may not. Behind a proxy every client has the proxy's address, and
on a loopback bind every local client is 127.0.0.1: the reserve does not tell them apart, and a
local process sending wrong tokens keeps the right one at 429 while it lasts. That is accepted:
checking a presented token while refusing would answer "right" (anything but 429) at any rate,
reopening the guessing the limit stops. Signed-in browsers are never affected (their cookie is
not a token check).
"""

from __future__ import annotations

import logging
import math
import os
import stat
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import InputError

__all__ = [
    "GuessLimiter",
    "Throttled",
    "bearer_credentials",
    "configured_token",
    "presented_token",
    "read_token_file",
    "weak_token_warning",
]

log = logging.getLogger("stepwarden.dashboard")


def presented_token(value: str) -> str:
    """A token as a client presented it, without surrounding whitespace (spaces, tabs, newlines)."""
    return value.strip()


def configured_token(value: str | None) -> str | None:
    """The configured token by the same rule, checked: None when unset or empty (read-only).

    Raises InputError (a ValueError), whose message never holds the token, for one that is only whitespace or
    holds a space, a control character or a non-ASCII character inside."""
    if value is None or value == "":
        return None
    token = presented_token(value)
    if not token:
        raise InputError(
            "the operator token is only whitespace; set one, or leave it empty for a read-only dashboard"
        )
    if not all("\x21" <= c <= "\x7e" for c in token):
        raise InputError(
            "the operator token may hold only printable ASCII characters, with no space, tab or "
            "control character inside (a Bearer header cannot carry them)"
        )
    return token


# At the limiter's 4 checks a second a token is tried ~350,000 times a day: a word or a short
# string can be guessed, 16 random characters cannot.
MIN_LENGTH = 16
MAX_FILE_BYTES = 4096  # a token file holds one token; more is the wrong file


def weak_token_warning(token: str | None) -> str | None:
    """A warning line for a configured token short enough to guess (it is still accepted: the
    operator may have reasons, and refusing would turn an upgrade into an outage)."""
    if token is None or len(token) >= MIN_LENGTH:
        return None
    return (
        f"the operator token has {len(token)} characters; one of {MIN_LENGTH} or more random characters"
        " cannot be guessed: python -c 'import secrets; print(secrets.token_urlsafe())'"
    )


def read_token_file(path: str) -> tuple[str, list[str]]:
    """The token in a file (a Docker or systemd secret, ``--token-file <(pass show ...)``), and
    warnings about the file. Unlike an empty ``--token``, a file that holds no token is an error:
    naming a file says a token was meant. Pipes are read too (process substitution); only a regular
    file's mode is checked, and one that other users may read or write is warned about, as ssh does
    for a key. Raises InputError, whose message never holds the file's content."""
    try:
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            data = f.read(MAX_FILE_BYTES + 1)
    except IsADirectoryError:
        raise InputError(f"the token file {path} is a directory") from None
    except OSError as e:
        raise InputError(f"cannot read the token file {path}: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise InputError(
            f"the token file {path} is longer than {MAX_FILE_BYTES} bytes: is it the right file?"
        )
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise InputError(
            f"the token file {path} holds non-ASCII bytes; the operator token may hold only printable"
            " ASCII characters"
        ) from None
    if not text.strip():
        raise InputError(f"the token file {path} holds no token (it is empty or only whitespace)")
    try:
        token = configured_token(text)
    except InputError as e:
        raise InputError(f"the token file {path}: {e}") from None
    assert token is not None  # not blank, checked above
    warnings = []
    if stat.S_ISREG(info.st_mode) and info.st_mode & 0o077:
        warnings.append(
            f"the token file {path} is open to other users (mode {stat.S_IMODE(info.st_mode):04o});"
            f" chmod 600 {path}"
        )
    return token, warnings


def bearer_credentials(header: str) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header value ("" if it names none), or None
    when the header names another scheme. The scheme is case-insensitive, and spaces or tabs may
    surround it and the token."""
    parts = header.split(None, 1)
    if not parts or parts[0].lower() != "bearer":
        return None
    return presented_token(parts[1]) if len(parts) == 2 else ""


class Throttled(Exception):
    """Too many wrong tokens lately; ``retry_after`` is how many seconds until one is checked."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"too many wrong tokens; try again in {retry_after:.1f}s")
        self.retry_after = retry_after


@dataclass
class _Bucket:
    per_second: float
    burst: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.burst, self.level + (now - self.stamp) * self.per_second)
        self.stamp = max(self.stamp, now)

    def wait(self) -> float:
        """Seconds until one allowance is there (0 when it is)."""
        return max(0.0, (1.0 - self.level) / self.per_second)


class GuessLimiter:
    """How many presented tokens the dashboard checks, over every client together (see above)."""

    def __init__(
        self,
        clock: Clock = SYSTEM_CLOCK,
        *,
        per_second: float = 4.0,
        burst: float = 10.0,
        spare_per_second: float = 0.2,
        spare_burst: float = 2.0,
        remember: float = 600.0,
        max_addresses: int = 4096,
    ) -> None:
        now = clock.monotonic()
        self.clock = clock
        self.main = _Bucket(per_second, burst, burst, now)
        self.spare = _Bucket(spare_per_second, spare_burst, spare_burst, now)
        self.remember = remember
        self.max_addresses = max_addresses
        # Addresses that sent a wrong token, oldest first, with when: at most max_addresses of them.
        self._guessed: OrderedDict[str, float] = OrderedDict()
        self.checked = 0  # tokens checked, right or wrong
        self.throttled = 0  # tokens refused unchecked
        self._logged = -math.inf

    def check(self, address: str, matches: Callable[[], bool]) -> bool:
        """``matches()`` (is it the right token?) if a token from ``address`` may be checked now;
        a wrong one uses an allowance. Raises :class:`Throttled` without calling it otherwise."""
        now = self.clock.monotonic()
        self.main.refill(now)
        self.spare.refill(now)
        self._forget(now)
        if self.main.level >= 1.0:
            bucket = self.main
        elif address not in self._guessed and self.spare.level >= 1.0:
            bucket = self.spare
        else:
            self._refuse(address, now)
        self.checked += 1
        if matches():
            self._guessed.pop(address, None)
            return True
        bucket.level -= 1.0
        self._guessed.pop(address, None)
        self._guessed[address] = now
        while len(self._guessed) > self.max_addresses:
            self._guessed.popitem(last=False)
        return False

    def _forget(self, now: float) -> None:
        while self._guessed:
            address, when = next(iter(self._guessed.items()))
            if now - when < self.remember:
                break
            del self._guessed[address]

    def _refuse(self, address: str, now: float) -> NoReturn:
        self.throttled += 1
        wait = self.main.wait()
        if address not in self._guessed:
            wait = min(wait, self.spare.wait())
        if now - self._logged >= 60.0:  # one line a minute while it lasts, not one a request
            self._logged = now
            log.warning(
                "dashboard: too many wrong tokens; checking at most %g a second (%d refused unchecked "
                "so far)",
                self.main.per_second,
                self.throttled,
            )
        raise Throttled(wait)
