"""The chaos run's report: figures, checks and problems from what the harness recorded and the
store and the services' ledger say (``build_report``), and its summary lines."""

from __future__ import annotations

import contextlib
import subprocess
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chaos_analysis import (
    event_detail,
    failover_samples,
    in_any,
    mark_term_holders,
    rescue_samples,
    term_analysis,
)
from chaos_common import (
    DB_FAULTS,
    FINAL,
    LEADER_FAULTS,
    LEASE_NAME,
    TERMINAL,
    Reader,
    pct,
    pruned_total,
    stats,
)
from chaos_faults import Injector
from chaos_procs import Submitter, hang_seconds, layout, longest_complete_by
from chaos_tracker import Tracker

if TYPE_CHECKING:
    from chaos_run import Run  # which imports this module: for annotations only


def build_report(
    run: Run,
    prefix: str,
    first_event: int,
    run_started: float,
    t0: float,
    injected_until: float,
    end_wall: float,
    settled_s: float,
    sub: Submitter,
    inj: Injector,
    plan: list[tuple[float, str]],
    effects: dict[str, dict[str, object]],
    lease: Any,
    sup: Any,
) -> dict[str, Any]:
    from stepwarden.demo.ledger import OrderOutcome, check_ledger

    o = run.o
    assert run.reader is not None and run.workers is not None and run.services is not None
    assert run.tracker is not None
    reader, tracker = run.reader, run.tracker
    # The run's tasks: as the tracker's last, full read found them in the store, and those the
    # leader pruned before it, in the last state the tracker saw them in.
    stored = tracker.in_store_at_end
    if stored is None:
        raise RuntimeError("the store could not be read at the end of the run")
    tasks = [
        {"id": tid, "correlation_id": t["correlation_id"], "state": t["state"], "pruned": tid not in stored}
        for tid, t in sorted(tracker.tasks.items())
    ]
    pruned_rows = [t for t in tasks if t["pruned"]]
    unaccounted = [t for t in pruned_rows if t["state"] not in TERMINAL]
    by_state = Counter(t["state"] for t in tasks)
    stuck_rows = [t for t in tasks if t["state"] not in FINAL and not t["pruned"]]
    in_store = {t["correlation_id"] for t in tasks}
    lost_ids = sorted(oid for oid in sub.acked if oid not in in_store)
    ledger = check_ledger(
        effects, [OrderOutcome(t["correlation_id"], str(t["id"]), t["state"]) for t in tasks]
    )
    # Events, lease terms and prunes, as the tracker followed them.
    events = sorted(
        (e for e in tracker.events if e["kind"] in ("rescued", "retry_scheduled", "dispatched")),
        key=lambda e: int(e["id"]),
    )
    kinds = Counter(tracker.kinds)
    leases = sorted((e for e in tracker.events if e["kind"].startswith("lease_")), key=lambda e: int(e["id"]))
    acq = [
        {"at": float(a["at"]), "term": int(event_detail(a).get("term", 0)), "holder": a["actor"]}
        for a in leases
        if a["kind"] == "lease_acquired" and event_detail(a).get("lease") == LEASE_NAME
    ]
    resigned = [
        {"at": float(a["at"]), "term": int(event_detail(a).get("term", 0)), "holder": a["actor"]}
        for a in leases
        if a["kind"] == "lease_resigned" and event_detail(a).get("lease") == LEASE_NAME
    ]
    terms = [tracker.terms[k] for k in sorted(tracker.terms)]
    rescued = [e for e in events if e["kind"] == "rescued"]
    overlaps = term_analysis(terms, rescued)
    mark_term_holders(inj.faults, terms)
    # Of the tasks still stored: a pruned task's requests went with it.
    requests = reader.rows(
        "SELECT outcome, COUNT(*) AS n FROM requests WHERE task_id IN "
        "(SELECT id FROM tasks WHERE substr(correlation_id, 1, ?) = ?) GROUP BY outcome",
        (len(prefix), prefix),
    )
    events_check = _events_check(run, tracker, first_event)
    operator = _operator_report(run, tasks, effects)
    retention = _retention_report(run, tracker, inj, tasks, t0)
    undo_kills = _undo_kill_report(run, inj, tasks)

    # -- failovers
    fo_kill = failover_samples(inj.faults, acq, ("kill", "kill_leader"))
    fo_stop = failover_samples(inj.faults, acq, ("stop_leader",))
    fo_term = failover_samples(inj.faults, acq, ("term_leader",))
    handovers = []
    for f in inj.faults:
        if f["kind"] != "term_leader":
            continue
        res = next((r for r in resigned if r["at"] >= f["at"] and r["term"] == f.get("term")), None)
        nxt = next(
            (a for a in acq if res is not None and a["at"] >= res["at"] and a["term"] > res["term"]), None
        )
        if res is not None and nxt is not None:
            handovers.append(nxt["at"] - res["at"])

    # -- rescue latency, and the subset no fault was slowing down (no leader outage, no DB fault)
    # Steps of a worker presumed dead are rescued before their complete-by: their latency from
    # complete-by would be negative, so they are reported apart (rescue -> retry dispatched).
    every_sample = rescue_samples(events)
    early = [s for s in every_sample if s["dead_worker"]]
    samples = [s for s in every_sample if not s["dead_worker"]]
    disturbed: list[tuple[float, float]] = []
    for s in fo_kill + fo_stop + fo_term:
        disturbed.append((s["at"], s["at"] + (s["failover"] if s["failover"] is not None else 60.0)))
    for f in inj.faults:
        if f["kind"] in DB_FAULTS:
            length = float(f.get("stall_s") or f.get("down_s") or 1.0) + lease.ttl + lease.retry_every
            disturbed.append((f["at"], f["at"] + length))
        if f["kind"] == "stop_worker":
            # A process paused inside a transaction commits its writes (with their earlier timestamps)
            # only when it resumes: a step it dispatched may become visible after its complete-by.
            disturbed.append((f["at"], f["at"] + float(f["hold_s"]) + sup.interval))
    quiet = [s for s in samples if not in_any(s["complete_by"], s["dispatched_at"], disturbed)]

    fault_counts = Counter(f["kind"] for f in inj.faults)
    kills_by_role = Counter(f["roles"] for f in inj.faults if f["kind"] in ("kill", "kill_leader"))
    svc_counts = run.services.stop()
    log_counts = run.workers.log_counts(
        {
            "fenced_sweeps_rejected": r"is no longer held by",
            "tracebacks": r"Traceback \(most recent call last\)",
        }
    )
    complete_by = longest_complete_by()
    target_rescue = 2 * sup.interval
    target_kill = lease.ttl + lease.renew_every
    target_term = lease.retry_every
    kill_fo = [s["failover"] for s in fo_kill if s["failover"] is not None]
    stop_fo = [s["failover"] for s in fo_stop if s["failover"] is not None]
    term_fo = [s["failover"] for s in fo_term if s["failover"] is not None]
    kill_fo_q = [s["failover"] for s in fo_kill if s["failover"] is not None and not s["disturbed"]]
    stop_fo_q = [s["failover"] for s in fo_stop if s["failover"] is not None and not s["disturbed"]]
    injected_total = sum(fault_counts.values())
    report: dict[str, Any] = {
        "store": o.store,
        "seed": o.seed,
        "workdir": str(run.workdir),
        "stepwarden": _version(),
        "note": o.note,
        "workers": {
            "slots": layout(o.workers),
            "processes_started": run.workers.started,
            "unexpected_exits": len(run.workers.unexpected),
            "crashes": sum(1 for u in run.workers.unexpected if u["phase"] == "running"),
            "startup_failures": sum(1 for u in run.workers.unexpected if u["phase"] == "startup"),
            "unexpected_exit_detail": run.workers.unexpected[:10],
            "stop_s": run.workers.stop_s,  # SIGTERM of every worker at the end -> all exited
            "killed_at_stop": run.workers.killed_at_stop,  # pids that outlived the 20 s and were SIGKILLed
        },
        "settings": {
            "complete_by_s": complete_by,
            "supervisor_interval_s": sup.interval,
            "lease_ttl_s": lease.ttl,
            "lease_renew_s": lease.renew_every,
            "lease_retry_s": lease.retry_every,
            "services": {
                "transient_rate": o.transient_rate if "services" in o.faults else 0.0,
                "hang_rate": o.hang_rate if "services" in o.faults else 0.0,
                "permanent_rate": o.permanent_rate if "services" in o.faults else 0.0,
                "hang_s": hang_seconds(o),
            },
            "fault_every_s": o.fault_every,
            "faults": list(o.faults),
        },
        "timing": {
            "injection_window_s": round(injected_until - t0, 2),
            "settle_s": round(settled_s, 2),
            "elapsed_s": round(end_wall - run_started, 2),
        },
        "tasks": {
            "planned": o.order_plan()[0],
            "submitted": len(sub.acked),
            "in_store": len(tasks) - len(pruned_rows),
            "pruned": len(pruned_rows),
            "unaccounted": len(unaccounted),
            "never_acknowledged": len(sub.unacked),
            "submit_errors_retried": sub.errors,
            "by_state": dict(sorted(by_state.items())),
            "throughput_per_s": round(len(tasks) / max(1e-9, end_wall - t0), 2),
        },
        "stuck": len(stuck_rows),
        "stuck_tasks": stuck_rows[:20],
        "lost": len(lost_ids) + ledger.lost,
        "lost_detail": {"not_in_store": lost_ids[:20], "processed_but_not_applied": ledger.lost},
        "duplicate_effects": ledger.duplicate_effects,
        "ledger": ledger.as_dict(),
        "retention": retention,
        "operator": operator,
        "kills_in_flight": undo_kills,
        "events": events_check,
        "faults": {
            "injected_total": injected_total,
            "by_kind": dict(sorted(fault_counts.items())),
            "kills_by_role": dict(sorted(kills_by_role.items())),
            "leader_kills": len(fo_kill),
            "ordinary_faults_that_hit_a_term_holder": sum(
                1
                for f in inj.faults
                if f["kind"] in ("kill", "stop_worker") and f.get("held_term") is not None
            ),
            "skipped": dict(sorted(inj.skipped.items())),
            "planned": len(plan),
            "services": dict(sorted(svc_counts.items())),
            "services_total": sum(svc_counts.values()),
            "notes": run.notes,
        },
        "stale_replies_rejected": kinds.get("stale_reply", 0),
        "fenced_sweeps_rejected": log_counts["fenced_sweeps_rejected"],
        "rescues": kinds.get("rescued", 0),
        "retries_scheduled": kinds.get("retry_scheduled", 0),
        "requests_by_outcome": {str(r["outcome"]): int(r["n"]) for r in requests},  # of stored tasks
        "rescue_latency_s": stats([s["latency"] for s in samples]),
        "rescue_latency_without_backoff_s": stats([s["machinery"] for s in samples]),
        "rescue_latency_without_backoff_undisturbed_s": stats([s["machinery"] for s in quiet]),
        "rescue_detection_s": stats([s["detection"] for s in samples]),
        "dead_worker_rescues": len(early),
        "dead_worker_rescue_to_dispatch_s": stats([s["dispatched_at"] - s["rescued_at"] for s in early]),
        "slowest_undisturbed_rescues": [
            {
                "task_id": s["task_id"],
                "step_idx": s["step_idx"],
                "attempt": s["attempt"],
                "t_complete_by": round(s["complete_by"] - t0, 3),
                "detection_s": round(s["detection"], 3),
                "backoff_s": round(s["backoff"], 3),
                "without_backoff_s": round(s["machinery"], 3),
            }
            for s in sorted(quiet, key=lambda s: -s["machinery"])[:10]
        ],
        "retry_backoff_s": stats([s["backoff"] for s in samples]),
        "failover_after_sigkill_s": stats(kill_fo) | {"unmeasured": len(fo_kill) - len(kill_fo)},
        "failover_after_sigkill_undisturbed_s": stats(kill_fo_q),
        "failover_after_sigstop_s": stats(stop_fo) | {"unmeasured": len(fo_stop) - len(stop_fo)},
        "failover_after_sigstop_undisturbed_s": stats(stop_fo_q),
        "failover_after_sigterm_s": stats(term_fo) | {"unmeasured": len(fo_term) - len(term_fo)},
        "handover_after_resign_s": stats(handovers),
        "leader_terms": overlaps,
        "leader_changes": max(0, len(acq) - 1),
        "log_tracebacks": log_counts["tracebacks"],
        "targets": {
            "rescue_without_backoff_le_s": target_rescue,
            "rescue_without_backoff_undisturbed_p99_met": _le(
                pct([s["machinery"] for s in quiet], 99), target_rescue
            ),
            "failover_after_sigkill_le_s": target_kill,
            "failover_after_sigkill_undisturbed_max_met": _le(
                max(kill_fo_q) if kill_fo_q else None, target_kill
            ),
            "failover_after_sigstop_undisturbed_max_met": _le(
                max(stop_fo_q) if stop_fo_q else None, target_kill
            ),
            "handover_after_resign_le_s": target_term,
            "handover_after_resign_max_met": _le(max(handovers) if handovers else None, target_term),
        },
        "fault_log": [
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in f.items() if k != "at"}
            for f in inj.faults
        ],
    }
    problems = []
    if not tasks or sub.unacked:
        problems.append(
            f"submissions failed: {len(tasks)} task(s) in the store, {len(sub.unacked)} order(s) never "
            f"acknowledged (last error: {sub.last_error or '-'})"
        )
    if report["stuck"]:
        problems.append(f"{report['stuck']} task(s) stuck")
    if report["lost"]:
        problems.append(f"{report['lost']} task(s) lost")
    if report["duplicate_effects"]:
        problems.append(f"{report['duplicate_effects']} duplicate effect(s)")
    if not ledger.ok:
        problems.extend(ledger.problems[:10])
    crashes = report["workers"]["crashes"]
    if crashes:
        problems.append(f"{crashes} running worker(s) crashed (REL3)")
    if overlaps["acting_overlaps"] or overlaps["fenced_writes_by_non_holder"]:
        problems.append(f"{overlaps['acting_overlaps']} acting overlap(s) of leader terms")
    if unaccounted:
        problems.append(
            f"{len(unaccounted)} task(s) pruned before the harness saw them final (blind for "
            f"{tracker.longest_blind_s:.1f}s at most): their outcome is unchecked"
        )
    if not events_check["complete"]:
        problems.append(
            f"the harness read {events_check['tracked']} of the run's {events_check['expected']} events:"
            " the figures and the leader-term check may miss some"
        )
    problems.extend(operator["problems"][:10])
    problems.extend(undo_kills["problems"][:10])
    report["problems"] = problems
    report["ok"] = not problems
    return report


def _cmp3_tasks(reader: Reader) -> set[int]:
    """Tasks whose compensation failed for good (CMP3: ``error`` with a ``compensation_failed``
    alert naming the step left un-undone): the outcome the spec gives an undo that exhausts its
    retries, so not a violation, but never an effect silently left."""
    rows = reader.rows("SELECT DISTINCT task_id FROM alerts WHERE kind = 'compensation_failed'")
    return {int(r["task_id"]) for r in rows if r["task_id"] is not None}


def _effects_left(effects: dict[str, dict[str, object]]) -> Counter[int]:
    """Task id -> how many of its effects are applied more often than undone, from the ledger."""
    left: Counter[int] = Counter()
    for key, e in effects.items():
        task, _, _ = key.rpartition(":")
        applied, undone = e.get("applied", 0), e.get("undone", 0)
        if task.isdigit() and isinstance(applied, int) and isinstance(undone, int) and applied > undone:
            left[int(task)] += 1
    return left


def undone_as_promised(state: str | None, tid: int, cmp3: set[int]) -> bool:
    """A task an operator cancelled, or whose undo was in flight when its worker was killed, ends
    undone (``cancelled``, ``compensated``), or in ``error`` with its compensation failed (CMP3)."""
    return state in ("cancelled", "compensated") or (state == "error" and tid in cmp3)


def _operator_report(
    run: Run, tasks: list[dict[str, Any]], effects: dict[str, dict[str, object]]
) -> dict[str, Any]:
    """The operator's actions and what became of their tasks.

    The cancelled tasks are those whose cancel the CLI acknowledged and those the store showed with
    ``cancel_requested`` (only the operator sets it; a cancel whose exit status was lost still
    counts). Each must end undone (``undone_as_promised``), with no effect of it left standing in
    the services' ledger; each acknowledged cancel must be recorded. Each retried task must end in
    a final state. Duplicates are the ledger's check, over every task."""
    assert run.reader is not None and run.tracker is not None
    actions = run.operator.actions if run.operator is not None else []
    final = {int(t["id"]): str(t["state"]) for t in tasks}
    requested = {tid for tid, t in run.tracker.tasks.items() if t["cancel_requested"]}
    acked_cancels = {a["task_id"] for a in actions if a["action"] == "cancel" and a["outcome"] == "accepted"}
    retried = {a["task_id"] for a in actions if a["action"] == "retry" and a["outcome"] == "accepted"}
    cancelled = acked_cancels | requested
    cmp3 = _cmp3_tasks(run.reader)
    left = _effects_left(effects)
    problems: list[str] = []
    for tid in sorted(acked_cancels - requested):
        problems.append(f"task {tid}: cancel acknowledged by the CLI but never recorded")
    for tid in sorted(cancelled):
        state = final.get(tid)
        if not undone_as_promised(state, tid, cmp3):
            problems.append(f"task {tid} was cancelled but ended {state}")
        elif state != "error" and left[tid]:
            problems.append(f"task {tid} ended {state} with {left[tid]} effect(s) still applied")
    for tid in sorted(retried):
        if final.get(tid) not in FINAL:
            problems.append(f"task {tid} was retried but is {final.get(tid)}, not final")

    def outcomes(action: str) -> dict[str, int]:
        c = Counter(a["outcome"] for a in actions if a["action"] == action)
        return {k: c.get(k, 0) for k in ("accepted", "refused", "failed")}

    return {
        "every_s": run.o.operator_every or None,
        "actions": len(actions),
        "skipped_no_target": run.operator.skipped if run.operator is not None else 0,
        "cancel": outcomes("cancel"),
        "retry": outcomes("retry"),
        "cancelled_tasks": len(cancelled),
        "cancelled_final_states": dict(sorted(Counter(str(final.get(t)) for t in cancelled).items())),
        "cancelled_undo_failed_cmp3": sum(1 for t in cancelled if final.get(t) == "error" and t in cmp3),
        "cancelled_with_effects_left": sum(1 for t in cancelled if final.get(t) != "error" and left[t]),
        "retried_tasks": len(retried),
        "retried_final_states": dict(sorted(Counter(str(final.get(t)) for t in retried).items())),
        "problems": problems,
        "log": actions[:300],
    }


def _undo_kill_report(run: Run, inj: Injector, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """SIGKILLs by what the victim had in flight, as the store showed right after each kill
    (``Injector.note_in_flight``); the tasks whose undo was in flight must end undone."""
    assert run.reader is not None
    kills = [f for f in inj.faults if f["kind"] in ("kill", "kill_leader")]
    known = [f for f in kills if f.get("in_flight") is not None]
    with_undo = [f for f in known if f["in_flight"]["undo"]]
    undo_tasks = sorted({t for f in with_undo for t in f.get("undo_tasks", [])})
    final = {int(t["id"]): str(t["state"]) for t in tasks}
    cmp3 = _cmp3_tasks(run.reader) if undo_tasks else set()
    problems = [
        f"task {tid}: its undo was in flight in a killed worker, and it ended {final.get(tid)}"
        for tid in undo_tasks
        if not undone_as_promised(final.get(tid), tid, cmp3)
    ]
    return {
        "kills": len(kills),
        "unknown": len(kills) - len(known),
        "with_undo_in_flight": len(with_undo),
        "aimed_at_undo": sum(1 for f in kills if f.get("aimed_at_undo")),
        "with_forward_step_in_flight": sum(1 for f in known if f["in_flight"]["do"]),
        "holding_compensating_tasks": sum(1 for f in known if f["in_flight"]["compensating_tasks_held"]),
        "undo_tasks": len(undo_tasks),
        "undo_tasks_final_states": dict(sorted(Counter(str(final.get(t)) for t in undo_tasks).items())),
        "problems": problems,
    }


def _retention_report(
    run: Run, tracker: Tracker, inj: Injector, tasks: list[dict[str, Any]], t0: float
) -> dict[str, Any]:
    """What the leader pruned during the run, and which leader faults came while it was pruning."""
    moments = tracker.prune_moments()
    first = moments[0] if moments else None
    leader_faults = [
        f
        for f in inj.faults
        if f["kind"] in LEADER_FAULTS or (f["kind"] == "kill" and f.get("held_term") is not None)
    ]
    pruned = [t for t in tasks if t["pruned"]]
    return {
        "retention_s": run.o.retention,
        "pruned_tasks": len(pruned),
        "pruned_by_state": dict(sorted(Counter(str(t["state"]) for t in pruned).items())),
        "unaccounted_tasks": [t["id"] for t in pruned if t["state"] not in TERMINAL][:20],
        "prunes_seen": len(moments),
        "first_prune_t": None if first is None else round(first - t0, 3),
        "leader_faults_after_first_prune": sum(
            1 for f in leader_faults if first is not None and f["at"] >= first
        ),
        "tracker": {
            "polls": tracker.polls,
            "failed_polls": tracker.failed_polls,
            "longest_blind_s": round(tracker.longest_blind_s, 3),
        },
    }


def _events_check(run: Run, tracker: Tracker, first_event: int) -> dict[str, Any]:
    """Did the tracker read every event of the run? It should have read those stored now plus those
    the prunes deleted meanwhile (``event_totals`` counts them in the deleting transaction), less
    the deleted ones written before the run (a reused ``--db``)."""
    assert run.reader is not None
    r = run.reader
    stored_new = int(r.rows("SELECT COUNT(*) AS n FROM events WHERE id > ?", (first_event,))[0]["n"])
    stored_old = int(r.rows("SELECT COUNT(*) AS n FROM events WHERE id <= ?", (first_event,))[0]["n"])
    pruned_during = pruned_total(r) - run.pruned_before
    expected = stored_new + pruned_during - (run.events_before - stored_old)
    tracked = sum(tracker.kinds.values())  # each event read once
    return {
        "tracked": tracked,
        "expected": expected,
        "complete": tracked == expected,
        "stored_at_end": stored_new,
        "pruned_during_run": pruned_during,
    }


def _version() -> dict[str, Any]:
    """Which code ran: the package's location, and the repository's commit when it is a checkout."""
    import stepwarden

    out: dict[str, Any] = {"path": str(Path(stepwarden.__file__).resolve().parent)}
    with contextlib.suppress(Exception):
        git = ["git", "-C", out["path"]]
        out["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        out["dirty"] = bool(
            subprocess.run(
                [*git, "status", "--porcelain", "--", "."], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        )
    return out


def _le(value: float | None, limit: float) -> bool | None:
    return None if value is None else value <= limit


# -- output --------------------------------------------------------------------------------------


def summary_lines(r: dict[str, Any]) -> list[str]:
    def fmt(s: dict[str, Any]) -> str:
        if not s.get("n"):
            return "n=0"
        return f"p50 {s['p50']:.2f}s  p99 {s['p99']:.2f}s  max {s['max']:.2f}s  (n={s['n']})"

    t = r["tasks"]
    f = r["faults"]
    lt = r["leader_terms"]
    k, rt, op = r["kills_in_flight"], r["retention"], r["operator"]
    return [
        f"store {r['store']}  seed {r['seed']}  workers {r['workers']['slots']}  "
        f"elapsed {r['timing']['elapsed_s']}s (injection {r['timing']['injection_window_s']}s, "
        f"settle {r['timing']['settle_s']}s)",
        f"tasks: submitted {t['submitted']}, by final state {t['by_state']} ({t['pruned']} of them pruned)",
        f"stuck {r['stuck']}  lost {r['lost']}  duplicate effects {r['duplicate_effects']}  "
        f"acting overlaps {lt['acting_overlaps']}  (ledger ok: {r['ledger']['ok']})",
        f"faults injected: {f['injected_total']} {f['by_kind']}  kills by role {f['kills_by_role']}",
        f"services' faults: {f['services_total']} {f['services']}",
        f"stale replies rejected {r['stale_replies_rejected']}  fenced sweeps rejected "
        f"{r['fenced_sweeps_rejected']}  rescues {r['rescues']}  leader terms {lt['terms']}",
        f"rescue latency (complete-by -> retry dispatched): {fmt(r['rescue_latency_s'])}",
        f"  without the policy's back-off: {fmt(r['rescue_latency_without_backoff_s'])}; "
        f"undisturbed: {fmt(r['rescue_latency_without_backoff_undisturbed_s'])} "
        f"(target <= {r['targets']['rescue_without_backoff_le_s']}s)",
        f"failover after SIGKILL of the leader: {fmt(r['failover_after_sigkill_s'])}; undisturbed "
        f"{fmt(r['failover_after_sigkill_undisturbed_s'])} "
        f"(target <= {r['targets']['failover_after_sigkill_le_s']}s)",
        f"failover after SIGSTOP of the leader: {fmt(r['failover_after_sigstop_s'])}; undisturbed "
        f"{fmt(r['failover_after_sigstop_undisturbed_s'])}",
        f"failover after SIGTERM of the leader: {fmt(r['failover_after_sigterm_s'])}; "
        f"resign -> next leader {fmt(r['handover_after_resign_s'])} "
        f"(target <= {r['targets']['handover_after_resign_le_s']}s)",
        f"worker crashes {r['workers']['crashes']}, failed starts {r['workers']['startup_failures']}  "
        f"tracebacks in logs {r['log_tracebacks']}",
        f"kills: {k['kills']}, with an undo in flight {k['with_undo_in_flight']} "
        f"(aimed {k['aimed_at_undo']}; {k['undo_tasks']} task(s), ended {k['undo_tasks_final_states']}), "
        f"with a forward step in flight {k['with_forward_step_in_flight']}, holding compensating "
        f"tasks {k['holding_compensating_tasks']}, unknown {k['unknown']}",
        f"retention {rt['retention_s'] if rt['retention_s'] is not None else 'default'}: pruned "
        f"{rt['pruned_tasks']} task(s) {rt['pruned_by_state']} in {rt['prunes_seen']} prune(s) seen, "
        f"leader faults after the first {rt['leader_faults_after_first_prune']}; unaccounted "
        f"{t['unaccounted']}; events read {r['events']['tracked']}/{r['events']['expected']}",
        f"operator: {op['actions']} action(s), cancel {op['cancel']}, retry {op['retry']}; cancelled "
        f"tasks ended {op['cancelled_final_states']}, retried ended {op['retried_final_states']}",
        ("OK" if r["ok"] else "FAILED: " + "; ".join(r["problems"])),
    ]
