"""A bad argument to the public Python API is one InputError, raised where it is given.

``App(max_input_bytes="1M")``, ``app.agent(["x"])``, ``ack_alert(tx, 2**70, by)``,
``app.replies(q, batch=0)``, ``CircuitBreaker(threshold="x")``, ``Retry(escalation_wait=1e12)``:
each was accepted and failed later, deep inside (a TypeError comparing sizes, an unhashable list,
the driver's OverflowError, a ValueError, a breaker that never opens, a task parked for 31,000
years), or was no error at all. Now each is :class:`InputError` on one line, naming the argument,
what it must be, and the value given. The messages are asserted whole: they are the interface.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import stepwarden
from stepwarden import App, FakeClock, InputError, WorkerSettings
from stepwarden.agent import Agent, AgentSettings
from stepwarden.alerts import ack_alert
from stepwarden.policies import MAX_SECONDS, Backoff, CircuitBreaker, Retry
from stepwarden.replies import Replies
from stepwarden.store import Store
from stepwarden.store import transitions as t

BIG = 2**70  # over the stores' 64-bit integers: the driver's OverflowError before
UP_TO_CAP = "from 0 to 1000000000 (about 31 years)"
WHOLE_INT = "a whole number from 1 to 2147483647"
SECONDS_ABOVE_0 = "a finite number of seconds more than 0 and at most 1000000000 (about 31 years)"


def _app(**kw: Any) -> Callable[[], object]:
    return lambda: App(**kw)


def _breaker(**kw: Any) -> Callable[[], object]:
    return lambda: CircuitBreaker(**kw)


def _agent_settings(**kw: Any) -> Callable[[], object]:
    return lambda: AgentSettings(**kw)


def _raises(call: Callable[[], object], message: str) -> None:
    with pytest.raises(InputError) as err:
        call()
    assert str(err.value) == message


# -- App(...) ---------------------------------------------------------------------------------------

BYTES = "App.max_input_bytes must be a whole number of bytes from 1 to 1000000000, not "


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(_app(max_input_bytes="1M"), BYTES + "'1M'", id="bytes-text"),
        pytest.param(_app(max_input_bytes=-1), BYTES + "-1", id="bytes-negative"),
        pytest.param(_app(max_input_bytes=0), BYTES + "0", id="bytes-zero"),
        pytest.param(_app(max_input_bytes=True), BYTES + "True", id="bytes-bool"),
        pytest.param(_app(max_input_bytes=1.5), BYTES + "1.5", id="bytes-fraction"),
        pytest.param(_app(max_input_bytes=math.nan), BYTES + "nan", id="bytes-nan"),
        pytest.param(_app(max_input_bytes=math.inf), BYTES + "inf", id="bytes-inf"),
        pytest.param(_app(max_input_bytes=None), BYTES + "None", id="bytes-none"),
        pytest.param(_app(max_input_bytes=10**9 + 1), BYTES + "1000000001", id="bytes-over-the-stores"),
        pytest.param(_app(db=5), "App.db must be a store URL (text) or None, not 5", id="db-number"),
        pytest.param(
            _app(db=Path("x.db")),
            "App.db must be a store URL (text) or None, not PosixPath('x.db')",
            id="db-path",
        ),
        pytest.param(
            _app(clock=5),
            "App.clock must be a Clock (with wall(), monotonic() and async sleep()), not 5",
            id="clock-number",
        ),
    ],
)
def test_app_refuses_bad_arguments_when_it_is_made(call: Callable[[], object], message: str) -> None:
    """Before: all accepted; max_input_bytes="1M" then failed every submission with a TypeError
    ('>' between int and str), 0 or -1 refused every input as too large, nan let every input
    through, and db=5 failed at the first use of the store."""
    _raises(call, message)


def test_app_keeps_the_arguments_it_took_before() -> None:
    assert App(max_input_bytes=1024).max_input_bytes == 1024
    million: Any = 1e6  # a whole float, as a configuration file may give it
    assert App(max_input_bytes=million).max_input_bytes == 1_000_000
    assert App(max_input_bytes=10**9).max_input_bytes == 10**9
    assert App("sqlite:///x.db", clock=FakeClock()).url == "sqlite:///x.db"


# -- names that cannot be looked up -------------------------------------------------------------------


def test_an_agent_or_workflow_name_of_the_wrong_type_is_bad_input() -> None:
    """Before: ``app.agent(["x"])`` and ``app.workflow(["x"], ...)`` raised TypeError: unhashable
    type: 'list', from the lookup of an existing definition, before any check of the name."""
    app = App()
    _raises(
        lambda: app.agent(["x"]),  # type: ignore[arg-type]
        "invalid agent name ['x']: use 1-64 letters, digits, '_' or '-', not starting with a digit",
    )
    _raises(
        lambda: app.workflow({"x"}, []),  # type: ignore[arg-type]
        "invalid workflow name {'x'}: use 1-128 letters, digits, '_', '.', ':' or '-', starting with a"
        " letter or digit",
    )
    assert app.agents == {} and app.workflows == {}
    app.agent("x")
    _raises(lambda: app.agent("x"), "agent 'x' is already defined")  # still said for a taken name


# -- ids out of the stores' range --------------------------------------------------------------------

ALERT_ID = "alert id must be a positive integer (at most 2**63-1), not "


@pytest.mark.parametrize(
    ("alert_id", "shown"),
    [(BIG, str(BIG)), (2**63, str(2**63)), (0, "0"), (-3, "-3"), (True, "True"), ("1", "'1'"), (1.0, "1.0")],
)
def test_acknowledging_an_alert_id_the_store_cannot_hold_is_bad_input(
    store: Store, alert_id: Any, shown: str
) -> None:
    """As ``stepwarden alerts ack`` says for such an id. Before: 2**70 raised the driver's
    OverflowError; True and "1" acknowledged alert 1 on SQLite (which takes either for 1);
    0 and -3 were NotFound."""
    store.transact_sync(t.alert, "task_error", None, "charge", "boom")
    _raises(lambda: store.transact_sync(ack_alert, alert_id, "alice"), ALERT_ID + shown)
    assert store.transact_sync(lambda tx: tx.sql("SELECT acked_at FROM alerts"))[0]["acked_at"] is None
    app = App()
    app.use_store(store)
    _raises(lambda: app.ack_alert(alert_id), ALERT_ID + shown)


def test_app_ack_alert_checks_its_arguments_before_opening_the_store(tmp_path: Path) -> None:
    """A bad id or name writes nothing, not even a new store file."""
    app = App(f"sqlite:///{tmp_path / 'none.db'}")
    _raises(lambda: app.ack_alert(BIG), ALERT_ID + str(BIG))
    _raises(
        lambda: app.ack_alert(1, by=""), "invalid acknowledged-by name '': use 1-255 printable characters"
    )
    assert list(tmp_path.iterdir()) == []


# -- reply queues --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"batch": 0}, f"batch must be {WHOLE_INT}, not 0"),
        ({"batch": -5}, f"batch must be {WHOLE_INT}, not -5"),
        ({"batch": "10"}, f"batch must be {WHOLE_INT}, not '10'"),
        ({"batch": 2.5}, f"batch must be {WHOLE_INT}, not 2.5"),
        ({"batch": BIG}, f"batch must be {WHOLE_INT}, not {BIG}"),
        ({"stop": 5}, "stop must be an asyncio.Event or None, not 5"),
        ({"stop": True}, "stop must be an asyncio.Event or None, not True"),
    ],
)
def test_replies_refuses_bad_arguments_when_it_is_made(
    store: Store, kw: dict[str, Any], message: str
) -> None:
    """Before: batch=0 raised a plain ValueError, "10" a TypeError, 2**70 the driver's
    OverflowError at the first read, and stop=5 an AttributeError at the first message."""
    app = App()
    app.use_store(store)
    _raises(lambda: app.replies("web-1", "c", **kw), message)


@pytest.mark.parametrize("name", ["poll_interval", "idle_poll_max"])
@pytest.mark.parametrize("bad", [0, -1, math.nan, "0.1", MAX_SECONDS + 1])
def test_replies_refuses_polling_that_cannot_work(store: Store, name: str, bad: object) -> None:
    shown = repr(bad)
    kw: dict[str, Any] = {name: bad}
    _raises(
        lambda: Replies(store, "web-1", **kw),
        f"{name} must be {SECONDS_ABOVE_0}, not {shown}",
    )


def test_replies_takes_what_it_took_before(store: Store) -> None:
    async def body() -> None:
        r = Replies(store, "web-1", "c", batch=1, stop=asyncio.Event(), listen=False, poll_interval=0.005)
        assert r.batch == 1
        assert Replies(store, "web-1", batch=500.0).batch == 500  # type: ignore[arg-type]  # a whole float

    asyncio.run(body())


# -- CircuitBreaker --------------------------------------------------------------------------------------

THRESHOLD = f"CircuitBreaker.threshold must be {WHOLE_INT}, not "
COOL_OFF = f"CircuitBreaker.cool_off must be a finite number of seconds {UP_TO_CAP}, not "


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(_breaker(threshold="x"), THRESHOLD + "'x'", id="threshold-text"),
        pytest.param(_breaker(threshold=0), THRESHOLD + "0", id="threshold-zero"),
        pytest.param(_breaker(threshold=-2), THRESHOLD + "-2", id="threshold-negative"),
        pytest.param(_breaker(threshold=True), THRESHOLD + "True", id="threshold-bool"),
        pytest.param(_breaker(threshold=2.5), THRESHOLD + "2.5", id="threshold-fraction"),
        pytest.param(_breaker(threshold=math.nan), THRESHOLD + "nan", id="threshold-nan"),
        pytest.param(_breaker(cool_off=-1), COOL_OFF + "-1", id="cool-off-negative"),
        pytest.param(_breaker(cool_off=math.nan), COOL_OFF + "nan", id="cool-off-nan"),
        pytest.param(_breaker(cool_off=math.inf), COOL_OFF + "inf", id="cool-off-inf"),
        pytest.param(_breaker(cool_off="5"), COOL_OFF + "'5'", id="cool-off-text"),
        pytest.param(_breaker(cool_off=False), COOL_OFF + "False", id="cool-off-bool"),
        pytest.param(_breaker(cool_off=1e12), COOL_OFF + "1000000000000.0", id="cool-off-absurd"),
        pytest.param(
            _breaker(state="opne"),
            "CircuitBreaker.state must be one of ('closed', 'open', 'half_open'), not 'opne'",
            id="state-typo",
        ),
        pytest.param(
            _breaker(failures=-1),
            "CircuitBreaker.failures must be a whole number from 0 to 2147483647, not -1",
            id="failures-negative",
        ),
        pytest.param(
            _breaker(opened_at=math.nan),
            "CircuitBreaker.opened_at must be a finite number (a time in seconds), not nan",
            id="opened-at-nan",
        ),
    ],
)
def test_circuit_breaker_refuses_bad_settings(call: Callable[[], object], message: str) -> None:
    """Before: no check at all. threshold="x" raised a TypeError at the first failure; nan
    cool_off left an opened breaker open for ever (nothing is >= nan), a negative one never
    rejected a call; threshold=0 opened at the first failure."""
    _raises(call, message)


def test_circuit_breaker_keeps_its_behaviour_for_good_settings() -> None:
    cb = CircuitBreaker(threshold=2.0, cool_off=10)  # type: ignore[arg-type]
    assert cb.threshold == 2 and isinstance(cb.threshold, int)
    assert not cb.record_failure(100.0) and cb.record_failure(101.0)
    assert cb.rejecting(105.0) and cb.allow(111.0)
    assert CircuitBreaker(cool_off=0).allow(0.0)
    assert CircuitBreaker(cool_off=MAX_SECONDS).cool_off == MAX_SECONDS


# -- durations: finite, and at most 10**9 s (about 31 years) -------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            lambda: Retry(escalation_wait=1e12),
            f"Retry.escalation_wait must be a finite number of seconds {UP_TO_CAP}, not 1000000000000.0"
            " (to wait for an operator, use escalation='error')",
            id="retry-escalation-wait",
        ),
        pytest.param(
            lambda: Retry(escalation_wait=MAX_SECONDS + 1),
            f"Retry.escalation_wait must be a finite number of seconds {UP_TO_CAP}, not 1000000001"
            " (to wait for an operator, use escalation='error')",
            id="retry-escalation-wait-just-over",
        ),
        pytest.param(
            lambda: Backoff(maximum=1e12),
            f"invalid back-off: Backoff.maximum must be a finite number of seconds {UP_TO_CAP},"
            " not 1000000000000.0",
            id="backoff-maximum",
        ),
        pytest.param(
            lambda: Backoff(initial=1e300),
            f"invalid back-off: Backoff.initial must be a finite number of seconds {UP_TO_CAP}, not 1e+300",
            id="backoff-initial",
        ),
        pytest.param(
            lambda: Agent("inventory", breaker_cool_off=1e12),
            f"agent 'inventory': breaker_cool_off must be a finite number of seconds {UP_TO_CAP},"
            " not 1000000000000.0",
            id="agent-cool-off",
        ),
        pytest.param(
            lambda: Retry(max_failures=BIG),
            f"Retry.max_failures must be {WHOLE_INT}, not {BIG}",
            id="retry-failures-over-the-columns",
        ),
        pytest.param(
            lambda: Retry(tries=2**31), f"Retry.tries must be {WHOLE_INT}, not {2**31}", id="retry-tries"
        ),
    ],
)
def test_absurd_durations_and_counts_are_refused(call: Callable[[], object], message: str) -> None:
    """Before: accepted. A step escalated with Retry(escalation_wait=1e12) was parked for 31,000
    years, stuck in all but name (REL1), with a run_at past the year 9999 that no view of it can
    show as a date (ValueError: year 33715 is out of range)."""
    _raises(call, message)


def test_durations_up_to_the_cap_are_taken() -> None:
    assert Retry(escalation_wait=MAX_SECONDS).escalation_wait == MAX_SECONDS
    assert Backoff(initial=MAX_SECONDS, maximum=MAX_SECONDS).delay(3) == MAX_SECONDS
    assert Agent("inventory", breaker_cool_off=MAX_SECONDS).breaker_cool_off == MAX_SECONDS
    assert Backoff(multiplier=1e6).multiplier == 1e6  # a factor, not a duration: no cap (delay caps it)


def test_a_stored_policy_over_the_cap_takes_the_default(caplog: pytest.LogCaptureFixture) -> None:
    """A policy an older version stored is read back, not refused: the refused value takes its
    default with a warning, as for the values refused before (nan, 1.5 failures)."""
    with caplog.at_level(logging.WARNING, logger="stepwarden.policies"):
        r = Retry.from_dict({"escalation_wait": 1e12, "max_failures": 5})
    assert r.escalation_wait == Retry().escalation_wait and r.max_failures == 5
    assert "Retry.escalation_wait" in caplog.text


# -- AgentSettings --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            _agent_settings(reply_linger="x"),
            "AgentSettings.reply_linger must be between 0 and 1 s, not 'x'",
            id="linger-text",
        ),
        pytest.param(
            _agent_settings(poll_interval=0),
            f"AgentSettings.poll_interval must be {SECONDS_ABOVE_0}, not 0",
            id="poll-zero",
        ),
        pytest.param(
            _agent_settings(idle_poll_max="1"),
            f"AgentSettings.idle_poll_max must be {SECONDS_ABOVE_0}, not '1'",
            id="idle-text",
        ),
        pytest.param(
            _agent_settings(report_timeout=math.nan),
            f"AgentSettings.report_timeout must be {SECONDS_ABOVE_0}, not nan",
            id="report-nan",
        ),
        pytest.param(
            _agent_settings(shutdown_grace=-1),
            f"AgentSettings.shutdown_grace must be a finite number of seconds {UP_TO_CAP}, not -1",
            id="grace-negative",
        ),
        pytest.param(
            _agent_settings(unhealthy_after=0),
            f"AgentSettings.unhealthy_after must be {WHOLE_INT}, not 0",
            id="unhealthy-zero",
        ),
    ],
)
def test_agent_settings_refuse_bad_values(call: Callable[[], object], message: str) -> None:
    """Before: only reply_linger was checked, and "x" there raised a TypeError; a poll_interval of
    0 made an idle agent poll without pause, nan timeouts never timed out."""
    _raises(call, message)


def test_agent_settings_keep_their_defaults_and_zero_where_it_means_something() -> None:
    three: Any = 3.0
    s = AgentSettings(shutdown_grace=0, success_every=0, reply_linger=0, unhealthy_after=three)
    assert s.unhealthy_after == 3 and s.stop_within == AgentSettings().stop_within - 5.0


# -- run_while_leader and worker ---------------------------------------------------------------------------


async def _work(leadership: object) -> None:
    return None


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"holder": ""}, "invalid lease holder '': use 1-255 printable characters"),
        ({"holder": 7}, "invalid lease holder 7: use 1-255 printable characters"),
        ({"work": None}, "work must be an async function of the Leadership, not None"),
        ({"stop": 5}, "stop must be an asyncio.Event, not 5"),
        ({"settings": {"ttl": 5}}, "settings must be LeaseSettings or None, not {'ttl': 5}"),
    ],
)
def test_run_while_leader_checks_its_arguments_before_campaigning(
    tmp_path: Path, kw: dict[str, Any], message: str
) -> None:
    """Before: a bad work, stop or settings failed inside the lease loop (an AttributeError from
    stop=5 or settings={}, a TypeError calling work=None once elected), and a holder of 7 was
    written as the lease's holder. Nothing is opened or written: not even the store's file."""
    app = App(f"sqlite:///{tmp_path / 'none.db'}")

    async def call() -> None:
        args: dict[str, Any] = {"work": _work, "stop": asyncio.Event(), **kw}
        await app.run_while_leader("jobs", args.pop("work"), args.pop("stop"), **args)

    _raises(lambda: asyncio.run(call()), message)
    assert list(tmp_path.iterdir()) == []


NAME_RULE = "use 1-128 letters, digits, '_', '.', ':' or '-', starting with a letter or digit"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"name": ""}, f"invalid lease name '': {NAME_RULE}"),
        ({"name": 5}, f"invalid lease name 5: {NAME_RULE}"),
        ({"holder": None}, "invalid lease holder None: use 1-255 printable characters"),
        ({"holder": 12}, "invalid lease holder 12: use 1-255 printable characters"),
        ({"work": 5}, "work must be an async function of the Leadership, not 5"),
        ({"stop": None}, "stop must be an asyncio.Event, not None"),
        ({"settings": {"ttl": 1}}, "settings must be LeaseSettings or None, not {'ttl': 1}"),
        ({"store": "sqlite:///x.db"}, "store must be a stepwarden Store (App.store), not 'sqlite:///x.db'"),
    ],
)
def test_the_public_run_while_leader_checks_its_arguments_before_campaigning(
    tmp_path: Path, kw: dict[str, Any], message: str
) -> None:
    """``stepwarden.run_while_leader`` (in ``__all__``) checked nothing: a name of '' or 5 was
    written as a lease, a holder of None campaigned forever logging a "store" failure (NOT
    NULL), and work=5, stop=None or settings={} failed inside the lease loop. Now each is one
    InputError and no lease is written."""
    app = App(f"sqlite:///{tmp_path / 'store.db'}")
    try:
        args: dict[str, Any] = {
            "store": app.store,
            "name": "jobs",
            "holder": "me",
            "work": _work,
            "stop": asyncio.Event(),
            **kw,
        }

        async def call() -> None:
            await stepwarden.run_while_leader(
                args.pop("store"),
                args.pop("name"),
                args.pop("holder"),
                args.pop("work"),
                args.pop("stop"),
                **args,
            )

        _raises(lambda: asyncio.run(call()), message)
        written = app.store.transact_sync(lambda tx: tx.sql("SELECT COUNT(*) AS n FROM lease_terms"))
        assert written[0]["n"] == 0
    finally:
        app.close()


def test_worker_refuses_settings_of_the_wrong_type_or_given_twice() -> None:
    """Before: settings=5 failed inside Worker with an AttributeError, and keyword arguments next
    to settings were silently dropped."""
    app = App()
    _raises(lambda: app.worker(5), "settings must be WorkerSettings or None, not 5")  # type: ignore[arg-type]
    _raises(
        lambda: app.worker(WorkerSettings(), roles=("agent",)),
        "give settings or keyword arguments (roles), not both",
    )
    assert app.worker(roles=("scheduler",)).settings.roles == ("scheduler",)
