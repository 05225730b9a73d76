"""Retry, back-off and circuit breaking are pure decisions: tested with plain numbers, no clock."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import cast

import pytest

from stepwarden.policies import Backoff, BreakerState, CircuitBreaker, Decision, Retry

# -- Backoff ---------------------------------------------------------------------------------------


def test_backoff_grows_exponentially_from_initial() -> None:
    b = Backoff(initial=0.5, multiplier=2.0, maximum=100.0, jitter=0.0)
    assert [b.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 8.0]


def test_backoff_multiplier_one_is_constant() -> None:
    b = Backoff(initial=3.0, multiplier=1.0, maximum=100.0, jitter=0.0)
    assert {b.delay(n) for n in range(1, 20)} == {3.0}


def test_backoff_is_capped_at_maximum() -> None:
    b = Backoff(initial=1.0, multiplier=3.0, maximum=10.0, jitter=0.0)
    assert [b.delay(n) for n in range(1, 6)] == [1.0, 3.0, 9.0, 10.0, 10.0]


def test_backoff_cap_holds_for_any_retry_number() -> None:
    # A Retry(max_failures=2000) step reaches failure 1025 after a long outage; the delay must still
    # be the cap, not an OverflowError that aborts the supervisor's sweep transaction.
    b = Backoff(initial=0.5, multiplier=2.0, maximum=30.0, jitter=0.0)
    assert b.delay(2000) == 30.0
    assert Retry(max_failures=5000).after_failure(1500, "error").delay <= 30.0 * 1.2


def test_backoff_without_rng_has_no_jitter() -> None:
    b = Backoff(initial=2.0, multiplier=2.0, maximum=100.0, jitter=0.5)
    assert b.delay(3) == 8.0


def test_backoff_jitter_stays_within_bounds_and_spreads() -> None:
    b = Backoff(initial=1.0, multiplier=2.0, maximum=100.0, jitter=0.25)
    rng = random.Random(7)
    delays = [b.delay(3, rng) for _ in range(2000)]  # base 4.0
    assert all(3.0 <= d <= 5.0 for d in delays)
    assert max(delays) - min(delays) > 1.5  # it really spreads, over most of the +-25% band
    assert 3.9 < sum(delays) / len(delays) < 4.1  # centred on the base


def test_backoff_jitter_at_the_cap_stays_within_jittered_cap() -> None:
    b = Backoff(initial=1.0, multiplier=2.0, maximum=10.0, jitter=0.2)
    rng = random.Random(3)
    delays = [b.delay(50, rng) for _ in range(500)]
    assert all(8.0 <= d <= 12.0 for d in delays)
    assert min(delays) < 9.0 and max(delays) > 11.0


def test_backoff_delay_is_never_negative() -> None:
    b = Backoff(initial=0.0, multiplier=2.0, maximum=5.0, jitter=1.0)
    rng = random.Random(1)
    assert all(b.delay(n, rng) >= 0.0 for n in range(0, 10))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial": -0.1},
        {"maximum": -1.0},
        {"multiplier": 0.5},
        {"jitter": -0.01},
        {"jitter": 1.01},
    ],
)
def test_backoff_refuses_invalid_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="invalid back-off"):
        Backoff(**kwargs)


def test_backoff_accepts_boundary_values() -> None:
    b = Backoff(initial=0.0, multiplier=1.0, maximum=0.0, jitter=1.0)
    assert b.delay(5, random.Random(0)) == 0.0


# -- Retry -----------------------------------------------------------------------------------------


def test_retry_below_threshold_retries_with_growing_backoff() -> None:
    r = Retry(max_failures=4, backoff=Backoff(initial=1.0, multiplier=2.0, maximum=60.0, jitter=0.0))
    assert [r.after_failure(n, "error") for n in (1, 2, 3)] == [
        Decision("retry", 1.0),
        Decision("retry", 2.0),
        Decision("retry", 4.0),
    ]
    assert not any(r.after_failure(n, "error").escalated for n in (1, 2, 3))


def test_retry_backoff_uses_jitter_from_the_rng() -> None:
    r = Retry(max_failures=5, backoff=Backoff(initial=10.0, maximum=60.0, jitter=0.5))
    delays = {r.after_failure(1, "error", random.Random(seed)).delay for seed in range(20)}
    assert len(delays) > 10
    assert all(5.0 <= d <= 15.0 for d in delays)


@pytest.mark.parametrize(
    ("escalation", "on_error", "expected"),
    [
        ("error", "compensate", Decision("error", escalated=True)),
        ("compensate", "error", Decision("compensate", escalated=True)),
        ("wait", "error", Decision("retry", 45.0, escalated=True)),
        (None, "error", Decision("error", escalated=True)),
        (None, "compensate", Decision("compensate", escalated=True)),
    ],
)
def test_retry_escalates_at_threshold(escalation: str | None, on_error: str, expected: Decision) -> None:
    r = Retry(max_failures=3, escalation=escalation, escalation_wait=45.0)  # type: ignore[arg-type]
    assert r.after_failure(3, on_error) == expected  # type: ignore[arg-type]
    later = r.after_failure(7, on_error)  # type: ignore[arg-type]
    assert later == (replace(expected, repeated=True) if expected.action == "retry" else expected)


def test_retry_wait_escalation_keeps_retrying_after_the_extended_wait_announced_once() -> None:
    r = Retry(max_failures=1, escalation="wait", escalation_wait=120.0)
    for n in range(1, 6):
        d = r.after_failure(n, "error")
        assert (d.action, d.delay, d.escalated, d.repeated) == ("retry", 120.0, True, n > 1)


def test_retry_wait_escalation_is_spread_by_the_backoffs_jitter() -> None:
    r = Retry(max_failures=1, escalation="wait", escalation_wait=100.0, backoff=Backoff(jitter=0.25))
    waits = {r.after_failure(2, "error", random.Random(seed)).delay for seed in range(20)}
    assert len(waits) > 10
    assert all(75.0 <= w <= 125.0 for w in waits), waits
    no_jitter = Retry(max_failures=1, escalation="wait", escalation_wait=100.0, backoff=Backoff(jitter=0))
    assert no_jitter.after_failure(2, "error", random.Random(1)).delay == 100.0


def test_retry_max_failures_one_escalates_on_first_failure() -> None:
    assert Retry(max_failures=1).after_failure(1, "compensate").action == "compensate"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_failures": 0},
        {"tries": 0},
        {"escalation": "explode"},
        {"escalation_wait": -1.0},
    ],
)
def test_retry_refuses_invalid_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Retry(**kwargs)  # type: ignore[arg-type]


def test_retry_dict_round_trip() -> None:
    r = Retry(
        max_failures=7,
        backoff=Backoff(initial=2.0, multiplier=3.0, maximum=90.0, jitter=0.1),
        tries=2,
        in_attempt=Backoff(initial=0.01, maximum=0.5),
        escalation="wait",
        escalation_wait=12.5,
    )
    assert Retry.from_dict(r.to_dict()) == r
    assert Retry.from_dict(Retry().to_dict()) == Retry()


def test_retry_from_dict_missing_keys_mean_the_defaults() -> None:
    assert Retry.from_dict({}) == Retry()
    assert Retry.from_dict({"max_failures": 5}) == Retry(max_failures=5)


# -- CircuitBreaker --------------------------------------------------------------------------------


def open_breaker(threshold: int = 3, cool_off: float = 10.0, at: float = 100.0) -> CircuitBreaker:
    cb = CircuitBreaker(threshold=threshold, cool_off=cool_off)
    for _ in range(threshold):
        assert cb.allow(at)
        cb.record_failure(at)
    return cb


def test_breaker_stays_closed_below_threshold() -> None:
    cb = CircuitBreaker(threshold=3, cool_off=10.0)
    assert cb.record_failure(1.0) is False
    assert cb.record_failure(2.0) is False
    assert cb.state == "closed"
    assert cb.allow(2.0)


def test_breaker_opens_at_threshold_consecutive_failures() -> None:
    cb = CircuitBreaker(threshold=3, cool_off=10.0)
    results = [cb.record_failure(t) for t in (1.0, 2.0, 3.0)]
    assert results == [False, False, True]
    assert cb.state == "open"
    assert cb.opened_at == 3.0


def test_breaker_success_resets_the_consecutive_count() -> None:
    cb = CircuitBreaker(threshold=3, cool_off=10.0)
    cb.record_failure(1.0)
    cb.record_failure(2.0)
    cb.record_success()
    cb.record_failure(3.0)
    cb.record_failure(4.0)
    assert cb.state == "closed"


def test_breaker_fails_fast_during_cool_off() -> None:
    cb = open_breaker(cool_off=10.0, at=100.0)
    assert not cb.allow(100.0)
    assert not cb.allow(109.99)
    assert cb.state == "open"


def test_breaker_half_open_lets_exactly_one_trial_through() -> None:
    cb = open_breaker(cool_off=10.0, at=100.0)
    assert cb.allow(110.0)
    assert cb.state == "half_open"
    assert not cb.allow(110.0)
    assert not cb.allow(200.0)  # still one trial in flight, however long it takes


def test_breaker_trial_success_closes() -> None:
    cb = open_breaker(cool_off=10.0, at=100.0)
    assert cb.allow(111.0)
    cb.record_success()
    assert cb.state == "closed"
    assert all(cb.allow(111.0) for _ in range(5))
    # and it takes a full threshold of new failures to open again
    assert [cb.record_failure(112.0) for _ in range(3)] == [False, False, True]


def test_breaker_trial_failure_reopens_for_a_new_cool_off() -> None:
    cb = open_breaker(cool_off=10.0, at=100.0)
    assert cb.allow(110.0)
    assert cb.record_failure(110.5) is True
    assert cb.state == "open"
    assert not cb.allow(115.0)
    assert not cb.allow(120.4)
    assert cb.allow(120.5)  # a new trial after a full cool-off from the reopening
    assert cast(BreakerState, cb.state) == "half_open"  # cast: mypy keeps the "open" narrowed above
