"""Running the ``dashboard`` click command in-process: under a group with ``--db`` as the real CLI
has it, and with uvicorn's serving loop replaced by a record of what it was asked to serve."""

from __future__ import annotations

from typing import Any

import click
import pytest

from stepwarden.dashboard.command import dashboard


def group() -> click.Group:
    @click.group()
    @click.option("--db", envvar="STEPWARDEN_DB")
    @click.pass_context
    def cli(ctx: click.Context, db: str | None) -> None:
        ctx.ensure_object(dict)
        ctx.obj["db"] = db

    cli.add_command(dashboard)
    return cli


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
