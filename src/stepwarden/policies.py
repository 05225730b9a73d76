"""Retry, back-off, escalation and circuit breaking as pure values that return decisions.

Nothing here reads a clock or the store: callers pass ``now`` and a random source, so every rule
is a function of its arguments and unit-tested without sleeping (DESIGN principle 6).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

Escalation = Literal["error", "compensate", "wait"]
ESCALATIONS: tuple[str, ...] = ("error", "compensate", "wait")


@dataclass(frozen=True)
class Backoff:
    """Exponential back-off with proportional jitter: ``initial * multiplier**(n-1)``, capped."""

    initial: float = 0.5
    multiplier: float = 2.0
    maximum: float = 30.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.initial < 0 or self.maximum < 0 or self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError(f"invalid back-off {self!r}")

    def delay(self, n: int, rng: random.Random | None = None) -> float:
        """Delay before retry number ``n`` (1-based); jitter spreads retries of many tasks apart."""
        try:
            base = min(self.maximum, self.initial * self.multiplier ** max(0, n - 1))
        except OverflowError:  # a huge retry number: the cap applies
            base = self.maximum
        if self.jitter and rng is not None:
            base *= 1 - self.jitter + 2 * self.jitter * rng.random()
        return max(0.0, min(base, self.maximum * (1 + self.jitter)))


@dataclass(frozen=True)
class Decision:
    """What to do after a failed attempt: retry after ``delay`` seconds, or give up one way."""

    action: Literal["retry", "error", "compensate"]
    delay: float = 0.0
    escalated: bool = False


@dataclass(frozen=True)
class Retry:
    """A step's retry policy.

    Two levels, as in the pattern: inside one attempt the agent retries transient failures
    (``tries`` calls, ``in_attempt`` back-off, never past complete-by); across attempts the
    supervisor counts failures (FailureCount) and retries after ``backoff`` until
    ``max_failures``, then escalates: ``"error"`` (alert an operator), ``"compensate"`` (undo
    the task) or ``"wait"`` (retry after ``escalation_wait`` seconds, again and again, until an
    operator cancels). ``escalation=None`` means "do what the step's on_error says".
    """

    max_failures: int = 3
    backoff: Backoff = field(default_factory=lambda: Backoff(initial=0.5, maximum=30.0))
    tries: int = 4
    in_attempt: Backoff = field(default_factory=lambda: Backoff(initial=0.05, maximum=2.0))
    escalation: Escalation | None = None
    escalation_wait: float = 60.0

    def __post_init__(self) -> None:
        if self.max_failures < 1:
            raise ValueError("Retry.max_failures must be at least 1")
        if self.tries < 1:
            raise ValueError("Retry.tries must be at least 1")
        if self.escalation is not None and self.escalation not in ESCALATIONS:
            raise ValueError(f"Retry.escalation must be one of {ESCALATIONS}, not {self.escalation!r}")
        if self.escalation_wait < 0:
            raise ValueError("Retry.escalation_wait must not be negative")

    def after_failure(
        self, failure_count: int, on_error: Escalation, rng: random.Random | None = None
    ) -> Decision:
        """Decide after the step's ``failure_count``-th failed attempt (expired or transient-exhausted)."""
        if failure_count < self.max_failures:
            return Decision("retry", self.backoff.delay(failure_count, rng))
        escalation = self.escalation or on_error
        if escalation == "wait":
            return Decision("retry", self.escalation_wait, escalated=True)
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
        b = d.get("backoff")
        ia = d.get("in_attempt")
        assert isinstance(b, dict | None) and isinstance(ia, dict | None)
        default = cls()  # a missing key means the same default as Retry() itself
        return cls(
            max_failures=int(d.get("max_failures", 3)),  # type: ignore[call-overload]
            backoff=Backoff(**b) if b else default.backoff,
            tries=int(d.get("tries", 4)),  # type: ignore[call-overload]
            in_attempt=Backoff(**ia) if ia else default.in_attempt,
            escalation=d.get("escalation"),  # type: ignore[arg-type]
            escalation_wait=float(d.get("escalation_wait", 60.0)),  # type: ignore[arg-type]
        )


BreakerState = Literal["closed", "open", "half_open"]


@dataclass
class CircuitBreaker:
    """Fail fast after ``threshold`` consecutive failures, for ``cool_off`` seconds.

    An in-process breaker, for an application's own calls. The agent role does not use it: an
    agent's breaker is shared by all its instances through the store (``store/agents.py``), so
    that it opens for every instance at once and raises one alert.

    After the cool-off one trial call is let through (half-open); its success closes the breaker,
    its failure opens it again. Time is passed in, so the rules are tested with plain numbers.
    """

    threshold: int = 5
    cool_off: float = 5.0
    state: BreakerState = "closed"
    failures: int = 0
    opened_at: float = 0.0
    trial_in_flight: bool = False

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
