"""Retry, back-off, escalation and circuit breaking as pure values that return decisions.

Nothing here reads a clock or the store: callers pass ``now`` and a random source, so every rule
is a function of its arguments and unit-tested without sleeping (DESIGN principle 6).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import numbers
import random
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

from .errors import InputError

log = logging.getLogger("stepwarden.policies")

Escalation = Literal["error", "compensate", "wait"]
ESCALATIONS: tuple[str, ...] = ("error", "compensate", "wait")
MAX_INT = 2**31 - 1  # the largest count the stores' INTEGER columns hold
MAX_ID = 2**63 - 1  # the largest row id the stores hold (a signed 64-bit integer)
# The longest duration any setting or policy takes: 10**9 seconds, about 31 years. Longer is a
# slip (milliseconds given for seconds, an exponent too many), and breaks what is computed from
# it: a time now + 1e12 (a retry's run_at, a breaker's retry_at) is past the year 9999, which
# datetime cannot show (the CLI, the dashboard), and Python's own waits overflow from about
# 10**10 seconds (threading's and time.sleep: "timestamp out of range for platform time_t").
MAX_SECONDS = 10**9


def is_number(value: object) -> bool:
    """A finite int or float; not a bool (``True`` is no number of seconds), not nan or inf, nor an
    int too large for a float (math.isfinite would raise OverflowError on it)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def whole(value: object) -> int | None:
    """A count as an int: an int (a NumPy one too) or a float without a fraction (``3.0``, as a
    configuration file may give it); None for anything else: a bool (``True`` is no count),
    ``1.5`` failures, nan, text."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def show(value: object) -> str:
    """A bad value as it goes in a one-line error message: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_number(
    what: str,
    value: object,
    *,
    low: float = 0,
    high: float | None = None,
    above: bool = False,
    unit: str = "",
    hint: str = "",
) -> float:
    """``value`` as a float if it is a finite number (see :func:`is_number`) from ``low`` (more
    than ``low`` with ``above``) to ``high`` (no upper bound with None); else an InputError that
    names ``what`` and the range, shows the value, and ends with ``hint``. ``unit`` reads after
    "number", as in ``" of seconds"``. The caller keeps the value as given if it stores it: an
    int stays an int in a policy's JSON."""
    if is_number(value):
        number = float(value)  # type: ignore[arg-type]
        if (number > low if above else number >= low) and (high is None or number <= high):
            return number
    if high is None:
        bounds = f"{'>' if above else '>='} {_plain(low)}"
    else:
        bounds = f"{'more than' if above else 'from'} {_plain(low)} {'and at most' if above else 'to'} "
        bounds += _plain(high) + (" (about 31 years)" if high == MAX_SECONDS else "")
    raise InputError(f"{what} must be a finite number{unit} {bounds}, not {show(value)}{hint}")


def check_seconds(what: str, value: object, *, above: bool = False, hint: str = "") -> float:
    """A duration: a finite number of seconds from 0 (more than 0 with ``above``) to
    :data:`MAX_SECONDS` (about 31 years); else an InputError naming ``what``."""
    return check_number(what, value, low=0, high=MAX_SECONDS, above=above, unit=" of seconds", hint=hint)


def check_count(what: str, value: object, *, low: int = 1, high: int = MAX_INT, unit: str = "") -> int:
    """A count as an int (see :func:`whole`: ``3.0`` is 3) from ``low`` to ``high``; else an
    InputError naming ``what``, the range and the value."""
    count = whole(value)
    if count is None or not low <= count <= high:
        raise InputError(f"{what} must be a whole number{unit} from {low} to {high}, not {show(value)}")
    return count


def check_id(kind: str, value: object) -> int:
    """A row id (a task's, an alert's) as the stores hold them: an int from 1 to :data:`MAX_ID`.
    Anything else is bad input, not an OverflowError from the driver or a search for a row that
    cannot exist; a bool or ``"1"`` is refused too (SQLite would take either for 1)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and 1 <= int(value) <= MAX_ID:
        return int(value)
    raise InputError(f"{kind} must be a positive integer (at most 2**63-1), not {show(value)}")


def _plain(number: float) -> str:
    """A bound as a message shows it: ``0``, ``1``, ``1000000000``, ``0.5``."""
    return str(int(number)) if float(number).is_integer() else repr(number)


@dataclass(frozen=True)
class Backoff:
    """Exponential back-off with proportional jitter: ``initial * multiplier**(n-1)``, capped.

    Every field is a finite number (seconds, or a factor), never nan, inf or a bool: ``initial``
    and ``maximum`` seconds from 0 to :data:`MAX_SECONDS` (10**9, about 31 years),
    ``multiplier`` >= 1, ``jitter`` between 0 and 1. Anything else raises
    :class:`~stepwarden.errors.InputError` here, at definition time: an infinite delay would leave
    a task waiting forever (REL1).
    """

    initial: float = 0.5
    multiplier: float = 2.0
    maximum: float = 30.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        check_seconds("invalid back-off: Backoff.initial", self.initial)
        check_number("invalid back-off: Backoff.multiplier", self.multiplier, low=1)
        check_seconds("invalid back-off: Backoff.maximum", self.maximum)
        check_number("invalid back-off: Backoff.jitter", self.jitter, low=0, high=1)

    def delay(self, n: int, rng: random.Random | None = None) -> float:
        """Delay before retry number ``n`` (1-based); jitter spreads retries of many tasks apart."""
        try:
            base = min(self.maximum, self.initial * self.multiplier ** max(0, n - 1))
        except OverflowError:  # a huge retry number: the cap applies
            base = self.maximum
        return max(0.0, min(self.spread(base, rng), self.maximum * (1 + self.jitter)))

    def spread(self, seconds: float, rng: random.Random | None) -> float:
        """``seconds`` with this back-off's jitter (none without ``rng``)."""
        if self.jitter and rng is not None:
            return seconds * (1 - self.jitter + 2 * self.jitter * rng.random())
        return seconds


@dataclass(frozen=True)
class Decision:
    """What to do after a failed attempt: retry after ``delay`` seconds, or give up one way."""

    action: Literal["retry", "error", "compensate"]
    delay: float = 0.0
    escalated: bool = False
    # An escalation announced already, at an earlier failure: the "wait" escalation's later
    # retries, which raise no alert of their own (one per outage, not one per wait).
    repeated: bool = False


@dataclass(frozen=True)
class Retry:
    """A step's retry policy.

    Two levels, as in the pattern: inside one attempt the agent retries transient failures
    (``tries`` calls, ``in_attempt`` back-off, never past complete-by); across attempts the
    supervisor counts failures (FailureCount) and retries after ``backoff`` until
    ``max_failures``, then escalates: ``"error"`` (alert an operator), ``"compensate"`` (undo
    the task) or ``"wait"`` (retry after ``escalation_wait`` seconds, again and again, until an
    operator cancels). ``escalation=None`` means "do what the step's on_error says".

    ``max_failures`` and ``tries`` are ints from 1 to 2**31-1; ``backoff`` and ``in_attempt``
    are :class:`Backoff` values; ``escalation_wait`` is a finite number of seconds from 0 to
    :data:`MAX_SECONDS` (10**9, about 31 years). Infinity is refused: a task waiting forever is
    stuck (REL1), and cannot be retried, only cancelled. To wait for an operator, use
    ``escalation="error"``: the task ends in ``error`` with an alert and the operator retries it.
    Anything else raises :class:`~stepwarden.errors.InputError`.
    """

    max_failures: int = 3
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=0.5, maximum=30.0))
    tries: int = 4
    in_attempt: Backoff = field(default_factory=lambda: Backoff(initial=0.05, maximum=2.0))
    escalation: Escalation | None = None
    escalation_wait: float = 60.0

    def __post_init__(self) -> None:
        for name in ("max_failures", "tries"):
            count = check_count(f"Retry.{name}", getattr(self, name))
            object.__setattr__(self, name, count)  # 3.0 from a configuration file is 3
        for name in ("backoff", "in_attempt"):
            value = getattr(self, name)
            if not isinstance(value, Backoff):
                raise InputError(f"Retry.{name} must be a Backoff, not {show(value)}")
        if self.escalation is not None and (
            not isinstance(self.escalation, str) or self.escalation not in ESCALATIONS
        ):
            raise InputError(
                f"Retry.escalation must be one of {ESCALATIONS} or None, not {show(self.escalation)}"
            )
        check_seconds(
            "Retry.escalation_wait",
            self.escalation_wait,
            hint=" (to wait for an operator, use escalation='error')",
        )

    def after_failure(
        self, failure_count: int, on_error: Escalation, rng: random.Random | None = None
    ) -> Decision:
        """Decide after the step's ``failure_count``-th failed attempt (expired or transient-exhausted)."""
        if failure_count < self.max_failures:
            return Decision("retry", self.backoff.delay(failure_count, rng))
        escalation = self.escalation or on_error
        if escalation == "wait":
            # Spread like the back-off: the tasks an outage escalated together would otherwise
            # all come back at the same moment, and again every escalation_wait after that.
            wait = self.backoff.spread(self.escalation_wait, rng)
            return Decision("retry", wait, escalated=True, repeated=failure_count > self.max_failures)
        return Decision("compensate" if escalation == "compensate" else "error", escalated=True)

    def to_dict(self) -> dict[str, object]:
        return {
            "max_failures": self.max_failures,
            "backoff": vars(self.backoff).copy(),
            "tries": self.tries,
            "in_attempt": vars(self.in_attempt).copy(),
            "escalation": self.escalation,
            "escalation_wait": self.escalation_wait,
        }

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Retry:
        """A policy read back from the store (a step row, a registered workflow).

        A missing key means the same default as ``Retry()`` itself. A value that older versions
        accepted and this one refuses (nan, inf, 1.5 failures) also takes its default, with a
        warning: the policy of a task already submitted is read in the transaction that records
        a failure, and an error there would hold up every reply of its batch.
        """
        b = d.get("backoff")
        ia = d.get("in_attempt")
        assert isinstance(b, dict | None) and isinstance(ia, dict | None)
        default = DEFAULT_RETRY
        return _stored(
            cls,
            {
                "max_failures": _count(d.get("max_failures", default.max_failures)),
                "backoff": _stored(Backoff, b, default.backoff) if b else default.backoff,
                "tries": _count(d.get("tries", default.tries)),
                "in_attempt": _stored(Backoff, ia, default.in_attempt) if ia else default.in_attempt,
                "escalation": d.get("escalation"),
                "escalation_wait": d.get("escalation_wait", default.escalation_wait),
            },
        )


DEFAULT_RETRY = Retry()  # frozen: one instance serves every reader


@functools.lru_cache(maxsize=512)
def stored_policy(text: str) -> Retry:
    """A step's policy from its stored JSON text, parsed once per distinct text: every request
    of a step carries the same text, so an agent's attempt and a scheduler's failure read it
    without parsing and checking it again (and a value an older version stored, now refused,
    is warned about once, not per attempt). A Retry is frozen, so one instance may be shared."""
    return Retry.from_dict(json.loads(text))


T = TypeVar("T", Backoff, Retry)


def _count(value: object) -> object:
    """A stored count as older versions read it: a finite float is cut to an int (1.5 -> 1)."""
    return int(value) if isinstance(value, float) and math.isfinite(value) else value


def _stored(cls: type[T], values: dict[str, Any], base: T | None = None) -> T:
    """``cls(**values)``; a field the checks refuse, each on its own, takes its default instead:
    ``base``'s value of it (a Retry's own back-off defaults), else the class's."""
    try:
        return cls(**values)
    except InputError as e:
        kept: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(cls)} if base else {}
        for f in fields(cls):
            if f.name in values:
                try:
                    cls(**{f.name: values[f.name]})
                    kept[f.name] = values[f.name]
                except InputError:
                    pass
        log.warning(
            "a stored %s policy has a value now refused, which takes its default: %s", cls.__name__, e
        )
        return cls(**kept)


BreakerState = Literal["closed", "open", "half_open"]
BREAKER_STATES: tuple[str, ...] = ("closed", "open", "half_open")


@dataclass
class CircuitBreaker:
    """Fail fast after ``threshold`` consecutive failures, for ``cool_off`` seconds.

    An in-process breaker, for an application's own calls. The agent role does not use it: an
    agent's breaker is shared by all its instances through the store (``store/agents.py``), so
    that it opens for every instance at once and raises one alert.

    After the cool-off one trial call is let through (half-open); its success closes the breaker,
    its failure opens it again. Time is passed in, so the rules are tested with plain numbers.

    ``threshold`` is an int from 1 to 2**31-1, ``cool_off`` a finite number of seconds from 0 to
    :data:`MAX_SECONDS` (10**9, about 31 years); the state fields, for a breaker restored from
    elsewhere, are one of ``"closed"``, ``"open"``, ``"half_open"``, an int ``failures`` >= 0 and
    a finite ``opened_at``. Anything else raises :class:`~stepwarden.errors.InputError` when it is
    made.
    """

    threshold: int = 5
    cool_off: float = 5.0
    state: BreakerState = "closed"
    failures: int = 0
    opened_at: float = 0.0
    trial_in_flight: bool = False

    def __post_init__(self) -> None:
        self.threshold = check_count("CircuitBreaker.threshold", self.threshold)
        check_seconds("CircuitBreaker.cool_off", self.cool_off)
        if not isinstance(self.state, str) or self.state not in BREAKER_STATES:
            raise InputError(f"CircuitBreaker.state must be one of {BREAKER_STATES}, not {show(self.state)}")
        self.failures = check_count("CircuitBreaker.failures", self.failures, low=0)
        if not is_number(self.opened_at):
            raise InputError(
                "CircuitBreaker.opened_at must be a finite number (a time in seconds), "
                f"not {show(self.opened_at)}"
            )

    def rejecting(self, now: float) -> bool:
        """Is the breaker open and cooling off? A query with no side effect, unlike :meth:`allow`."""
        return self.state == "open" and now - self.opened_at < self.cool_off

    def allow(self, now: float) -> bool:
        """May a call go to the service now?"""
        if self.state == "closed":
            return True
        if self.state == "open" and now - self.opened_at >= self.cool_off:
            self.state = "half_open"
            self.trial_in_flight = False
        if self.state == "half_open" and not self.trial_in_flight:
            self.trial_in_flight = True
            return True
        return False

    def record_success(self) -> None:
        self.state = "closed"
        self.failures = 0
        self.trial_in_flight = False

    def record_failure(self, now: float) -> bool:
        """Count a failure; returns True when this failure opened the breaker."""
        self.failures += 1
        self.trial_in_flight = False
        if self.state == "half_open" or (self.state == "closed" and self.failures >= self.threshold):
            self.state = "open"
            self.opened_at = now
            return True
        return False
