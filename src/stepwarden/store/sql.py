"""Loading named SQL: ``-- name: x`` blocks in ``sql/<dialect>/queries.sql``, migrations beside them."""

from __future__ import annotations

import re
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.M)


def load_queries(dialect: str, now: str) -> dict[str, str]:
    """Parse the ``*.sql`` files of ``sql/common`` (the queries every dialect shares), then those of
    the dialect's folder, whose queries replace common ones of the same name (claims with SKIP
    LOCKED, row locks); ``{now}`` becomes the dialect's expression for the database clock."""
    out: dict[str, str] = {}
    for layer in ("common", dialect):
        seen: set[str] = set()
        folder = resources.files(__package__).joinpath("sql", layer)
        for entry in sorted(folder.iterdir(), key=lambda e: e.name):
            if not entry.name.endswith(".sql"):
                continue
            parts = _NAME.split(entry.read_text())
            for name, body in zip(parts[1::2], parts[2::2], strict=True):
                if name in seen:
                    raise ValueError(f"query {name!r} is defined twice in sql/{layer}/*.sql")
                seen.add(name)
                out[name] = body.strip().rstrip(";").replace("{now}", now)
    return out


def load_migrations(dialect: str) -> list[tuple[int, str, str]]:
    """``[(version, name, sql), ...]`` sorted by version, from files named ``NNNN_name.sql``."""
    folder = resources.files(__package__).joinpath("sql", dialect, "migrations")
    found = []
    for entry in folder.iterdir():
        m = re.match(r"^(\d{4})_(\w+)\.sql$", entry.name)
        if m:
            found.append((int(m.group(1)), m.group(2), entry.read_text()))
    return sorted(found)


def split_statements(script: str) -> list[str]:
    """Split a migration into statements (our migrations keep ';' out of literals)."""
    lines = [ln for ln in script.splitlines() if not ln.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def pending_migrations(
    dialect: str, current: int, target: int | None = None
) -> list[tuple[int, str, list[str]]]:
    """The migrations to apply to a store at version ``current`` (up to ``target``), as
    ``(version, name, statements)``; a store newer than this code is refused."""
    from ..errors import MigrationError

    known = load_migrations(dialect)
    if known and current > known[-1][0]:
        raise MigrationError(
            f"the store's schema is version {current}, newer than this stepwarden knows "
            f"({known[-1][0]}); upgrade stepwarden"
        )
    return [
        (version, name, split_statements(script))
        for version, name, script in known
        if version > current and (target is None or version <= target)
    ]
