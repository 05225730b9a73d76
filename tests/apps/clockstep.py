"""The integration tests' application (:mod:`itapp`) on a host whose wall clock a test can step.

Importing it replaces ``time.time`` in this process with the real time plus an offset, read
(when the file changes) from the file named by ``STEPWARDEN_TEST_CLOCK_OFFSET``: a test that
writes ``120`` there steps every such process's wall clock two minutes forward at once, as an NTP
step or a resumed virtual machine does to a host. The monotonic clock is left alone, as a clock
step leaves it. On SQLite the database clock is the host's wall clock (``sw_now()``), so this
steps the store's clock too, for the processes that import this module.
"""

from __future__ import annotations

import os
import time

from itapp import app

__all__ = ["app"]

OFFSET_ENV = "STEPWARDEN_TEST_CLOCK_OFFSET"

_real_time = time.time
_path = os.environ.get(OFFSET_ENV)
_seen: tuple[int, float] = (-1, 0.0)  # the file's mtime (ns) when read, and its offset


def _offset() -> float:
    global _seen
    if not _path:
        return 0.0
    try:
        mtime = os.stat(_path).st_mtime_ns
    except OSError:
        return 0.0
    if mtime != _seen[0]:
        try:
            with open(_path) as f:
                _seen = (mtime, float(f.read().strip() or 0))
        except (OSError, ValueError):
            return _seen[1]  # written at this moment: the last offset until it is whole
    return _seen[1]


def _stepped_time() -> float:
    return _real_time() + _offset()


time.time = _stepped_time
