"""``stepwarden [--db URL] dashboard [--host 127.0.0.1] [--port 8080] [--token TOKEN | --token-file PATH]``.

Only click is imported at module level, so the CLI loads without the ``dashboard`` extra and
this command can say what to install.
"""

from __future__ import annotations

import logging
import socket
import sys
from urllib.parse import urlsplit

import click

from ..cli_params import bracketed, is_loopback
from ..errors import InputError, StepwardenError
from ..store import open_existing
from .tokens import configured_token, read_token_file, weak_token_warning

log = logging.getLogger("stepwarden.dashboard")
# Host names a dashboard listening on a loopback address answers to (DNS-rebinding defence).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


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
    """A bound socket (port 0 picks a free one), so the real address can be printed before serving."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise click.ClickException(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror}") from None
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
    "sign-in and actions from it are accepted, and cookies are marked Secure.",
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
    poll: float,
) -> None:
    """Serve the web dashboard: tasks, timelines, alerts, leases, workers, metrics (OPS5, OPS6)."""
    token, warnings = resolve_token(ctx, token, token_file)
    try:
        import uvicorn

        from .web import create_app
    except ImportError as e:
        raise click.ClickException(
            f"the dashboard needs the extra: pip install 'stepwarden[dashboard]' (missing {e.name})"
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
        click.echo(f"warning: {line}", err=True)
    if not loopback:
        click.echo(
            f"warning: listening on {host}, beyond this machine; "
            + (
                "the token travels in clear unless a TLS proxy is in front (see --public-origin)"
                if token
                else "it is read-only"
            ),
            err=True,
        )
    bound = sock.getsockname()[1]
    shown = bracketed(host)
    # On a loopback address, the Host header must name a loopback host (DNS-rebinding defence):
    # the usual names, and the address it was told to listen on (127.0.0.2 is loopback too).
    hosts = (*LOOPBACK_HOSTS, host.strip("[]").lower()) if loopback else None
    app = create_app(store, token, allowed_hosts=hosts, poll=poll, public_origin=public_origin)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", server_header=False, proxy_headers=False
    )
    click.echo(
        f"dashboard on http://{shown}:{bound}/ ("
        + ("operator actions enabled" if token else "read-only: no --token")
        + ")",
        err=True,
    )
    sys.stderr.flush()
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
