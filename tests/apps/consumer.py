"""A reply-queue consumer for the integration tests: ``python consumer.py QUEUE CONSUMER OUTFILE``.

Reads the queue with a durable cursor (store from ``STEPWARDEN_DB``) and appends one JSON line per
message to OUTFILE (one ``write`` each, so a SIGKILL never leaves half a line), then dawdles a
little before asking for the next message, which is when the previous one is acknowledged: a kill
in between leaves that message unacknowledged. Runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys

from stepwarden import App


async def main(queue: str, consumer: str, path: str) -> None:
    app = App()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    rng = random.Random()
    try:
        async with app.replies(queue, consumer, stop=stop) as replies:
            async for msg in replies:
                line = {
                    "pid": os.getpid(),
                    "seq": msg.seq,
                    "id": msg.id,
                    "task_id": msg.task_id,
                    "correlation_id": msg.correlation_id,
                    "kind": msg.kind,
                    "step": msg.step,
                }
                os.write(fd, (json.dumps(line) + "\n").encode())
                await asyncio.sleep(rng.uniform(0.002, 0.02))
    finally:
        os.close(fd)
        app.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
