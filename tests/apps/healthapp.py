"""The agent-health tests' application: one agent ``remote`` whose one operation calls a "service".

The service's health is read from the environment of each worker process, so a test can break one
instance's path or the service itself:

- ``HEALTHAPP_BROKEN=1``: this worker's calls fail with a connection error (its own network path
  is broken), while other workers' calls succeed.
- ``HEALTHAPP_DOWN_FILE=PATH``: while that file exists the service is down for every worker (the
  test creates and removes it to take the service down and bring it back).

Each call returns the pid of the worker that made it.
"""

from __future__ import annotations

import asyncio
import os

from stepwarden import App, Backoff, Request, Retry, Step

COOL_OFF = 1.5
THRESHOLD = 4


async def call(req: Request) -> dict[str, int]:
    if os.environ.get("HEALTHAPP_BROKEN") == "1":
        raise ConnectionError("no route to the service from this instance")
    flag = os.environ.get("HEALTHAPP_DOWN_FILE")
    if flag and os.path.exists(flag):
        raise ConnectionError("service unavailable")
    await asyncio.sleep(0.01)
    return {"pid": os.getpid()}


def make_app(db: str | None = None) -> App:
    app = App(db)
    remote = app.agent("remote", concurrency=4, breaker_threshold=THRESHOLD, breaker_cool_off=COOL_OFF)
    remote.operation(call)
    retry = Retry(
        max_failures=1000,
        backoff=Backoff(initial=0.1, maximum=0.5, jitter=0.1),
        tries=2,
        in_attempt=Backoff(initial=0.01, maximum=0.05),
    )
    app.workflow("call", [Step("call", "remote.call", complete_by=60.0, retry=retry)])
    return app


app = make_app()
