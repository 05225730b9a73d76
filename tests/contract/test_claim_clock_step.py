"""A step of the database's clock back (an NTP step, a resumed virtual machine on the database's
host), on both stores, with the fake clock (``set_wall`` moves the database's clock only).

The supervisor's side of a step (live workers taken for dead after a step forward) is in
``tests/unit/test_clock_step_judges.py``; the multi-process runs in ``tests/integration``.
"""

from __future__ import annotations

from test_store import claim, submit

from stepwarden.clock import FakeClock
from stepwarden.store import Store
from stepwarden.workflow import Step, Workflow


def test_tasks_ready_before_the_clock_steps_back_are_claimed_at_once(store: Store, clock: FakeClock) -> None:
    """A task's run_at is when it became ready; after a step back it lies in the future, and the
    claim (``run_at <= now``) left every task submitted before the step unclaimed for as long as
    the step: an hour's correction, an hour of nothing done. A ready task is claimable whatever
    the clock says; a task waiting out a back-off still waits for its time
    (``test_claim_waiting.py``), longer by the step (guarantees.md, "Time and clocks")."""
    wf = Workflow.of("wf", [Step("s", "svc.do_s", complete_by=10.0)])
    ids = [submit(store, wf, {"n": i}) for i in range(3)]
    clock.set_wall(clock.wall() - 3600.0)  # the database's clock steps back an hour
    assert claim(store, 10) == 3
    requests = store.transact_sync(lambda tx: tx.sql("SELECT task_id FROM requests ORDER BY task_id"))
    assert [r["task_id"] for r in requests] == ids
