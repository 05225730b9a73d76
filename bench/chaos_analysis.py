"""Pure functions over the store's records of a chaos run: rescue latencies, failovers, leader terms."""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from chaos_common import DB_FAULTS, pid_of, stats


def event_detail(e: dict[str, Any]) -> dict[str, Any]:
    d = e.get("detail")
    if isinstance(d, dict):
        return d
    try:
        out = json.loads(d) if d else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def rescue_samples(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each rescue that was retried: complete-by passing -> the retry's dispatch.

    ``events`` are ``rescued``, ``retry_scheduled`` and ``dispatched`` rows in id order. The back-off
    the retry policy asks for (``retry_scheduled.delay``) is kept apart, so the machinery's own share
    (detection by the supervisor, pickup by a scheduler) can be compared with its target."""
    open_: dict[tuple[int, int], dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    for e in events:
        key = (int(e["task_id"]), int(e["step_idx"]))
        d = event_detail(e)
        if e["kind"] == "rescued":
            open_[key] = {
                "attempt": e["attempt"],
                "complete_by": float(d.get("complete_by", e["at"])),
                "rescued_at": float(e["at"]),
                "delay": None,
                # Rescued because its worker was presumed dead, before complete-by (see liveness).
                "dead_worker": "presumed dead" in str(d.get("reason", "")),
            }
        elif e["kind"] == "retry_scheduled":
            r = open_.get(key)
            if r is not None and r["attempt"] == e["attempt"]:
                r["delay"] = float(d.get("delay", 0.0))
        elif e["kind"] == "dispatched":
            r = open_.pop(key, None)
            if r is None or r["delay"] is None:
                continue  # escalated (compensation), not a retry
            at = float(e["at"])
            out.append(
                {
                    "task_id": key[0],
                    "step_idx": key[1],
                    "attempt": r["attempt"],
                    "complete_by": r["complete_by"],
                    "dispatched_at": at,
                    "latency": at - r["complete_by"],
                    "detection": r["rescued_at"] - r["complete_by"],
                    "backoff": r["delay"],
                    "machinery": at - r["complete_by"] - r["delay"],
                    "dead_worker": r["dead_worker"],
                    "rescued_at": r["rescued_at"],
                }
            )
    return out


def failover_samples(
    faults: Sequence[dict[str, Any]],
    acquisitions: Sequence[dict[str, Any]],
    kinds: Sequence[str],
    db_quiet_before: float = 8.0,
) -> list[dict[str, Any]]:
    """Fault time -> the next ``lease_acquired`` (any holder, a newer term).

    A sample is *disturbed* when a database fault (reset, stall, restart) happened within
    ``db_quiet_before`` seconds before the leader fault or before the new leader was elected: then
    the database, not the election, may have set the pace."""
    acq = sorted(acquisitions, key=lambda a: float(a["at"]))
    db_times = [float(f["at"]) for f in faults if f["kind"] in DB_FAULTS]
    out = []
    for f in faults:
        if f["kind"] not in kinds:
            continue
        if f["kind"] == "kill" and f.get("held_term") is None:
            continue
        nxt = next(
            (
                a
                for a in acq
                if float(a["at"]) > f["at"] and a["term"] > (f.get("term") or f.get("held_term") or 0)
            ),
            None,
        )
        out.append(
            {
                "kind": f["kind"],
                "at": f["at"],
                "failover": None if nxt is None else float(nxt["at"]) - f["at"],
                "new_term": None if nxt is None else nxt["term"],
                "disturbed": any(
                    f["at"] - db_quiet_before <= d <= (f["at"] + 60 if nxt is None else float(nxt["at"]))
                    for d in db_times
                ),
            }
        )
    return out


def term_analysis(terms: Sequence[dict[str, Any]], rescued: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Overlapping leader terms, from ``lease_terms`` and the terms' own fenced writes.

    An *acting overlap* is a term that began before an earlier term's last fenced write (a
    ``rescued`` event carries the term it was written under): two leaders would then both have
    acted. A *nominal overlap* is a term that began before the previous one was recorded as ended."""
    terms = sorted(terms, key=lambda r: int(r["term"]))
    holder = {int(r["term"]): r["holder"] for r in terms}
    last_write: dict[int, float] = {}
    writes: Counter[int] = Counter()
    foreign = 0
    for e in rescued:
        term = event_detail(e).get("term")
        if term is None:
            continue
        term = int(term)
        writes[term] += 1
        last_write[term] = max(last_write.get(term, -math.inf), float(e["at"]))
        if term in holder and e.get("actor") != holder[term]:
            foreign += 1
    acting: list[dict[str, Any]] = []
    nominal = 0
    latest_write, latest_term = -math.inf, None
    prev: dict[str, Any] | None = None
    for r in terms:
        term, acquired = int(r["term"]), float(r["acquired_at"])
        if latest_write > acquired:
            acting.append(
                {
                    "term": term,
                    "acquired_at": acquired,
                    "earlier_term": latest_term,
                    "earlier_write_at": latest_write,
                    "by_s": round(latest_write - acquired, 6),
                }
            )
        if prev is not None and (prev["ended_at"] is None or float(prev["ended_at"]) > acquired):
            nominal += 1
        if last_write.get(term, -math.inf) > latest_write:
            latest_write, latest_term = last_write[term], term
        prev = r
    gaps = [
        float(b["acquired_at"]) - float(a["ended_at"])
        for a, b in itertools.pairwise(terms)
        if a["ended_at"] is not None
    ]
    return {
        "terms": len(terms),
        "acting_overlaps": len(acting),
        "acting_overlap_detail": acting[:20],
        "nominal_overlaps": nominal,
        "fenced_writes_by_non_holder": foreign,
        "terms_with_writes": len(writes),
        "fenced_writes": sum(writes.values()),
        "handover_gap_s": stats(gaps),
        # a leader that gave its term up and took the next one itself: it deposed itself
        "same_holder_reelections": sum(1 for a, b in itertools.pairwise(terms) if a["holder"] == b["holder"]),
    }


def mark_term_holders(faults: Sequence[dict[str, Any]], terms: Sequence[dict[str, Any]]) -> None:
    """Record on each kill or pause of an ordinary worker whether its victim held a leader term at
    that moment, from ``lease_terms`` (the harness avoids it, but checks rather than trusts)."""
    for f in faults:
        if f["kind"] not in ("kill", "stop_worker") or "pid" not in f:
            continue
        held = [
            int(t["term"])
            for t in terms
            if pid_of(t["holder"]) == f["pid"]
            and str(t["holder"]).startswith(f["worker"] + ":")
            and float(t["acquired_at"]) <= f["at"]
            and (t["ended_at"] is None or float(t["ended_at"]) > f["at"])
        ]
        f["held_term"] = max(held) if held else None


def in_any(a: float, b: float, windows: Sequence[tuple[float, float]]) -> bool:
    return any(a < w1 and w0 < b for w0, w1 in windows)
