"""Who may act, and from where: the operator token, CSRF tokens, same-origin and host checks.

Reading is open to whoever can reach the port (it binds to 127.0.0.1 unless told otherwise).
Acting (retry, cancel, acknowledge) needs all of:

1. a configured token (``--token`` / ``STEPWARDEN_DASHBOARD_TOKEN``); without one actions are off;
   every token, configured or presented, is compared without surrounding whitespace, and only
   so many wrong ones are checked a second, over all clients (:mod:`.tokens`);
2. a request from the dashboard's own origin (``Origin``, else ``Referer``, must match ``Host``);
3. a CSRF token in the form, bound to the browser's session cookie (HMAC, so nothing is stored);
4. a signed-in session: the operator typed the token once (``/login``), and got an auth cookie
   bound to that session. Scripts may instead send ``Authorization: Bearer TOKEN`` (a header no
   cross-site form can set, so it needs no CSRF token).

Cookies are ``HttpOnly`` and ``SameSite=Lax`` (and ``Secure`` behind a TLS proxy, when set and
when deleted). Lax, not Strict: a link to the dashboard followed from another site (chat, mail,
an alert's page) arrived without the session cookie, the page set a new one, and the operator was
signed out for good. Lax sends the cookies only with such top-level GETs, which only read; an
action is a POST, which Lax keeps them from (and which needs the same origin and a CSRF token).
The signing key is random per process, so a restart signs everyone out. When the dashboard
listens on a loopback address, requests must name an IP address, ``localhost``, the public
origin's host or a host allowed by name
(``Host: 127.0.0.1``, ``Host: localhost``), which stops DNS-rebinding pages from reading it;
beyond loopback the same check is on once a public origin or an allowed host is named
(:class:`~.web.HostCheck`, :mod:`.hosts`, ``--allowed-host``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import re
import secrets
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response

from .tokens import GuessLimiter, Throttled, bearer_credentials, configured_token, presented_token

__all__ = ["Guard", "Refused", "check_actor", "check_origin", "safe_next"]

SESSION_COOKIE = "sw_session"
AUTH_COOKIE = "sw_auth"
SIGNED_OUT_MAX = 10_000  # signed-out sessions remembered (see Guard.signed_out)
AUTH_TTL = 12 * 3600.0
_ACTOR = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
_SID = re.compile(r"^[0-9a-f]{32}$")


class Refused(Exception):
    """An action refused; ``status`` is the HTTP status, ``str(self)`` what the operator reads,
    ``retry_after`` the seconds to wait (a 429's ``Retry-After``)."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def check_actor(name: str) -> str:
    name = name.strip()
    if not name:
        return "dashboard"
    if not _ACTOR.match(name):
        raise Refused(400, "a name is 1-64 letters, digits or _ . @ -")
    return f"dashboard:{name}"


@dataclass
class Guard:
    token: str | None
    secure_cookies: bool = False
    # The origin browsers see (``https://ops.example.com``) when a TLS proxy is in front: the
    # dashboard itself serves plain http, so the Origin its pages send is not its own scheme.
    public_origin: str | None = None
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    guesses: GuessLimiter = field(default_factory=GuessLimiter)
    # Sessions signed out, until their auth cookie would have expired anyway: a copy of the cookie
    # (another tab, a proxy's log, a shared machine) stayed valid for the rest of AUTH_TTL after
    # "sign out". Bounded: the oldest go first past SIGNED_OUT_MAX (they are at most AUTH_TTL old).
    signed_out: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The one rule (see .tokens): surrounding whitespace is not part of the token; a token
        # that is blank, or holds a space or control character inside, is a ValueError.
        self.token = configured_token(self.token)

    @property
    def actions_enabled(self) -> bool:
        return bool(self.token)

    # -- signing ------------------------------------------------------------------------------------
    def _sign(self, *parts: str) -> str:
        return hmac.new(self.key, "\x1f".join(parts).encode(), hashlib.sha256).hexdigest()

    def session_id(self, request: Request) -> str | None:
        sid = request.cookies.get(SESSION_COOKIE, "")
        return sid if _SID.match(sid) else None

    def csrf_token(self, sid: str) -> str:
        return self._sign("csrf", sid)

    def actor(self, request: Request) -> str | None:
        """The signed-in operator of this session, or None."""
        sid = self.session_id(request)
        raw = request.cookies.get(AUTH_COOKIE, "")
        if sid is None or not self.actions_enabled or raw.count("!") != 2 or sid in self.signed_out:
            return None
        actor, expires, sig = raw.split("!")
        # As bytes: compare_digest refuses str with non-ASCII characters (TypeError), and any page
        # on this host can set a cookie that every page of the dashboard then failed on.
        if not hmac.compare_digest(sig.encode(), self._sign("auth", sid, actor, expires).encode()):
            return None
        try:
            if float(expires) < time.time():
                return None
        except ValueError:
            return None
        return actor

    # -- cookies ------------------------------------------------------------------------------------
    def ensure_session(self, request: Request, response: Response) -> str:
        sid = self.session_id(request)
        if sid is None:
            sid = secrets.token_hex(16)
            self._cookie(response, SESSION_COOKIE, sid)
        return sid

    def _cookie(self, response: Response, name: str, value: str, max_age: int | None = None) -> None:
        response.set_cookie(
            name,
            value,
            max_age=max_age,
            path="/",
            httponly=True,
            samesite="lax",
            secure=self.secure_cookies,
        )

    def sign_in(self, response: Response, actor: str) -> str:
        """A fresh session (no fixation) with its auth cookie; returns the new session id."""
        sid = secrets.token_hex(16)
        expires = f"{time.time() + AUTH_TTL:.0f}"
        self._cookie(response, SESSION_COOKIE, sid)
        self._cookie(response, AUTH_COOKIE, f"{actor}!{expires}!{self._sign('auth', sid, actor, expires)}")
        return sid

    def sign_out(self, response: Response, request: Request | None = None) -> None:
        sid = self.session_id(request) if request is not None else None
        if sid is not None:  # its auth cookie is refused from now on, wherever a copy of it is
            now = time.time()
            for gone in [k for k, until in self.signed_out.items() if until < now]:
                del self.signed_out[gone]
            while len(self.signed_out) >= SIGNED_OUT_MAX:
                del self.signed_out[next(iter(self.signed_out))]
            self.signed_out[sid] = now + AUTH_TTL
        # With the flags it was set with, Secure included: it was left out, so behind a TLS proxy
        # the deleting cookie was a non-Secure one replacing a Secure one.
        response.delete_cookie(
            AUTH_COOKIE, path="/", httponly=True, samesite="lax", secure=self.secure_cookies
        )
        self._cookie(response, SESSION_COOKIE, secrets.token_hex(16))

    # -- checks ---------------------------------------------------------------------------------------
    def _token_digest(self, value: str) -> bytes:
        return hmac.new(
            self.key, b"token\x1f" + value.encode("utf-8", "surrogatepass"), hashlib.sha256
        ).digest()

    def token_ok(self, given: str, request: Request) -> bool:
        """``given`` (a Bearer header's token or the sign-in form's) is the configured token, by the
        rule of :mod:`.tokens`. Raises :class:`Refused` (429) without checking it when too many
        wrong tokens came lately (:class:`~.tokens.GuessLimiter`)."""
        token = self.token
        if not token:
            return False
        given = presented_token(given)
        # Digests of equal length: compare_digest of the raw values takes a time that tells the
        # token's length. Keyed, so nothing about the token can be computed ahead.
        want = self._token_digest(token)
        address = request.client.host if request.client else ""
        try:
            return self.guesses.check(address, lambda: hmac.compare_digest(self._token_digest(given), want))
        except Throttled as e:
            wait = max(1, math.ceil(e.retry_after))
            # "From any client": the limit is shared (.tokens), so one who sent no wrong token is
            # told why it is refused too (on a loopback bind every local client is 127.0.0.1).
            raise Refused(
                429, f"refused: too many wrong tokens lately, from any client; try again in {wait}s", wait
            ) from None

    def is_script(self, request: Request, form: FormData | None) -> bool:
        """A script's request (a Bearer header, no dashboard session, no CSRF field): it is
        answered in one line of text, and its Bearer token alone decides. ``form`` is None when
        the request was refused before its form was read; it has no CSRF field then."""
        no_csrf = form is None or "csrf" not in form
        return names_bearer(request) and self.session_id(request) is None and no_csrf

    def check_form(self, request: Request, form: FormData) -> None:
        """Same origin and a valid CSRF token for this session, or :class:`Refused`."""
        check_origin(request, self.public_origin)
        sid = self.session_id(request)
        given = form.get("csrf")
        if (
            sid is None
            or not isinstance(given, str)
            or not hmac.compare_digest(given.encode(), self.csrf_token(sid).encode())  # bytes: see actor
        ):
            raise Refused(403, "refused: missing or invalid CSRF token (reload the page and try again)")

    def check_action(self, request: Request, form: FormData) -> str:
        """Everything an operator action needs; returns the actor to record."""
        if not self.actions_enabled:
            raise Refused(
                403,
                "refused: operator actions are disabled; start the dashboard with --token "
                "or STEPWARDEN_DASHBOARD_TOKEN",
            )
        given = bearer_credentials(request.headers.get("authorization", ""))
        if given is None:
            return self._signed_in(request, form)
        if self.is_script(request, form):
            # A script's wrong token: say so, not "no Origin" or "no CSRF token".
            if self.token_ok(given, request):
                return "dashboard:api"
            raise Refused(401, "refused: wrong bearer token")
        # A browser with a session (behind a proxy that adds its own Bearer header to every
        # request): its session and form decide, and that header is not checked, so it uses none
        # of the wrong-token allowance. Only if they fail is the header tried, as a token like any
        # other (a script that keeps cookies), limited like any other; else the form's refusal.
        try:
            return self._signed_in(request, form)
        except Refused as refused:
            # A 429 (too many wrong tokens: not checked) is suppressed: the form's refusal says
            # what this browser can do about it.
            with contextlib.suppress(Refused):
                if self.token_ok(given, request):
                    return "dashboard:api"
            raise refused

    def _signed_in(self, request: Request, form: FormData) -> str:
        self.check_form(request, form)
        actor = self.actor(request)
        if actor is None:
            raise Refused(401, "refused: the operator token is required; sign in with the dashboard token")
        return actor


def names_bearer(request: Request) -> bool:
    """The request authenticates as a script (``Authorization: Bearer ...``); no page of another
    site can send that header here, since the dashboard answers no CORS preflight."""
    return bearer_credentials(request.headers.get("authorization", "")) is not None


def own_origin(request: Request) -> str:
    host = request.headers.get("host", "")
    return f"{request.url.scheme}://{host}".lower()


def check_origin(request: Request, public_origin: str | None = None) -> None:
    """The request comes from a page of this dashboard: ``Origin`` (else ``Referer``) matches its
    own origin, or the public origin it is served under behind a proxy."""
    origin = request.headers.get("origin")
    if origin is None:
        referer = request.headers.get("referer")
        if referer is None:
            raise Refused(403, "refused: the request names no Origin or Referer")
        parts = urlsplit(referer)
        origin = f"{parts.scheme}://{parts.netloc}"
    allowed = {own_origin(request)} | ({public_origin.lower()} if public_origin else set())
    if origin.lower() not in allowed:
        raise Refused(403, "refused: cross-origin request")


def safe_next(value: object, default: str = "/") -> str:
    """A local path to go back to after signing in (never another site)."""
    if not isinstance(value, str) or not value.startswith("/") or value.startswith("//") or "\\" in value:
        return default
    if len(value) > 2000 or any(ord(c) < 0x20 for c in value):
        return default
    return value
