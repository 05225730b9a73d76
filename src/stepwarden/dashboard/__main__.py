"""``python -m stepwarden.dashboard [--db URL] dashboard [OPTIONS]``: the dashboard command on its
own, with the same ``--db`` as ``stepwarden``."""

from __future__ import annotations

import logging
import sys

import click

from .command import dashboard


@click.group()
@click.option("--db", envvar="STEPWARDEN_DB", metavar="URL", help="Store URL (default: $STEPWARDEN_DB).")
@click.pass_context
def cli(ctx: click.Context, db: str | None) -> None:
    ctx.ensure_object(dict)
    ctx.obj["db"] = db
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


cli.add_command(dashboard)

if __name__ == "__main__":
    from ..cli import run

    run(cli, None, "python -m stepwarden.dashboard")
