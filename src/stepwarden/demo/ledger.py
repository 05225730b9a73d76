"""The demo's consistency check: compare what the services really did with what the tasks claim.

A task's own state can lie -- a hung call may have applied an effect nobody saw, a stale worker may have
repeated one -- so the only trustworthy verdict on "completed or undone as a whole" comes from the
services' ledgers. This module turns a ledger plus the final task states into counted, human-readable
problems so the demo can fail loudly when the pattern's guarantee is broken.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["STEP_SERVICES", "LedgerReport", "OrderOutcome", "check_ledger", "fetch_ledger"]

#: workflow step name -> service that carries its effect
STEP_SERVICES: dict[str, str] = {"reserve": "inventory", "charge": "payments", "ship": "shipping"}

_MAX_PROBLEMS = 20
_UNDONE_STATES = frozenset({"compensated", "cancelled"})


@dataclass(frozen=True)
class OrderOutcome:
    order_id: str
    task_id: str
    state: str


@dataclass
class LedgerReport:
    duplicate_effects: int = 0
    lost: int = 0
    not_undone: int = 0
    wrongly_undone: int = 0
    unknown_effects: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.duplicate_effects
            or self.lost
            or self.not_undone
            or self.wrongly_undone
            or self.unknown_effects
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "duplicate_effects": self.duplicate_effects,
            "lost": self.lost,
            "not_undone": self.not_undone,
            "wrongly_undone": self.wrongly_undone,
            "unknown_effects": self.unknown_effects,
            "problems": list(self.problems),
        }

    def _note(self, line: str) -> None:
        # Capped so a systematically broken run still prints a readable summary; counters stay exact.
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(line)


def _count(effect: Mapping[str, object] | None, name: str) -> int:
    if effect is None:
        return 0
    value = effect.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return int(value)


def _task_of(key: str) -> str:
    return key.rpartition(":")[0] if ":" in key else key


def check_ledger(
    effects: Mapping[str, Mapping[str, object]],
    orders: Sequence[OrderOutcome],
    ignore_unknown: bool = False,
) -> LedgerReport:
    """Judge the ledger against final order states; ``ignore_unknown`` is for callers checking a subset."""
    report = LedgerReport()
    by_task: dict[str, list[str]] = {}
    for key in sorted(effects):
        by_task.setdefault(_task_of(key), []).append(key)

    _check_duplicates(effects, report)

    known: set[str] = set()
    for order in orders:
        known.add(order.task_id)
        if order.state == "processed":
            _check_processed(effects, order, report)
        elif order.state in _UNDONE_STATES:
            _check_undone(effects, by_task.get(order.task_id, []), order, report)
        # "error" waits for an operator and non-final states are still moving: no claim to verify yet.

    if not ignore_unknown:
        for task_id, keys in by_task.items():
            if task_id in known:
                continue
            for key in keys:
                if _count(effects[key], "applied") >= 1:
                    report.unknown_effects += 1
                    report._note(f"effect {key} applied but belongs to no known order")
    return report


def _check_duplicates(effects: Mapping[str, Mapping[str, object]], report: LedgerReport) -> None:
    applied_keys: dict[tuple[str, str], list[str]] = {}
    for key in sorted(effects):
        effect = effects[key]
        applied, undone = _count(effect, "applied"), _count(effect, "undone")
        if applied > 1 or undone > 1:
            report.duplicate_effects += 1
            report._note(f"effect {key} applied {applied}x, undone {undone}x")
        order_id, service = effect.get("order_id"), effect.get("service")
        if applied >= 1 and order_id is not None and service is not None:
            applied_keys.setdefault((str(order_id), str(service)), []).append(key)
    # Two different keys applying the same order's effect means the workflow itself ran a step twice
    # (e.g. a resubmitted order), which per-key idempotency cannot catch.
    for (order_id, service), keys in sorted(applied_keys.items()):
        if len(keys) > 1:
            report.duplicate_effects += 1
            report._note(f"order {order_id}: {service} applied under {len(keys)} keys ({', '.join(keys)})")


def _check_processed(
    effects: Mapping[str, Mapping[str, object]], order: OrderOutcome, report: LedgerReport
) -> None:
    missing: list[str] = []
    undone: list[str] = []
    for step in STEP_SERVICES:
        effect = effects.get(f"{order.task_id}:{step}")
        if _count(effect, "applied") == 0:
            missing.append(step)
        if _count(effect, "undone") > 0:
            undone.append(step)
    if missing:
        report.lost += 1
        report._note(f"order {order.order_id} (task {order.task_id}) processed but never applied: {missing}")
    if undone:
        report.wrongly_undone += 1
        report._note(f"order {order.order_id} (task {order.task_id}) processed but undone: {undone}")


def _check_undone(
    effects: Mapping[str, Mapping[str, object]],
    keys: Sequence[str],
    order: OrderOutcome,
    report: LedgerReport,
) -> None:
    left = [key for key in keys if _count(effects[key], "applied") > _count(effects[key], "undone")]
    if left:
        report.not_undone += 1
        report._note(f"order {order.order_id} (task {order.task_id}) {order.state} but still applied: {left}")


def fetch_ledger(base_url: str, timeout: float = 10) -> dict[str, dict[str, object]]:
    """Read ``GET /ledger``; raises ValueError if the reply is not the expected shape."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/ledger", timeout=timeout) as response:
        payload = json.loads(response.read())
    effects = payload.get("effects") if isinstance(payload, dict) else None
    if not isinstance(effects, dict) or not all(isinstance(v, dict) for v in effects.values()):
        raise ValueError(f"unexpected ledger reply from {base_url}")
    return {str(k): v for k, v in effects.items()}
