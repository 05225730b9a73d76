"""A do-nothing application for measuring stepwarden's own overhead."""

from __future__ import annotations

from typing import Any

from stepwarden import App, Request, Step

app = App()
noop = app.agent("noop", concurrency=32)


@noop.operation
async def run(req: Request) -> Any:
    return None


app.workflow("one", [Step("a", "noop.run", complete_by=30)])
app.workflow("three", [Step(n, "noop.run", complete_by=30) for n in ("a", "b", "c")])
