"""A child process that ends with the process that started it: the demo's workers and services.

The demo stops what it started, by pid, on every way it can be stopped but one: SIGKILL, which
it cannot see. Its workers and services then ran on as children of init, polling its store and
listening on its port, until someone found them (found by review). A process started with
``STEPWARDEN_PARENT_PID`` asks Linux for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), and
stops as it would on an operator's SIGTERM: a worker hands its attempts back. Elsewhere, and for
a process started without the variable, nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_PID = "STEPWARDEN_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Call once the process's SIGTERM handler is in place: a parent already gone (it died
    between the fork and this call, when the kernel had no one to tell) is a SIGTERM now."""
    raw = os.environ.get(PARENT_PID, "")
    if not raw.isdigit() or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no prctl to call: as elsewhere
        return
    if os.getppid() != int(raw):
        os.kill(os.getpid(), signal.SIGTERM)
