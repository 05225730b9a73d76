"""Suite-wide hooks: in CI (STEPWARDEN_NO_SKIPS=1) a skipped test fails the run."""

from __future__ import annotations

import os

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not os.environ.get("STEPWARDEN_NO_SKIPS"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if skipped:
        if reporter is not None:
            reporter.write_line(f"STEPWARDEN_NO_SKIPS: {skipped} test(s) skipped; failing the run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
