"""The dashboard's ASGI application: pages, live fragments, operator actions, ``/metrics``.

Every page is a full HTML document whose live part is re-fetched every ``poll`` seconds by htmx
(``?partial=1`` returns only that part), so the page stays current without reloads and still
reads without JavaScript. Store reads run off the event loop (``store.transact``). See
:mod:`.security` for who may act.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import urlencode

from jinja2 import Environment, PackageLoader
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..clock import SYSTEM_CLOCK, Clock
from ..durations import short as short_duration
from ..errors import InputError, NotFound
from ..metrics import CONTENT_TYPE, StoreMetrics
from ..store import TASK_STATES, Store
from ..store import transitions as tr
from . import data
from .hosts import host_key, host_of_header, ip_literal
from .security import Guard, Refused, check_actor, safe_next
from .tokens import GuessLimiter

log = logging.getLogger("stepwarden.dashboard")
MAX_QUERY = 255
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


class SecurityHeaders:
    """Adds a strict Content-Security-Policy and friends to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in SECURITY_HEADERS if k not in have]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class HostCheck:
    """Answers 400 unless the ``Host`` header names one of ``allowed`` or is an IP address.

    The defence against DNS rebinding: a page of ``evil.example`` whose name is made to resolve to
    this dashboard's address reads it as its own origin, but its browser still sends
    ``Host: evil.example``. Rebinding needs a DNS name, so a ``Host`` that is an IP address
    (``10.0.0.5:8080``, a load balancer's health check, an operator typing the address) comes
    from a page of that very origin, and is answered; names must be on the list. The list and
    each header are compared by :func:`~.hosts.host_key` (no case, port or final dot), here and
    only here, so that callers of :func:`create_app` may give names as operators type them."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self.allowed = frozenset(host_key(h) for h in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            name = host_of_header(host)
            if name not in self.allowed and not ip_literal(name):
                text = (
                    f"invalid Host header: {name[:100]!r} is not a name this dashboard answers to"
                    " (its operator can add it with --allowed-host)\n"
                )
                await PlainTextResponse(text, status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


MAX_BODY = 64 * 1024  # bytes of a request body: the dashboard's forms are a few hundred bytes
FORM_MAX_FIELDS = 16  # fields of a form: the sign-in form, the largest, has four


class _BodyTooLarge(Exception):
    """Raised from :class:`BodyLimit`'s ``receive`` to stop the application reading a body."""


class Failures:
    """Answers a request whose handler raised (the store down or locked: the only failures a page
    or an action meets that are not answered on the spot) with ``answer``'s response, if nothing
    of the response has been sent yet; logs nothing itself (``answer`` logs one line)."""

    def __init__(self, app: ASGIApp, answer: Callable[[Request, Exception], Awaitable[Response]]) -> None:
        self.app = app
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except (_BodyTooLarge, ClientDisconnect):
            raise  # BodyLimit's, outside: a 413, or no one left to answer
        except Exception as e:
            if started:  # too late to answer otherwise: the connection is cut, as before
                raise
            response = await self.answer(Request(scope, receive), e)
            await response(scope, receive, send)


class BodyLimit:
    """Refuses a request body larger than ``limit`` bytes (413), before the application reads it.

    Every handler that takes a form reads it before it can check who is asking (the form holds
    the CSRF token), so without this anyone who reaches the port could make the process hold as
    much as they send (300 fields of 1 MB: 300 MB, for a 403). A ``Content-Length`` over the limit
    is refused at once, unread; a body without one (chunked) is counted as it is read, and refused
    at the chunk that crosses the limit: the rest is never asked for (the server stops reading
    the socket once its small buffer is full, and closes the connection after the answer).

    It also keeps a client that goes away in the middle of its body out of the error log:
    Starlette raises ``ClientDisconnect`` from the form reader, which reached uvicorn as
    "Exception in ASGI application" with a traceback, for what is an ordinary event (a closed tab,
    a dropped connection). There is no one left to answer; it is logged at debug level."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope["headers"]:
            if key == b"content-length" and value.strip().isdigit() and int(value) > self.limit:
                await self._refuse(scope, receive, send)
                return
        read = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.limit:
                    raise _BodyTooLarge
            return message

        async def noting_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, noting_send)
        except _BodyTooLarge:
            if started:  # no handler here answers before reading its body; if one did, say so
                raise
            await self._refuse(scope, receive, send)
        except ClientDisconnect:
            log.debug(
                "dashboard: %s %s: the client left before its body was read",
                scope["method"],
                scope["path"][:200],
            )

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        text = f"refused: the request body is larger than {self.limit // 1024} KiB\n"
        # "Connection: close": the rest of the body is not read, so the connection cannot carry
        # another request.
        response = PlainTextResponse(text, status_code=413, headers={"Connection": "close"})
        await response(scope, receive, send)


async def read_form(request: Request) -> FormData:
    """The request's form, read within tight limits, or :class:`Refused`.

    Only ``application/x-www-form-urlencoded`` is read: every form of the dashboard is one (htmx
    sends them so too), and so is ``curl -d``. A multipart body (``curl -F``) is refused unread
    (415): its parser spools each file part to a temporary file on disk, which no form here has a
    use for, so accepting it would only be something to get wrong. Any other type reads as an
    empty form without its body being read (Starlette's rule), as a script's bare POST does.
    A form has at most ``FORM_MAX_FIELDS`` fields (400 beyond) and, with :class:`BodyLimit`, at
    most ``MAX_BODY`` bytes in all, which bounds each field too. Starlette holds urlencoded forms
    to ``max_fields`` only from 1.3.1 (before, it applied its limits to multipart forms alone:
    GHSA-82w8-qh3p-5jfq), which is why the extra requires it. No per-field limit
    (``max_part_size``) is passed: under ``MAX_BODY`` it would add nothing."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media.startswith("multipart/"):
        raise Refused(
            415, "refused: send the form as application/x-www-form-urlencoded (curl -d, not curl -F)"
        )
    try:
        return await request.form(max_files=0, max_fields=FORM_MAX_FIELDS)
    except HTTPException as e:  # what Starlette makes of a form over its limits
        raise Refused(400, f"refused: {e.detail}") from None


def _when(value: str | float | None) -> str:
    """An ISO time or epoch seconds as ``YYYY-MM-DD HH:MM:SS.mmm`` UTC."""
    if value is None:
        return "-"
    if isinstance(value, int | float):
        value = datetime.fromtimestamp(float(value), UTC).isoformat(timespec="milliseconds")
    return str(value).replace("T", " ").replace("+00:00", "").rstrip("Z")


def _until(iso: str | None, now: float) -> str:
    """How long until an ISO time (negative: how long ago)."""
    if iso is None:
        return ""
    t = datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    left = t - now
    return f"in {short_duration(left)}" if left >= 0 else f"{short_duration(-left)} ago"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def make_env() -> Environment:
    env = Environment(
        loader=PackageLoader("stepwarden.dashboard", "templates"),
        autoescape=True,  # every template is HTML: everything shown is escaped unless marked safe
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = _when
    env.filters["seconds"] = short_duration
    env.filters["pretty"] = _pretty
    env.globals["until"] = _until
    env.globals["TASK_STATES"] = TASK_STATES
    return env


class _Say(Protocol):
    """An answer to an action: :meth:`Dashboard.message` (a page) or :meth:`Dashboard._say` (a line)."""

    def __call__(self, request: Request, status: int, text: str, ok: bool = False) -> Response: ...


class Dashboard:
    def __init__(self, store: Store, guard: Guard, poll: float) -> None:
        self.store = store
        self.guard = guard
        self.poll = poll
        self.env = make_env()
        self.metrics = StoreMetrics(store)
        self._refreshed = 0.0
        self.actions: dict[tuple[str, str], int] = {}
        self.metrics.registry.register(_ActionCounts(self.actions))

    # -- rendering ---------------------------------------------------------------------------------
    def render(self, request: Request, template: str, status: int = 200, **ctx: Any) -> HTMLResponse:
        partial = request.query_params.get("partial") == "1"
        sid = self.guard.session_id(request)
        response = HTMLResponse("", status_code=status)
        if sid is None:
            sid = self.guard.ensure_session(request, response)
        query = [(k, v) for k, v in request.query_params.multi_items() if k != "partial"]
        ctx.update(
            request=request,
            path=request.url.path,
            csrf=self.guard.csrf_token(sid),
            actor=self.guard.actor(request),
            actions_enabled=self.guard.actions_enabled,
            poll=self.poll,
            partial_url=request.url.path + "?" + urlencode([*query, ("partial", "1")]),
            here=_page_of(request, query),
        )
        name = ("_" + template) if partial else template
        response.body = self.env.get_template(name).render(**ctx).encode()
        response.headers["content-length"] = str(len(response.body))
        return response

    def message(self, request: Request, status: int, text: str, ok: bool = False) -> HTMLResponse:
        if request.headers.get("hx-request") == "true":
            body = self.env.get_template("_flash.html").render(ok=ok, message=text)
            return HTMLResponse(body, status_code=status)
        return self.render(request, "message.html", status=status, ok=ok, message=text)

    async def refresh_metrics(self, max_age: float = 1.0) -> None:
        if time.monotonic() - self._refreshed >= max_age:
            await self.store.transact(self.metrics.refresh)
            self._refreshed = time.monotonic()

    # -- pages ---------------------------------------------------------------------------------------
    async def overview(self, request: Request) -> Response:
        await self.refresh_metrics()
        view = await self.store.transact(data.overview)
        series = self.metrics.tally.per_minute(view["now"])
        peak = max([n for _, n in series] + [1])
        recent = [n for _, n in series]
        return self.render(
            request,
            "overview.html",
            view=view,
            series=series,
            peak=peak,
            last_minute=recent[-2] if len(recent) > 1 else 0,
            per_minute=sum(recent[:-1]) / max(1, len(recent) - 1),
            totals=dict(self.metrics.tally.totals),
        )

    async def tasks(self, request: Request) -> Response:
        q = request.query_params
        state = q.get("state") or None
        query = (q.get("q") or "").strip() or None
        before = q.get("before") or None
        if state is not None and state not in TASK_STATES:
            return self.message(request, 400, f"unknown state; choose one of {', '.join(TASK_STATES)}")
        if query is not None and (len(query) > MAX_QUERY or not query.isprintable()):
            return self.message(request, 400, f"a search is 1-{MAX_QUERY} printable characters")
        if before is not None and not (before.isascii() and before.isdigit() and len(before) < 19):
            return self.message(request, 400, "before must be a task id")
        view = await self.store.transact(
            data.task_list, state, query, int(before) if before is not None else None
        )
        older = None
        if view["next_before"] is not None:
            params = [(k, v) for k, v in q.multi_items() if k not in ("before", "partial")]
            older = "/tasks?" + urlencode([*params, ("before", str(view["next_before"]))])
        return self.render(request, "tasks.html", view=view, state=state, query=query or "", older=older)

    async def task(self, request: Request) -> Response:
        task_id = int(request.path_params["task_id"])
        try:
            view = await self.store.transact(data.task_detail, task_id)
        except NotFound as e:
            return self.message(request, 404, str(e))
        return self.render(request, "task.html", task=view)

    async def alerts(self, request: Request) -> Response:
        unacked = request.query_params.get("unacked") == "1"
        view = await self.store.transact(data.alert_list, unacked)
        return self.render(request, "alerts.html", view=view, unacked_only=unacked)

    async def leases(self, request: Request) -> Response:
        view = await self.store.transact(data.lease_list)
        return self.render(request, "leases.html", view=view)

    async def workers(self, request: Request) -> Response:
        view = await self.store.transact(data.worker_list)
        return self.render(request, "workers.html", view=view)

    async def prometheus(self, request: Request) -> Response:
        await self.refresh_metrics(max_age=0.0)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # -- sign in and out -------------------------------------------------------------------------------
    async def login(self, request: Request) -> Response:
        try:
            form = await read_form(request)
            self.guard.check_form(request, form)
            if not self.guard.actions_enabled:
                raise Refused(403, "operator actions are disabled: no token is configured")
            actor = check_actor(str(form.get("name") or ""))
            # No pause after a wrong token: one taken by each request in parallel slowed nothing.
            # The guard checks only so many wrong tokens a second, over all clients (429 beyond).
            if not self.guard.token_ok(str(form.get("token") or ""), request):
                raise Refused(403, "refused: wrong token")
        except Refused as e:
            self._count("login", _result(e))
            return _retry_after(self.message(request, e.status, str(e)), e)
        self._count("login", "ok")
        response = RedirectResponse(safe_next(form.get("next")), status_code=303)
        self.guard.sign_in(response, actor)
        return response

    async def logout(self, request: Request) -> Response:
        try:
            form = await read_form(request)
            self.guard.check_form(request, form)
        except Refused as e:
            return self.message(request, e.status, str(e))
        response = RedirectResponse(safe_next(form.get("next")), status_code=303)
        self.guard.sign_out(response, request)
        return response

    # -- operator actions ---------------------------------------------------------------------------------
    async def _act(
        self, request: Request, name: str, run: Callable[[str, FormData], Awaitable[str]]
    ) -> Response:
        form: FormData | None = None  # None: refused before the form was read
        try:
            form = await read_form(request)
            actor = self.guard.check_action(request, form)
        except Refused as e:
            self._count(name, _result(e))
            if e.status != 429:  # the guard logs those once a minute, not once a request
                log.warning("dashboard: %s refused (%s)", name, e)
            return _retry_after(self._answer(request, form)(request, e.status, str(e)), e)
        say = self._answer(request, form)
        try:
            text = await run(actor, form)
        except NotFound as e:
            self._count(name, "not_found")
            return say(request, 404, str(e))
        except InputError as e:
            self._count(name, "invalid")
            return say(request, 409, str(e))
        self._count(name, "ok")
        log.info("dashboard: %s by %s: %s", name, actor, text)
        return say(request, 200, text, ok=True)

    def _answer(self, request: Request, form: FormData | None) -> _Say:
        """How to answer: a script (Bearer) reads one line of text, with the status; a browser
        reads a page."""
        return self._say if self.guard.is_script(request, form) else self.message

    @staticmethod
    def _say(request: Request, status: int, text: str, ok: bool = False) -> Response:
        headers = {"WWW-Authenticate": 'Bearer realm="stepwarden"'} if status == 401 else None
        return PlainTextResponse(text + "\n", status_code=status, headers=headers)

    def _count(self, action: str, result: str) -> None:
        key = (action, result)
        self.actions[key] = self.actions.get(key, 0) + 1

    async def retry(self, request: Request) -> Response:
        task_id = _path_id(request, "task_id")

        async def run(actor: str, form: FormData) -> str:
            _in_range(request, "task_id", "task")
            step = str(form.get("step") or "").strip() or None
            state = await self.store.transact(tr.retry_task, task_id, step, actor)
            return tr.describe_retry(task_id, state, step)

        return await self._act(request, "retry", run)

    async def cancel(self, request: Request) -> Response:
        task_id = _path_id(request, "task_id")

        async def run(actor: str, form: FormData) -> str:
            _in_range(request, "task_id", "task")
            state = await self.store.transact(tr.cancel_task, task_id, actor)
            return f"task {task_id}: cancel requested (now {state})"

        return await self._act(request, "cancel", run)

    async def ack(self, request: Request) -> Response:
        alert_id = _path_id(request, "alert_id")

        async def run(actor: str, form: FormData) -> str:
            _in_range(request, "alert_id", "alert")
            changed = await self.store.transact(data.ack_alert, alert_id, actor)
            return (
                f"alert {alert_id} acknowledged" if changed else f"alert {alert_id} was already acknowledged"
            )

        return await self._act(request, "ack", run)


def _result(refused: Refused) -> str:
    """The ``result`` label of a refused action: ``throttled`` when its token was not checked."""
    return "throttled" if refused.status == 429 else "refused"


def _retry_after(response: Response, refused: Refused) -> Response:
    if refused.retry_after is not None:
        response.headers["Retry-After"] = str(refused.retry_after)
    return response


def _page_of(request: Request, query: list[tuple[str, str]]) -> str:
    """Where signing in from this page goes back to. After an action (a POST) that is the page
    the action was on, not the action's own path, which answers only POST (a 405 after sign-in)."""
    path = request.url.path
    if request.method == "GET":
        return path + (("?" + urlencode(query)) if query else "")
    if path.startswith("/tasks/"):
        return path.rsplit("/", 1)[0]  # /tasks/7/retry -> /tasks/7
    if path.startswith("/alerts/"):
        return "/alerts"
    return "/"


class _RowId(Convertor[int]):
    """A row id in a path: 1 to 19 digits. Starlette's ``int`` took any length, and ``int()`` of
    more than 4,300 digits raises ValueError while routing: a 503 instead of a 404."""

    regex = "[0-9]{1,19}"

    def convert(self, value: str) -> int:
        return int(value)

    def to_string(self, value: int) -> str:
        return str(value)


register_url_convertor("rowid", _RowId())


def _path_id(request: Request, key: str) -> int:
    """A row id from the path; ids beyond what the store can hold become 0, which no row has."""
    value = int(request.path_params[key])
    return value if 0 < value < data.MAX_ID else 0


def _in_range(request: Request, key: str, what: str) -> None:
    """An action on an id beyond what the store can hold (the path's 0) names the id it was given:
    it said ``no task 0``. Checked inside the action, after its token: a refusal comes first."""
    if _path_id(request, key) == 0:
        raise NotFound(f"no {what} {request.path_params[key]}")


class _ActionCounts(Collector):
    """This dashboard process's own counter of operator actions, by result."""

    def __init__(self, counts: dict[tuple[str, str], int]) -> None:
        self.counts = counts

    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily(
            "stepwarden_dashboard_actions",
            "Operator actions asked of this dashboard process, by result.",
            labels=["action", "result"],
        )
        for (action, result), n in sorted(self.counts.items()):
            fam.add_metric([action, result], n)
        yield fam


def create_app(
    store: Store,
    token: str | None = None,
    *,
    allowed_hosts: Sequence[str] | None = None,
    poll: float = 2.0,
    secure_cookies: bool = False,
    public_origin: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
    max_body: int = MAX_BODY,
) -> Starlette:
    """The dashboard over ``store``. ``token`` enables operator actions (without surrounding
    whitespace; InputError for one that is blank or holds a space or control character inside:
    :mod:`.tokens`); ``allowed_hosts``, when given and not empty, is every host name the ``Host``
    header may hold besides IP addresses, which are always answered (:class:`HostCheck`; the
    command's list has ``localhost``, the public origin's host and ``--allowed-host`` names);
    ``public_origin`` is the origin browsers reach it at through a proxy (``https://...`` also
    marks cookies Secure); ``clock`` paces the checks of wrong tokens; ``max_body`` bounds a
    request body (:class:`BodyLimit`)."""
    secure = secure_cookies or (public_origin or "").lower().startswith("https://")
    guard = Guard(token, secure, public_origin, guesses=GuessLimiter(clock))
    d = Dashboard(store, guard, poll)
    routes = [
        Route("/", d.overview),
        Route("/tasks", d.tasks),
        Route("/tasks/{task_id:rowid}", d.task),
        Route("/tasks/{task_id:rowid}/retry", d.retry, methods=["POST"]),
        Route("/tasks/{task_id:rowid}/cancel", d.cancel, methods=["POST"]),
        Route("/alerts", d.alerts),
        Route("/alerts/{alert_id:rowid}/ack", d.ack, methods=["POST"]),
        Route("/leases", d.leases),
        Route("/workers", d.workers),
        Route("/metrics", d.prometheus),
        Route("/login", d.login, methods=["POST"]),
        Route("/logout", d.logout, methods=["POST"]),
        Mount("/static", StaticFiles(packages=[("stepwarden.dashboard", "static")]), name="static"),
    ]
    # In this order: every answer, refusals included, carries the security headers; a foreign
    # Host is refused before anything else; a body is bounded before any handler reads it.
    middleware = [Middleware(SecurityHeaders)]
    if allowed_hosts:
        middleware.append(Middleware(HostCheck, allowed=allowed_hosts))
    middleware.append(Middleware(BodyLimit, limit=max_body))

    async def failed(request: Request, exc: Exception) -> Response:
        log.warning("dashboard: %s %s failed: %r", request.method, request.url.path[:200], exc)
        text = f"the store could not be read or written ({type(exc).__name__}); retrying"
        if request.method == "POST" and d.guard.is_script(request, None):
            return d._say(request, 503, text)  # a script reads one line, as for every answer
        return d.message(request, 503, text)

    # Innermost, so that the answer goes out through the others (the security headers) and the
    # failure ends here: as an exception handler it ran in Starlette's ServerErrorMiddleware,
    # which re-raises, and uvicorn then logged a 64-line traceback per request while the store
    # was down, in plain text among the JSON log lines.
    middleware.append(Middleware(Failures, answer=failed))

    app = Starlette(routes=routes, middleware=middleware)
    app.state.dashboard = d
    return app
