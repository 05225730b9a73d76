"""``stepwarden.parent.die_with_parent``: a child the demo started stops with it. The kernel is
asked for SIGTERM when the parent dies; a parent already gone by then (it died between the fork
and the call) is a SIGTERM at once. Each case runs in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = """
import os, signal, sys
got = []
signal.signal(signal.SIGTERM, lambda *a: got.append("SIGTERM"))
from stepwarden.parent import die_with_parent
die_with_parent()
print(",".join(got) or "nothing")
"""


def run(parent_pid: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "STEPWARDEN_PARENT_PID"}
    if parent_pid is not None:
        env["STEPWARDEN_PARENT_PID"] = parent_pid
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_parent_already_gone_is_a_sigterm_at_once() -> None:
    assert run("1") == "SIGTERM"  # the parent is this test, not pid 1: as if it had died


def test_without_the_variable_or_with_the_living_parent_nothing_happens() -> None:
    assert run(None) == "nothing"
    assert run("") == "nothing"
    assert run("not-a-pid") == "nothing"
    assert run(str(os.getpid())) == "nothing"  # the child's parent is this process
