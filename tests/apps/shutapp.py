"""The shutdown tests' application: itapp's agents and workflows, plus two-step workflows whose
first step blocks (``it.block``, or the plain function ``it.block_sync`` in ``two-long-sync``: its
input's ``sleep`` says for how long).

A worker stopped gracefully while the first step runs lets that step finish within its grace
period; the second step is then dispatched by a worker that is leaving. In ``two-long`` both
complete-by budgets are long (60 s), so that a test which had to wait one out (a rescue, a
failure counted) would time out instead of passing late; ``two-short`` gives the second step a
short one, for a restart that comes after it has passed. ``max_failures=1``: one failure counted
ends the task in ``error``, as the routine restart of a worker must never do.

Workers load it as ``--app shutapp:app`` with ``tests/apps`` on ``PYTHONPATH`` (as ``itapp``).
"""

from __future__ import annotations

from itapp import _retry
from itapp import make_app as make_itapp

from stepwarden import App, Step

# Long enough that waiting for it would time the test out, so a test passes only if the worker's
# attempts were handed back.
BUDGET = 60.0
SHORT_BUDGET = 2.0


def make_app(db: str | None = None) -> App:
    app = make_itapp(db)
    app.workflow(
        "two-long",
        [
            Step("first", "it.block", complete_by=BUDGET, retry=_retry(max_failures=1)),
            Step("second", "it.quick", complete_by=BUDGET, retry=_retry(max_failures=1)),
        ],
    )
    # The same with a plain function, which cannot be cancelled: its thread runs on, unanswered.
    app.workflow(
        "two-long-sync",
        [
            Step("first", "it.block_sync", complete_by=BUDGET, retry=_retry(max_failures=1)),
            Step("second", "it.quick", complete_by=BUDGET, retry=_retry(max_failures=1)),
        ],
    )
    # An async operation blocked in asyncio.to_thread: its thread runs on, as a plain function's.
    app.workflow(
        "two-long-thread",
        [
            Step("first", "it.block_in_thread", complete_by=BUDGET, retry=_retry(max_failures=1)),
            Step("second", "it.quick", complete_by=BUDGET, retry=_retry(max_failures=1)),
        ],
    )
    app.workflow(
        "two-short",
        [
            Step("first", "it.block", complete_by=BUDGET, retry=_retry(max_failures=1)),
            Step("second", "it.quick", complete_by=SHORT_BUDGET, retry=_retry(max_failures=1)),
        ],
    )
    return app


app = make_app()
