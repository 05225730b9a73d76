"""``stepwarden [--db URL] dashboard [--host 127.0.0.1] [--port 8080] [--token TOKEN | --token-file PATH]
[--public-origin URL] [--allowed-host NAME]... [--limit-concurrency 100] [--poll 2]``.

Only click is imported at module level, so the CLI loads without the ``dashboard`` extra and
this command can say what to install.
"""

from __future__ import annotations

import errno
import logging
import re
import socket
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

import click

from ..cli_params import bracketed, is_loopback, missing_what
from ..errors import InputError, StepwardenError
from ..logs import said
from ..store import open_existing
from .hosts import LOOPBACK_NAMES, ip_literal
from .tokens import configured_token, read_token_file, weak_token_warning

log = logging.getLogger("stepwarden.dashboard")
# One label of a host name (RFC 1123, and "_" as some internal names have): inner hyphens only.
_HOST_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)", re.IGNORECASE)
# Connections open at once (uvicorn's limit_concurrency; a request arriving beyond it hears 503).
# uvicorn counts every open connection, not only those with a request in progress: an idle
# keep-alive one until TIMEOUT_KEEP_ALIVE closes it, and one that has sent nothing (or sends its
# headers or body slowly) for as long as its client keeps it open, since uvicorn has no timeout
# for those. On loopback only local processes can hold slots so; beyond it, a reverse proxy
# (nginx's client_header_timeout and client_body_timeout) is what bounds slow or silent clients.
# Pages answer in milliseconds and each open tab polls one fragment at a time: 100 is many operators.
LIMIT_CONCURRENCY = 100
# Seconds an idle keep-alive connection is kept after its last answer (uvicorn's default, stated),
# holding a slot meanwhile: a tab polling every --poll seconds (at most 60) reconnects when it must.
TIMEOUT_KEEP_ALIVE = 5


def check_public_origin(value: str) -> str:
    """``scheme://host[:port]`` and nothing else, as browsers send it in ``Origin``."""
    parts = urlsplit(value.strip())
    bare = parts.path in ("", "/") and not parts.query and not parts.fragment
    if parts.scheme not in ("http", "https") or not parts.netloc or not bare:
        raise click.BadParameter(
            f"{value[:80]!r} is not an origin such as https://ops.example.com (scheme and host, no path)",
            param_hint="--public-origin",
        )
    return f"{parts.scheme}://{parts.netloc}".lower()


def check_allowed_hosts(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> tuple[str, ...]:
    """``--allowed-host`` values: host names as a ``Host`` header names them, without scheme or
    port, passed on as given (:class:`~.web.HostCheck` compares them without case or a final dot).
    Anything else exits 2 in one line, since a mistyped name would otherwise refuse every request
    that uses the real one. An IP address is refused too, rather than accepted to do nothing: a
    ``Host`` that is an address is always answered (rebinding needs a DNS name), so an operator
    who listed one would believe it decides something, and perhaps that other addresses are
    refused."""
    for value in values:
        name = value.strip().removesuffix(".")
        if ip_literal(name):
            raise click.BadParameter(
                f"{value[:80]!r} is an IP address, which the Host check always answers (DNS rebinding"
                " needs a name): give the host names browsers use; if they use addresses only,"
                " --allowed-host localhost turns the check on",
                ctx=ctx,
                param=param,
            )
        if len(name) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in name.split(".")):
            raise click.BadParameter(
                f"{value[:80]!r} is not a host name or an IP address; give a host name such as"
                " ops.example.com, with no scheme, port or brackets",
                ctx=ctx,
                param=param,
            )
    return tuple(values)


def host_allowlist(
    host: str, public_origin: str | None, allowed: Sequence[str], *, loopback: bool
) -> tuple[str, ...] | None:
    """Every name the ``Host`` header may hold (DNS-rebinding defence), or None for any. Names
    only: a ``Host`` that is an IP address is always answered (:mod:`.hosts`).

    The names: ``localhost``, ``host`` (the address listened on) when it is a name, the public
    origin's host (a proxy that passes the browser's ``Host`` on sends it) and ``allowed``. On a
    loopback address the check is always on. Beyond loopback it is on once the operator has said
    which names browsers use (``--public-origin`` or ``--allowed-host``); with neither, any name
    is answered, as before this option existed, so that an upgrade does not break a deployment
    reached by names nobody listed, and the command warns at start."""
    if not loopback and public_origin is None and not allowed:
        return None
    public_host = urlsplit(public_origin).hostname if public_origin else None
    names = (*LOOPBACK_NAMES, host, *([public_host] if public_host else []), *allowed)
    return tuple(dict.fromkeys(n for n in names if not ip_literal(n)))


def check_token(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The ``--token`` option's (or the environment's) value by the rule of :mod:`.tokens`: without
    surrounding whitespace (a value read from a file ends in a newline), None when empty; one error
    line, before anything else, for a token that could never be presented as configured."""
    try:
        return configured_token(value)
    except ValueError as e:
        source = ctx.get_parameter_source(param.name or "")
        hint = "STEPWARDEN_DASHBOARD_TOKEN" if source == click.core.ParameterSource.ENVIRONMENT else None
        raise click.BadParameter(str(e), ctx=ctx, param=param, param_hint=hint) from None


def resolve_token(
    ctx: click.Context, token: str | None, token_file: str | None
) -> tuple[str | None, list[str]]:
    """The one operator token from ``--token``/``STEPWARDEN_DASHBOARD_TOKEN`` or ``--token-file``/
    ``STEPWARDEN_DASHBOARD_TOKEN_FILE``, and warnings to print. Both at once is refused rather than
    one silently winning: an operator who rotated the file would keep the old token."""
    warnings: list[str] = []
    if token_file:  # an empty value (the variable set to "") names no file
        if token is not None:
            raise click.UsageError(
                "give the operator token once: --token (or STEPWARDEN_DASHBOARD_TOKEN) or --token-file"
                " (or STEPWARDEN_DASHBOARD_TOKEN_FILE), not both",
                ctx=ctx,
            )
        try:
            token, warnings = read_token_file(token_file)
        except InputError as e:
            raise click.BadParameter(str(e), ctx=ctx, param_hint="'--token-file'") from None
    weak = weak_token_warning(token)
    return token, [*warnings, *([weak] if weak else [])]


def bind(host: str, port: int) -> socket.socket:
    """A bound socket (port 0 picks a free one), so the real address can be printed before serving.

    A host that does not resolve, or is not an address of this machine, is the operator's input:
    exit 2, as for ``worker --metrics-host``. A port that is taken, or a name server that does not
    answer, is this machine's state: exit 1."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        why = f"cannot resolve --host {host!r}: {e.strerror}"
        if e.errno == socket.EAI_AGAIN:
            raise click.ClickException(why) from None
        raise click.UsageError(why) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = f"cannot listen on {host}:{port}: {e.strerror}"
        if e.errno == errno.EADDRNOTAVAIL:
            raise click.UsageError(f"{why}; give an address of this machine (--host)") from None
        raise click.ClickException(why) from None
    sock.set_inheritable(True)
    return sock


@click.command("dashboard")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="0: any free port."
)
@click.option(
    "--token",
    envvar="STEPWARDEN_DASHBOARD_TOKEN",
    default=None,
    callback=check_token,
    help="Operator token enabling retry, cancel and acknowledge (default: $STEPWARDEN_DASHBOARD_TOKEN; "
    "without one the dashboard is read-only). Prefer the environment variable: a command line is visible.",
)
@click.option(
    "--token-file",
    envvar="STEPWARDEN_DASHBOARD_TOKEN_FILE",
    default=None,
    metavar="PATH",
    help="Read the operator token from this file (a Docker or systemd secret; mode 600), instead of --token.",
)
@click.option(
    "--public-origin",
    default=None,
    metavar="URL",
    help="The origin browsers reach the dashboard at through a TLS proxy (https://ops.example.com): "
    "sign-in and actions from it are accepted, its host is an allowed Host, and cookies are marked Secure.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    callback=check_allowed_hosts,
    help="A host name browsers (or a proxy) use to reach the dashboard, allowed in the Host header "
    "besides localhost and --public-origin's host (repeatable); an IP address in Host is always "
    "answered, so one is refused here. Beyond loopback, naming one turns the Host check on: a "
    "DNS-rebinding page cannot read the dashboard.",
)
@click.option(
    "--limit-concurrency",
    type=click.IntRange(2, 100_000),  # uvicorn counts the request's own connection: 1 refuses all
    default=LIMIT_CONCURRENCY,
    show_default=True,
    help="Connections open at once, idle and silent ones included; a request beyond it hears 503.",
)
@click.option(
    "--poll",
    type=click.FloatRange(0.5, 60),
    default=2.0,
    show_default=True,
    help="Seconds between live refreshes.",
)
@click.pass_context
def dashboard(
    ctx: click.Context,
    host: str,
    port: int,
    token: str | None,
    token_file: str | None,
    public_origin: str | None,
    allowed_hosts: tuple[str, ...],
    limit_concurrency: int,
    poll: float,
) -> None:
    """Serve the web dashboard: tasks, timelines, alerts, leases, workers, metrics (OPS5, OPS6)."""
    token, warnings = resolve_token(ctx, token, token_file)
    try:
        import uvicorn

        from .web import create_app
    except ImportError as e:
        raise click.ClickException(
            f"the dashboard needs the extra: pip install 'stepwarden[dashboard]' ({missing_what(e)})"
        ) from None
    try:
        store = open_existing((ctx.obj or {}).get("db"))
    except InputError as e:  # exit 2 and exit 1 as under `stepwarden`, also for `-m stepwarden.dashboard`
        raise click.UsageError(str(e)) from None
    except StepwardenError as e:
        raise click.ClickException(str(e)) from None
    ctx.call_on_close(store.close)
    if public_origin is not None:
        public_origin = check_public_origin(public_origin)
    loopback = is_loopback(host)
    sock = bind(host, port)  # a host or port that cannot work is one error line, with no warning first
    for line in warnings:
        click.echo(said(line, "warning"), err=True)
    if not loopback:
        click.echo(
            said(
                f"listening on {host}, beyond this machine; "
                + (
                    "the token travels in clear unless a TLS proxy is in front (see --public-origin)"
                    if token
                    else "it is read-only"
                ),
                "warning",
            ),
            err=True,
        )
    hosts = host_allowlist(host, public_origin, allowed_hosts, loopback=loopback)
    if hosts is None:
        click.echo(
            said(
                f"any Host header is answered on {host}: a web page that rebinds its DNS name to"
                " this address can read every page; name the hosts browsers use with --allowed-host"
                " NAME (or --public-origin)",
                "warning",
            ),
            err=True,
        )
    bound = sock.getsockname()[1]
    shown = bracketed(host)
    app = create_app(store, token, allowed_hosts=hosts, poll=poll, public_origin=public_origin)
    config = uvicorn.Config(
        app,
        # uvicorn's own loggers through the process's logging (--log-format json included): its
        # default configuration gave them text handlers of their own, plain lines among the JSON.
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        server_header=False,
        proxy_headers=False,
        limit_concurrency=limit_concurrency,
        timeout_keep_alive=TIMEOUT_KEEP_ALIVE,
    )
    click.echo(
        said(
            f"dashboard on http://{shown}:{bound}/ ("
            + ("operator actions enabled" if token else "read-only: no --token")
            + ")"
        ),
        err=True,
    )
    sys.stderr.flush()
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
