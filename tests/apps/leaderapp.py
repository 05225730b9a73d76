"""An application coroutine that runs only while its process holds a named lease (LEAD7):
``python leaderapp.py NAME OUTFILE`` (store from ``STEPWARDEN_DB``).

While it leads it appends ``{"event": "start" | "beat" | "stop", "holder", "term", "at"}`` lines to
OUTFILE (``at``: wall clock), a beat every 50 ms. Lease timings come from ``LEADER_TTL``,
``LEADER_RENEW`` and ``LEADER_RETRY`` (seconds). Runs until SIGTERM, which resigns the lease.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

from stepwarden import App, Leadership, LeaseSettings
from stepwarden.worker import make_identity

LEASE = "nightly-report"


async def main(name: str, path: str) -> None:
    app = App()
    ttl = float(os.environ.get("LEADER_TTL", "2"))
    settings = LeaseSettings(
        ttl=ttl,
        renew_every=float(os.environ.get("LEADER_RENEW", "0.5")),
        retry_every=float(os.environ.get("LEADER_RETRY", "0.5")),
        margin=ttl / 4,
    )
    holder = make_identity(name)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(event: str, lead: Leadership) -> None:
        line = {"event": event, "holder": lead.holder, "term": lead.term, "at": time.time()}
        os.write(fd, (json.dumps(line) + "\n").encode())

    async def report(lead: Leadership) -> None:  # the application's own work
        note("start", lead)
        try:
            while True:
                note("beat", lead)
                lead.progress()
                await asyncio.sleep(0.05)
        finally:
            note("stop", lead)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(holder, flush=True)
    try:
        await app.run_while_leader(LEASE, report, stop, holder=holder, settings=settings)
    finally:
        os.close(fd)
        app.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
