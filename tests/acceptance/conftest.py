"""Fixtures of the acceptance tests: a store file per test, and processes ended by pid."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import SW, Db, Procs, make_db


@pytest.fixture(scope="session", autouse=True)
def _console_script() -> None:
    assert SW.exists(), f"the stepwarden console script is not installed next to the interpreter: {SW}"


@pytest.fixture
def db(tmp_path: Path) -> Db:
    """A fresh store that knows the demo's workflow (registered as a worker would), with no task yet."""
    return make_db(tmp_path)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()
