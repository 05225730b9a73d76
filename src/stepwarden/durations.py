"""How long, for an operator to read: the CLI's tables and the dashboard say it the same way."""

from __future__ import annotations


def short(value: float | None) -> str:
    """``4.2s``, ``3.5m``, ``26.0h``; ``-`` for nothing, a sign for a negative."""
    if value is None:
        return "-"
    v = float(value)
    sign = "-" if v < 0 else ""
    v = abs(v)
    if v < 60:
        return f"{sign}{v:.1f}s"
    if v < 3600:
        return f"{sign}{v / 60:.1f}m"
    return f"{sign}{v / 3600:.1f}h"
