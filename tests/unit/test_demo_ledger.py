"""The ledger check must catch every way an order can end up half-done, and nothing else."""

from __future__ import annotations

from stepwarden.demo.ledger import STEP_SERVICES, LedgerReport, OrderOutcome, check_ledger

COUNTERS = ("duplicate_effects", "lost", "not_undone", "wrongly_undone", "unknown_effects")


def eff(step: str, order_id: str = "o1", applied: int = 1, undone: int = 0) -> dict[str, object]:
    return {
        "applied": applied,
        "undone": undone,
        "service": STEP_SERVICES[step],
        "op": step,
        "order_id": order_id,
        "calls": max(applied, 1),
        "tombstoned": False,
        "rejected": False,
    }


def full(task: str, order_id: str, **overrides: tuple[int, int]) -> dict[str, dict[str, object]]:
    """All three steps applied once, with per-step (applied, undone) overrides."""
    out = {}
    for step in STEP_SERVICES:
        applied, undone = overrides.get(step, (1, 0))
        out[f"{task}:{step}"] = eff(step, order_id, applied, undone)
    return out


def assert_only(report: LedgerReport, **expected: int) -> None:
    actual = {name: getattr(report, name) for name in COUNTERS}
    assert actual == {name: expected.get(name, 0) for name in COUNTERS}, report.problems
    assert report.ok == (not any(expected.values()))
    assert len(report.problems) == min(20, sum(expected.values()))


def test_clean_processed_order_passes() -> None:
    report = check_ledger(full("1", "o1"), [OrderOutcome("o1", "1", "processed")])
    assert_only(report)
    assert report.problems == []


def test_processed_order_with_missing_effect_is_lost() -> None:
    effects = full("1", "o1")
    del effects["1:ship"]
    assert_only(check_ledger(effects, [OrderOutcome("o1", "1", "processed")]), lost=1)


def test_processed_order_with_zero_applied_is_lost() -> None:
    effects = full("1", "o1", charge=(0, 0))
    assert_only(check_ledger(effects, [OrderOutcome("o1", "1", "processed")]), lost=1)


def test_processed_order_with_undone_step_is_wrongly_undone() -> None:
    effects = full("1", "o1", reserve=(1, 1))
    assert_only(check_ledger(effects, [OrderOutcome("o1", "1", "processed")]), wrongly_undone=1)


def test_key_applied_twice_is_duplicate_not_lost() -> None:
    effects = full("1", "o1", charge=(2, 0))
    report = check_ledger(effects, [OrderOutcome("o1", "1", "processed")])
    assert_only(report, duplicate_effects=1)
    assert "1:charge" in report.problems[0]


def test_key_undone_twice_is_duplicate() -> None:
    effects = full("1", "o1", reserve=(1, 2), charge=(0, 0), ship=(0, 0))
    assert_only(check_ledger(effects, [OrderOutcome("o1", "1", "compensated")]), duplicate_effects=1)


def test_same_order_applied_under_two_keys_is_duplicate() -> None:
    effects = {**full("1", "o1"), **full("2", "o1", reserve=(0, 0), ship=(0, 0))}
    orders = [OrderOutcome("o1", "1", "processed"), OrderOutcome("o1", "2", "error")]
    report = check_ledger(effects, orders)
    assert_only(report, duplicate_effects=1)
    assert "payments" in report.problems[0]


def test_compensated_order_fully_undone_passes() -> None:
    effects = full("1", "o1", reserve=(1, 1), charge=(0, 0))
    del effects["1:ship"]
    assert_only(check_ledger(effects, [OrderOutcome("o1", "1", "compensated")]))


def test_compensated_order_with_leftover_effect_is_not_undone() -> None:
    effects = full("1", "o1", reserve=(1, 1), charge=(1, 0), ship=(0, 0))
    report = check_ledger(effects, [OrderOutcome("o1", "1", "compensated")])
    assert_only(report, not_undone=1)
    assert "1:charge" in report.problems[0]


def test_cancelled_order_follows_compensated_rule() -> None:
    effects = full("1", "o1", reserve=(1, 0), charge=(0, 0), ship=(0, 0))
    assert_only(check_ledger(effects, [OrderOutcome("o1", "1", "cancelled")]), not_undone=1)


def test_error_and_unfinished_orders_have_no_requirement() -> None:
    effects = {**full("1", "o1", ship=(0, 0)), **full("2", "o2", reserve=(1, 1), charge=(0, 0))}
    orders = [OrderOutcome("o1", "1", "error"), OrderOutcome("o2", "2", "running")]
    assert_only(check_ledger(effects, orders))


def test_effect_of_unknown_task_is_reported_unless_ignored() -> None:
    effects = {**full("1", "o1"), "9:reserve": eff("reserve", "o9")}
    orders = [OrderOutcome("o1", "1", "processed")]
    assert_only(check_ledger(effects, orders), unknown_effects=1)
    assert_only(check_ledger(effects, orders, ignore_unknown=True))


def test_unknown_key_never_applied_is_not_reported() -> None:
    effects = {**full("1", "o1"), "9:reserve": eff("reserve", "o9", applied=0)}
    assert_only(check_ledger(effects, [OrderOutcome("o1", "1", "processed")]))


def test_problems_are_capped_but_counters_are_exact() -> None:
    effects = {f"{n}:reserve": eff("reserve", f"o{n}") for n in range(30)}
    report = check_ledger(effects, [])
    assert_only(report, unknown_effects=30)
    assert len(report.problems) == 20


def test_as_dict_carries_verdict_and_counters() -> None:
    effects = full("1", "o1", ship=(0, 0))
    data = check_ledger(effects, [OrderOutcome("o1", "1", "processed")]).as_dict()
    assert data["ok"] is False
    assert data["lost"] == 1
    assert {name: data[name] for name in COUNTERS if name != "lost"} == dict.fromkeys(
        [c for c in COUNTERS if c != "lost"], 0
    )
    assert isinstance(data["problems"], list) and len(data["problems"]) == 1
    assert check_ledger(full("1", "o1"), [OrderOutcome("o1", "1", "processed")]).as_dict()["ok"] is True
