"""The settings of a worker's parts, and the alert sinks, refuse a bad value where it is given.

``LeaseSettings``, ``WorkerSettings``, ``SchedulerSettings``, ``SupervisorSettings``,
``AlertSettings`` and the sinks (``WebhookSink``, ``CallableSink``, ``LogSink``, an application's
own object) each raised a plain ValueError or a TypeError ("x" compared with a number), or took
nonsense without a word (``batch=0``, ``interval=0``, nan and inf timeouts, ``max_attempts=1.5``,
``roles="scheduler"`` read as the roles 's', 'c', 'h', ...). Now each is one
:class:`InputError` line naming the setting, what it must be and the value given, as in
``test_api_arguments.py``. The messages are asserted whole: they are the interface.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import pytest

from stepwarden import App, InputError, WorkerSettings
from stepwarden.alerts import Alert, AlertSettings, CallableSink, LogSink, WebhookSink
from stepwarden.leader import LeaseSettings
from stepwarden.policies import MAX_SECONDS, Backoff
from stepwarden.scheduler import SchedulerSettings
from stepwarden.supervisor import SupervisorSettings

BIG = 2**70
UP_TO_CAP = "from 0 to 1000000000 (about 31 years)"
SECONDS_ABOVE_0 = "a finite number of seconds more than 0 and at most 1000000000 (about 31 years)"
WHOLE_INT = "a whole number from 1 to 2147483647"
URL = "https://hooks.example.com/stepwarden"
CLI_RETENTION = 36500 * 86400.0  # `stepwarden worker --retention DAYS` takes up to 36500 days


def _raises(call: Callable[[], object], message: str) -> None:
    with pytest.raises(InputError) as err:
        call()
    assert str(err.value) == message


def _make(cls: Callable[..., object], **kw: Any) -> Callable[[], object]:
    return lambda: cls(**kw)


def _case(cls: Callable[..., object], kw: dict[str, Any], message: str, id: str) -> Any:
    return pytest.param(_make(cls, **kw), message, id=id)


async def _page(alert: Alert) -> None:
    return None


# -- LeaseSettings ----------------------------------------------------------------------------------

LEASE_TAKE = (
    f"LeaseSettings.take_from_dead must be {SECONDS_ABOVE_0}, not {{}} (or None, to wait for the lease"
    " to expire)"
)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        _case(
            LeaseSettings, {"ttl": "x"}, f"LeaseSettings.ttl must be {SECONDS_ABOVE_0}, not 'x'", "ttl-text"
        ),
        _case(
            LeaseSettings,
            {"ttl": 1e12},
            f"LeaseSettings.ttl must be {SECONDS_ABOVE_0}, not 1000000000000.0",
            "ttl-absurd",
        ),
        _case(
            LeaseSettings,
            {"renew_every": math.nan},
            f"LeaseSettings.renew_every must be {SECONDS_ABOVE_0}, not nan",
            "renew-nan",
        ),
        _case(
            LeaseSettings,
            {"retry_every": 0},
            f"LeaseSettings.retry_every must be {SECONDS_ABOVE_0}, not 0",
            "retry-zero",
        ),
        _case(
            LeaseSettings,
            {"retry_every": "1"},
            f"LeaseSettings.retry_every must be {SECONDS_ABOVE_0}, not '1'",
            "retry-text",
        ),
        _case(
            LeaseSettings,
            {"stall_after": math.inf},
            f"LeaseSettings.stall_after must be {SECONDS_ABOVE_0}, not inf",
            "stall-inf",
        ),
        _case(
            LeaseSettings,
            {"stall_after": True},
            f"LeaseSettings.stall_after must be {SECONDS_ABOVE_0}, not True",
            "stall-bool",
        ),
        _case(
            LeaseSettings,
            {"margin": -1},
            f"LeaseSettings.margin must be {SECONDS_ABOVE_0}, not -1",
            "margin-negative",
        ),
        _case(
            LeaseSettings,
            {"ttl": 5, "margin": 5},
            "LeaseSettings.margin must be below ttl (5), not 5",
            "margin-not-below-ttl",
        ),
        _case(
            LeaseSettings,
            {"ttl": 5, "margin": 1, "renew_every": 4},
            "LeaseSettings.renew_every must be below ttl - margin (4), not 4",
            "renew-not-below-trust",
        ),
        _case(LeaseSettings, {"take_from_dead": -1}, LEASE_TAKE.format("-1"), "take-negative"),
        _case(LeaseSettings, {"take_from_dead": 0}, LEASE_TAKE.format("0"), "take-zero"),
        _case(LeaseSettings, {"take_from_dead": "3"}, LEASE_TAKE.format("'3'"), "take-text"),
        _case(LeaseSettings, {"take_from_dead": math.nan}, LEASE_TAKE.format("nan"), "take-nan"),
    ],
)
def test_lease_settings_refuse_bad_values(call: Callable[[], object], message: str) -> None:
    """Before: a plain ValueError for the relations and zero; "x" a TypeError ('<' between int and
    str); no upper bound; take_from_dead=-1 accepted, which took every lease from its live holder
    at the next campaign (every holder has been silent for more than -1 s)."""
    _raises(call, message)


def test_lease_settings_keep_what_they_took_before() -> None:
    s = LeaseSettings(ttl=3.0, renew_every=0.2, margin=0.5, retry_every=0.2, stall_after=1.2)
    assert (s.ttl, s.renew_every, s.margin) == (3.0, 0.2, 0.5)
    assert LeaseSettings(take_from_dead=3.0).take_from_dead == 3.0
    assert LeaseSettings(take_from_dead=None).take_from_dead is None
    assert LeaseSettings(ttl=MAX_SECONDS, stall_after=MAX_SECONDS).ttl == MAX_SECONDS
    with pytest.raises(ValueError, match="margin"):  # still a ValueError, as InputError is one
        LeaseSettings(ttl=5, margin=5)


# -- WorkerSettings ---------------------------------------------------------------------------------

CONCURRENCY = "WorkerSettings.concurrency must be a whole number from 1 to 10000, not "
HEARTBEAT = f"WorkerSettings.heartbeat must be {SECONDS_ABOVE_0}, not "


@pytest.mark.parametrize(
    ("call", "message"),
    [
        _case(
            WorkerSettings,
            {"roles": "scheduler"},
            "WorkerSettings.roles must be a sequence of role names, not the text 'scheduler': write"
            " ('scheduler',), as --roles reads it (worker.parse_list)",
            "roles-one-name-as-text",
        ),
        _case(
            WorkerSettings,
            {"roles": "scheduler, agent"},
            "WorkerSettings.roles must be a sequence of role names, not the text 'scheduler, agent': write"
            " ('scheduler', 'agent'), as --roles reads it (worker.parse_list)",
            "roles-comma-text",
        ),
        _case(
            WorkerSettings,
            {"roles": ""},
            "WorkerSettings.roles must be a sequence of role names, not the text ''",
            "roles-empty-text",
        ),
        _case(
            WorkerSettings,
            {"agents": "billing"},
            "WorkerSettings.agents must be a sequence of agent names, not the text 'billing': write"
            " ('billing',), as --agents reads it (worker.parse_list)",
            "agents-text",
        ),
        _case(
            WorkerSettings,
            {"roles": 5},
            "WorkerSettings.roles must be a sequence of role names (text), not 5",
            "roles-number",
        ),
        _case(
            WorkerSettings,
            {"roles": None},
            "WorkerSettings.roles must be a sequence of role names (text), not None",
            "roles-none",
        ),
        _case(
            WorkerSettings,
            {"agents": [["billing"]]},
            "WorkerSettings.agents must be a sequence of agent names (text), not [['billing']]",
            "agents-unhashable",
        ),
        _case(
            WorkerSettings,
            {"agents": ("billing", 7)},
            "WorkerSettings.agents must be a sequence of agent names (text), not ('billing', 7)",
            "agents-number-inside",
        ),
        _case(WorkerSettings, {"concurrency": "x"}, CONCURRENCY + "'x'", "concurrency-text"),
        _case(WorkerSettings, {"concurrency": 1.5}, CONCURRENCY + "1.5", "concurrency-fraction"),
        _case(WorkerSettings, {"concurrency": 0}, CONCURRENCY + "0", "concurrency-zero"),
        _case(WorkerSettings, {"concurrency": 10_001}, CONCURRENCY + "10001", "concurrency-over"),
        _case(WorkerSettings, {"concurrency": True}, CONCURRENCY + "True", "concurrency-bool"),
        _case(WorkerSettings, {"heartbeat": "x"}, HEARTBEAT + "'x'", "heartbeat-text"),
        _case(WorkerSettings, {"heartbeat": math.nan}, HEARTBEAT + "nan", "heartbeat-nan"),
        _case(WorkerSettings, {"heartbeat": 0}, HEARTBEAT + "0", "heartbeat-zero"),
        _case(
            WorkerSettings,
            {"heartbeat": 2},
            "WorkerSettings.heartbeat must be at most half the supervisor's dead_after (3.0 s), not 2",
            "heartbeat-over-half-dead-after",
        ),
        _case(
            WorkerSettings,
            {"supervisor": {"dead_after": 5}},
            "WorkerSettings.supervisor must be SupervisorSettings, not {'dead_after': 5}",
            "supervisor-dict",
        ),
        _case(
            WorkerSettings, {"lease": 5}, "WorkerSettings.lease must be LeaseSettings, not 5", "lease-number"
        ),
        _case(
            WorkerSettings,
            {"alerts": None},
            "WorkerSettings.alerts must be AlertSettings, not None",
            "alerts-none",
        ),
        _case(
            WorkerSettings,
            {"scheduler": SchedulerSettings},
            "WorkerSettings.scheduler must be SchedulerSettings, not <class"
            " 'stepwarden.scheduler.SchedulerSettings'>",
            "scheduler-the-class-not-an-instance",
        ),
        _case(
            WorkerSettings,
            {"agent": "x"},
            "WorkerSettings.agent must be AgentSettings, not 'x'",
            "agent-text",
        ),
    ],
)
def test_worker_settings_refuse_bad_values(call: Callable[[], object], message: str) -> None:
    """Before: roles="scheduler" said "unknown role(s) 's', 'c', 'h', ..."; agents="billing" was
    the agents 'b', 'i', 'l', ...; concurrency "x" and heartbeat "x" raised TypeError, 1.5 was
    taken as a concurrency, and supervisor={...} an AttributeError."""
    _raises(call, message)


def test_worker_settings_keep_what_they_took_before() -> None:
    three: Any = 3.0  # a whole float, as a configuration file may give it
    listed: Any = ["scheduler", "agent", "scheduler"]  # a list, as a configuration file gives it
    s = WorkerSettings(roles=listed, agents=("b", "a", "b"), concurrency=three)
    assert s.roles == ("scheduler", "agent") and s.agents == ("b", "a")
    assert s.concurrency == 3 and isinstance(s.concurrency, int)
    assert WorkerSettings(concurrency=10_000).concurrency == 10_000
    assert App().worker(roles=("scheduler",)).settings.roles == ("scheduler",)
    _raises(
        lambda: WorkerSettings(roles=("scheduler", "schedular")),
        "unknown role(s) 'schedular': choose from scheduler, agent, supervisor",
    )
    _raises(
        lambda: WorkerSettings(roles=("scheduler", "supervisor"), agents=("billing",)),
        "--agents billing needs the agent role: add agent to --roles (scheduler,supervisor), or leave"
        " --agents out",
    )


def test_dead_after_is_at_least_twice_the_heartbeat_as_the_cli_says() -> None:
    """``stepwarden worker --dead-after`` is "at least 2": twice its 1 s heartbeat, the rule the
    library checks for any heartbeat."""
    assert WorkerSettings(supervisor=SupervisorSettings(dead_after=2.0)).supervisor.dead_after == 2.0
    _raises(
        lambda: WorkerSettings(supervisor=SupervisorSettings(dead_after=1.9)),
        "WorkerSettings.heartbeat must be at most half the supervisor's dead_after (1.9 s), not 1.0",
    )
    quick = WorkerSettings(heartbeat=0.25, supervisor=SupervisorSettings(dead_after=0.5))
    assert quick.supervisor.dead_after == 0.5


# -- SchedulerSettings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        _case(
            SchedulerSettings,
            {"batch": 0},
            f"SchedulerSettings.batch must be {WHOLE_INT}, not 0",
            "batch-zero",
        ),
        _case(
            SchedulerSettings,
            {"batch": "50"},
            f"SchedulerSettings.batch must be {WHOLE_INT}, not '50'",
            "batch-text",
        ),
        _case(
            SchedulerSettings,
            {"batch": 2.5},
            f"SchedulerSettings.batch must be {WHOLE_INT}, not 2.5",
            "batch-fraction",
        ),
        _case(
            SchedulerSettings,
            {"batch": BIG},
            f"SchedulerSettings.batch must be {WHOLE_INT}, not {BIG}",
            "batch-big",
        ),
        _case(
            SchedulerSettings,
            {"poll_interval": 0},
            f"SchedulerSettings.poll_interval must be {SECONDS_ABOVE_0}, not 0",
            "poll-zero",
        ),
        _case(
            SchedulerSettings,
            {"poll_interval": "x"},
            f"SchedulerSettings.poll_interval must be {SECONDS_ABOVE_0}, not 'x'",
            "poll-text",
        ),
        _case(
            SchedulerSettings,
            {"idle_poll_max": math.nan},
            f"SchedulerSettings.idle_poll_max must be {SECONDS_ABOVE_0}, not nan",
            "idle-nan",
        ),
        _case(
            SchedulerSettings,
            {"gather": -1},
            f"SchedulerSettings.gather must be a finite number of seconds {UP_TO_CAP}, not -1",
            "gather-negative",
        ),
        _case(
            SchedulerSettings,
            {"gather": math.inf},
            f"SchedulerSettings.gather must be a finite number of seconds {UP_TO_CAP}, not inf",
            "gather-inf",
        ),
    ],
)
def test_scheduler_settings_refuse_bad_values(call: Callable[[], object], message: str) -> None:
    """Before: no check. batch=0 claimed nothing, ever; poll_interval=0 had an idle scheduler
    poll the store without pause; "x" failed in the role's loop, long after the worker started."""
    _raises(call, message)


def test_scheduler_settings_keep_what_they_took_before() -> None:
    fifty: Any = 50.0
    s = SchedulerSettings(batch=fifty, gather=0, poll_interval=1.0, idle_poll_max=1.0)
    assert s.batch == 50 and isinstance(s.batch, int) and s.gather == 0


# -- SupervisorSettings -----------------------------------------------------------------------------

RETENTION = (
    "SupervisorSettings.retention must be a finite number of seconds more than 0 and at most 3153600000,"
    " not {} (36500 days; None keeps every finished task)"
)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        _case(
            SupervisorSettings,
            {"interval": "x"},
            f"SupervisorSettings.interval must be {SECONDS_ABOVE_0}, not 'x'",
            "interval-text",
        ),
        _case(
            SupervisorSettings,
            {"interval": 0},
            f"SupervisorSettings.interval must be {SECONDS_ABOVE_0}, not 0",
            "interval-zero",
        ),
        _case(
            SupervisorSettings,
            {"batch": 0},
            f"SupervisorSettings.batch must be {WHOLE_INT}, not 0",
            "batch-zero",
        ),
        _case(
            SupervisorSettings,
            {"dead_after": 0},
            f"SupervisorSettings.dead_after must be {SECONDS_ABOVE_0}, not 0",
            "dead-after-zero",
        ),
        _case(
            SupervisorSettings,
            {"dead_after": math.nan},
            f"SupervisorSettings.dead_after must be {SECONDS_ABOVE_0}, not nan",
            "dead-after-nan",
        ),
        _case(SupervisorSettings, {"retention": 0}, RETENTION.format("0"), "retention-zero"),
        _case(SupervisorSettings, {"retention": -1}, RETENTION.format("-1"), "retention-negative"),
        _case(SupervisorSettings, {"retention": math.inf}, RETENTION.format("inf"), "retention-inf"),
        _case(SupervisorSettings, {"retention": "7d"}, RETENTION.format("'7d'"), "retention-text"),
        _case(
            SupervisorSettings,
            {"retention": CLI_RETENTION + 1},
            RETENTION.format("3153600001.0"),
            "retention-over-100-years",
        ),
        _case(
            SupervisorSettings,
            {"prune_every": -1},
            f"SupervisorSettings.prune_every must be a finite number of seconds {UP_TO_CAP}, not -1"
            " (0: at every sweep)",
            "prune-every-negative",
        ),
        _case(
            SupervisorSettings,
            {"prune_batch": 0},
            f"SupervisorSettings.prune_batch must be {WHOLE_INT}, not 0",
            "prune-batch-zero",
        ),
        _case(
            SupervisorSettings,
            {"prune_rounds": 1.5},
            f"SupervisorSettings.prune_rounds must be {WHOLE_INT}, not 1.5",
            "prune-rounds-fraction",
        ),
    ],
)
def test_supervisor_settings_refuse_bad_values(call: Callable[[], object], message: str) -> None:
    """Before: no check. batch=0 swept nothing; interval=0 swept without pause; retention=0 pruned
    every task as it finished, a negative one even tasks finished in the future of a skewed clock;
    prune_batch=0 made every prune round find nothing."""
    _raises(call, message)


def test_supervisor_settings_keep_what_they_took_before() -> None:
    two: Any = 2.0
    s = SupervisorSettings(retention=None, prune_every=0, prune_batch=two, prune_rounds=10)
    assert s.retention is None and s.prune_every == 0
    assert s.prune_batch == 2 and isinstance(s.prune_batch, int)
    # `stepwarden worker --retention 36500` (days, its largest) is still taken.
    assert SupervisorSettings(retention=CLI_RETENTION).retention == CLI_RETENTION
    assert SupervisorSettings(dead_after=3600.0, interval=MAX_SECONDS).dead_after == 3600.0


# -- AlertSettings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        _case(
            AlertSettings,
            {"interval": 0},
            f"AlertSettings.interval must be {SECONDS_ABOVE_0}, not 0",
            "interval-zero",
        ),
        _case(
            AlertSettings,
            {"interval": "x"},
            f"AlertSettings.interval must be {SECONDS_ABOVE_0}, not 'x'",
            "interval-text",
        ),
        _case(
            AlertSettings,
            {"batch": 1.5},
            f"AlertSettings.batch must be {WHOLE_INT}, not 1.5",
            "batch-fraction",
        ),
        _case(AlertSettings, {"batch": 0}, f"AlertSettings.batch must be {WHOLE_INT}, not 0", "batch-zero"),
        _case(
            AlertSettings,
            {"max_age": math.inf},
            f"AlertSettings.max_age must be {SECONDS_ABOVE_0}, not inf",
            "max-age-inf",
        ),
        _case(
            AlertSettings,
            {"enabled": "no"},
            "AlertSettings.enabled must be True or False, not 'no'",
            "enabled-text",
        ),
    ],
)
def test_alert_settings_refuse_bad_values(call: Callable[[], object], message: str) -> None:
    """Before: a plain ValueError ("invalid alert settings ...", naming no field) for 0; "x" a
    TypeError; batch=1.5 and max_age=inf accepted; enabled="no" turned delivery on."""
    _raises(call, message)


def test_alert_settings_keep_what_they_took_before() -> None:
    twenty: Any = 20.0
    s = AlertSettings(enabled=False, interval=0.1, batch=twenty, max_age=MAX_SECONDS)
    assert not s.enabled and s.batch == 20 and isinstance(s.batch, int)


# -- alert sinks ------------------------------------------------------------------------------------

TIMEOUT = f"alert sink 'webhook': timeout must be {SECONDS_ABOVE_0}, not "
ATTEMPTS = "alert sink 'webhook': max_attempts must be a whole number (or None) from 1 to 2147483647, not "


def _webhook(**kw: Any) -> Callable[[], object]:
    return lambda: WebhookSink(URL, **kw)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            lambda: WebhookSink(5),  # type: ignore[arg-type]
            "a webhook URL must be text starting with http:// or https://, not 5",
            id="url-number",
        ),
        pytest.param(
            lambda: WebhookSink("ftp://example.com"),
            "a webhook URL must be text starting with http:// or https://, not 'ftp://example.com'",
            id="url-scheme",
        ),
        pytest.param(_webhook(timeout="x"), TIMEOUT + "'x'", id="timeout-text"),
        pytest.param(_webhook(timeout=math.nan), TIMEOUT + "nan", id="timeout-nan"),
        pytest.param(_webhook(timeout=math.inf), TIMEOUT + "inf", id="timeout-inf"),
        pytest.param(_webhook(timeout=0), TIMEOUT + "0", id="timeout-zero"),
        pytest.param(_webhook(timeout=True), TIMEOUT + "True", id="timeout-bool"),
        pytest.param(_webhook(timeout=1e12), TIMEOUT + "1000000000000.0", id="timeout-absurd"),
        pytest.param(_webhook(max_attempts=1.5), ATTEMPTS + "1.5", id="attempts-fraction"),
        pytest.param(_webhook(max_attempts=0), ATTEMPTS + "0", id="attempts-zero"),
        pytest.param(_webhook(max_attempts="3"), ATTEMPTS + "'3'", id="attempts-text"),
        pytest.param(_webhook(max_attempts=True), ATTEMPTS + "True", id="attempts-bool"),
        pytest.param(
            _webhook(backoff=3),
            "alert sink 'webhook': backoff must be a stepwarden Backoff or None, not 3",
            id="backoff-number",
        ),
        pytest.param(
            _webhook(headers={"X-Try": 1}),
            "alert sink 'webhook': headers must be a dict of text to text or None, not {'X-Try': 1}",
            id="headers-number-value",
        ),
        pytest.param(
            _webhook(headers="Authorization: x"),
            "alert sink 'webhook': headers must be a dict of text to text or None, not 'Authorization: x'",
            id="headers-text",
        ),
        pytest.param(
            _webhook(name=5),
            "invalid alert sink name 5: use 1-128 letters, digits, '_', '.', ':' or '-', starting with a"
            " letter or digit",
            id="name-number",
        ),
        pytest.param(
            lambda: CallableSink(5),  # type: ignore[arg-type]
            "CallableSink fn must be a function of the alert (plain or async), not 5",
            id="callable-not-a-function",
        ),
        pytest.param(
            lambda: CallableSink(_page, name="pager", timeout=math.nan),
            f"alert sink 'pager': timeout must be {SECONDS_ABOVE_0}, not nan",
            id="callable-timeout-nan",
        ),
        pytest.param(
            lambda: CallableSink(_page, name="pager", max_attempts=2.5),  # type: ignore[arg-type]
            "alert sink 'pager': max_attempts must be a whole number (or None) from 1 to 2147483647, not 2.5",
            id="callable-attempts-fraction",
        ),
        pytest.param(
            lambda: LogSink(level="WARNING"),  # type: ignore[arg-type]
            "alert sink 'log': level must be a logging level (an int), not 'WARNING'",
            id="log-level-text",
        ),
        pytest.param(
            lambda: LogSink(logger="stepwarden"),  # type: ignore[arg-type]
            "alert sink 'log': logger must be a logging.Logger or None, not 'stepwarden'",
            id="log-logger-text",
        ),
    ],
)
def test_alert_sinks_refuse_bad_settings_when_made(call: Callable[[], object], message: str) -> None:
    """Before: timeout="x" raised TypeError; nan, inf and 1e12 timeouts, max_attempts=1.5 or "3",
    a backoff of 3 and headers of a number were taken, and failed (or never timed out) at every
    delivery; WebhookSink(5) raised AttributeError; CallableSink(5) and a level of "WARNING" failed
    every delivery, retried for ever."""
    _raises(call, message)


class _Pager:
    """An application's own sink: a name and an async send."""

    name = "pager-duty"

    async def send(self, alert: Alert) -> None:
        return None


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ({"timeout": math.nan}, f"alert sink 'pager-duty': timeout must be {SECONDS_ABOVE_0}, not nan"),
        ({"timeout": math.inf}, f"alert sink 'pager-duty': timeout must be {SECONDS_ABOVE_0}, not inf"),
        (
            {"timeout": 10**400},
            # the value is cut at 60 characters
            f"alert sink 'pager-duty': timeout must be {SECONDS_ABOVE_0}, not 1{'0' * 56}...",
        ),
    ],
)
def test_an_own_sink_with_a_timeout_that_never_ends_is_refused(attrs: dict[str, Any], message: str) -> None:
    """Before: nan and inf were taken (a send that never timed out), and 10**400 raised OverflowError."""
    pager = _Pager()
    for k, v in attrs.items():
        setattr(pager, k, v)
    app = App()
    _raises(lambda: app.alert_sink(pager), message)
    assert app.alert_sinks == []


def test_alert_sinks_keep_what_they_took_before() -> None:
    three: Any = 3.0
    hook = WebhookSink(URL, timeout=2, max_attempts=three, backoff=Backoff(initial=0.1), headers={"A": "b"})
    assert hook.timeout == 2.0 and hook.max_attempts == 3 and isinstance(hook.max_attempts, int)
    assert hook.headers == {"A": "b"} and hook.backoff.initial == 0.1
    assert WebhookSink("http://127.0.0.1:9/hook", max_attempts=None).max_attempts is None
    assert CallableSink(_page, timeout=MAX_SECONDS).timeout == MAX_SECONDS
    sink = LogSink(logger=logging.getLogger("ops"), level=logging.ERROR)
    assert sink.level == logging.ERROR and sink.timeout == 5.0
    app = App()
    assert app.alert_sink(_Pager()).name == "pager-duty"
    assert app.alert_sinks[0].timeout == 5.0
