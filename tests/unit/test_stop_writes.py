"""The stop's writes share one verdict on the store (DEP4, REL3): the full wait while it answers,
a brief try once one of them (or a heartbeat, a round, a lease renewal) found it not answering,
and the full wait again as soon as one goes through."""

from __future__ import annotations

import asyncio
import time

import pytest

from stepwarden.stop_writes import StopWrites


async def never() -> None:
    await asyncio.Event().wait()


async def refused() -> None:
    raise ConnectionError("connection refused")


async def answered() -> str:
    return "written"


def timed(writes: StopWrites, aw: object) -> tuple[object, float]:
    """What ``writes.write(aw)`` returned or raised, and how long it took."""

    async def go() -> object:
        try:
            return await writes.write(aw)  # type: ignore[arg-type]
        except Exception as e:
            return e

    began = time.monotonic()
    out = asyncio.run(go())
    return out, time.monotonic() - began


def test_a_write_to_a_store_that_does_not_answer_waits_the_full_bound_then_later_ones_a_brief_try() -> None:
    writes = StopWrites(full=0.6, brief=0.05)
    out, took = timed(writes, never())
    assert isinstance(out, TimeoutError) and 0.6 <= took < 3
    assert not writes.answering and writes.bound == 0.05
    out, took = timed(writes, never())
    assert isinstance(out, TimeoutError) and took < 0.5
    assert writes.missed == 2  # for the worker's last line


def test_an_error_counts_as_not_answering_and_is_raised_as_it_came() -> None:
    writes = StopWrites(full=5, brief=0.05)
    out, _ = timed(writes, refused())
    assert isinstance(out, ConnectionError) and str(out) == "connection refused"
    assert writes.bound == 0.05


def test_a_brief_try_that_goes_through_gives_the_next_write_the_full_wait_again() -> None:
    writes = StopWrites(full=5, brief=0.5)
    writes.failed()  # the last heartbeat failed
    out, _ = timed(writes, answered())
    assert out == "written"
    assert writes.answering and writes.bound == 5
    assert writes.missed == 0


@pytest.mark.parametrize("seen", ["answered", "failed"])
def test_what_others_saw_of_the_store_sets_the_next_bound(seen: str) -> None:
    writes = StopWrites(full=5, brief=1)
    getattr(writes, seen)()
    assert writes.bound == (5 if seen == "answered" else 1)
