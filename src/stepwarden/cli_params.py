"""Parameter types of the command line, kept apart so ``cli.py`` holds only the commands."""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteRange(click.FloatRange):
    """A ``FloatRange`` that also refuses ``nan`` and infinities: ``nan`` compares false with every
    bound, so a plain range lets it through to code that then never times out or never prunes."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        out = super().convert(value, param, ctx)
        if not math.isfinite(out):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return out
