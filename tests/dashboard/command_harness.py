"""Running the ``dashboard`` click command in-process: under a group with ``--db`` as the real CLI
has it, in an environment of the test's own, and with uvicorn's serving loop replaced by a record
of what it was asked to serve."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result

from stepwarden.dashboard.command import dashboard
from stepwarden.store import open_store


def group() -> click.Group:
    @click.group()
    @click.option("--db", envvar="STEPWARDEN_DB")
    @click.pass_context
    def cli(ctx: click.Context, db: str | None) -> None:
        ctx.ensure_object(dict)
        ctx.obj["db"] = db

    cli.add_command(dashboard)
    return cli


def command_env(env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """``env`` and no other ``STEPWARDEN_*`` variable (CliRunner unsets those mapped to None): an
    ambient ``STEPWARDEN_DB``, ``STEPWARDEN_DASHBOARD_TOKEN`` or ``..._TOKEN_FILE`` in the shell that
    runs the tests would otherwise pick the store or the token, or stop the command at start."""
    ambient: dict[str, str | None] = {k: None for k in os.environ if k.startswith("STEPWARDEN_")}
    return {**ambient, **(env or {})}


def db_url(tmp_path: Path) -> str:
    """The store :func:`invoke_dashboard` serves."""
    return f"sqlite:///{tmp_path / 'x.db'}"


def invoke_dashboard(
    tmp_path: Path, *args: str, env: Mapping[str, str] | None = None, db_from_env: bool = False
) -> Result:
    """``--db sqlite:///TMP/x.db dashboard --port 0 ARGS`` in process, in :func:`command_env`
    (``env`` added), on a store made if it is not there yet; ``db_from_env``: the URL is given as
    ``STEPWARDEN_DB`` instead of ``--db``. ``--port 0``: a command that gets as far as serving
    binds a free port (and serves nothing, under :func:`record_serving`)."""
    url = db_url(tmp_path)
    if not (tmp_path / "x.db").exists():
        open_store(url).close()
    db = {"STEPWARDEN_DB": url} if db_from_env else {}
    argv = [*([] if db_from_env else ["--db", url]), "dashboard", "--port", "0", *args]
    return CliRunner().invoke(group(), argv, env=command_env({**db, **(env or {})}))


def record_serving(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each serve as ``{app, config, sockets, name}`` (``config``: uvicorn's; ``name``: the bound
    socket's address)."""
    import uvicorn

    calls: list[dict[str, Any]] = []

    def run(self: Any, sockets: Any = None) -> None:
        calls.append(
            {
                "app": self.config.app,
                "config": self.config,
                "sockets": sockets,
                "name": sockets[0].getsockname(),
            }
        )

    monkeypatch.setattr(uvicorn.Server, "run", run)
    return calls
