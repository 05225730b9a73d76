"""What the command line's modules share: parameter types, opening the store, printing JSON, ids.

Kept apart so ``cli.py`` and ``cli_views.py`` hold only their commands."""

from __future__ import annotations

import ipaddress
import json
import math
from typing import TYPE_CHECKING, Any, NoReturn

import click

from .errors import InputError
from .store import Store, open_existing, open_store, resolve_url

if TYPE_CHECKING:
    from .app import App

TABLE_ROWS = 100  # the tasks (or alerts) a table shows without --limit


def fail(message: str) -> NoReturn:
    """An operational failure (exit 1): one line, no traceback."""
    raise click.ClickException(message)


def store_url(ctx: click.Context, app: App | None = None) -> str:
    """The command's store (DEP5): ``--db`` on the command line, else the URL of the ``--app``
    application if it was made with one (``App("sqlite:///shop.db")``), else ``STEPWARDEN_DB``,
    else ``sqlite:///stepwarden.db``. The app's URL comes before the variable and the default as
    it does in the app itself (``App(db)`` opens ``db`` whatever the variable says), so that a
    worker started with ``--app`` runs the tasks the application's ``app.submit`` writes: before,
    it ran on the variable's store, or on a new ``stepwarden.db`` in its folder, and they never ran."""
    if app is not None and app.db and not ctx.obj.get("db_given"):
        return app.db
    return ctx.obj["db"] or resolve_url(None)


def open_for(
    ctx: click.Context, *, create: bool = False, app: App | None = None, beside: bool = False
) -> Store:
    """Open the command's store (:func:`store_url`); read and operator commands refuse to create
    one by accident. Closed when the command ends. ``beside``: see :func:`open_store`."""
    url = store_url(ctx, app)
    store = open_store(url, beside=beside) if create else open_existing(url)
    ctx.call_on_close(store.close)
    return store


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, an IPv6 one perhaps in brackets) is this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bracketed(host: str) -> str:
    """A host as it goes before ``:PORT`` in a URL or a message: an IPv6 address in brackets."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


class ReaderGone(Exception):
    """Standard output's reader went away before the command had printed everything (``| head``,
    ``| true``: EPIPE). Not an ``OSError``, which click would turn into exit 1 with nothing said:
    :func:`stepwarden.cli.run` ends the command quietly, exit 0 (docs/cli.md says why)."""


def echo(text: Any) -> None:
    """``click.echo`` to standard output, its reader gone raised as :class:`ReaderGone`. Every
    command prints its results through this (or :func:`print_json`, or ``cli_render``'s console)."""
    try:
        click.echo(text)
    except BrokenPipeError:
        raise ReaderGone from None


def print_json(value: Any) -> None:
    echo(json.dumps(value, indent=2, default=str))


def positive_id(kind: str, value: str) -> int:
    """A task's or an alert's id as typed: digits only, at most 18 of them, at least 1."""
    if not (value.isascii() and value.isdigit()) or len(value) > 18 or int(value) < 1:
        raise InputError(f"invalid {kind} {value[:40]!r}: expected a positive integer of at most 18 digits")
    return int(value)


class FiniteRange(click.FloatRange):
    """A ``FloatRange`` that also refuses ``nan`` and infinities: ``nan`` compares false with every
    bound, so a plain range lets it through to code that then never times out or never prunes."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        out = super().convert(value, param, ctx)
        if not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return out


def missing_what(e: ImportError) -> str:
    """What an optional extra's import lacked, for its one error line: the module, or the error
    itself when the module is there but failed (its name would mislead, or there is none)."""
    return f"missing {e.name}" if e.name and isinstance(e, ModuleNotFoundError) else str(e)[:200]
