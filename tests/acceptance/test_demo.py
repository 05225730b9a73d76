"""``stepwarden demo --json`` end to end (SPEC section 4): the summary's shape and its consistency check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .helpers import FINAL, WORKFLOW, Db, Procs, clean_env, make_db, sw, wait_until

SUMMARY_KEYS = {
    "orders",
    "processed",
    "error",
    "compensated",
    "stuck",
    "duplicate_effects",
    "lost",
    "rescued",
    "leader_changes",
    "elapsed_s",
}


def run_demo(tmp_path: Path, *args: str, global_db: bool, pg: str | None = None) -> tuple[dict[str, Any], Db]:
    """Run the demo on a store in tmp_path (its work folder too, through TMPDIR), or on the PostgreSQL
    database ``pg``; returns its summary."""
    db = Db(tmp_path / "demo.db", tmp_path, pg)
    where = ("--db", db.url, "demo") if global_db else ("demo", "--db", db.url)
    r = sw(*where, *args, "--json", cwd=tmp_path, env=clean_env(TMPDIR=str(tmp_path)), timeout=240)
    lines = r.stdout_lines
    assert lines, f"demo printed nothing on stdout\n{r}"
    try:
        summary = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"the last line of stdout is not JSON\n{r}")
    assert isinstance(summary, dict), summary
    assert r.returncode == 0, f"demo exited {r.returncode}; summary: {summary}\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return summary, db


def check_summary(summary: dict[str, Any], orders: int, db: Db) -> None:
    assert summary.keys() >= SUMMARY_KEYS, sorted(SUMMARY_KEYS - summary.keys())
    assert summary["orders"] == orders
    assert summary["stuck"] == 0 and summary["lost"] == 0 and summary["duplicate_effects"] == 0, summary
    assert summary["processed"] + summary["error"] + summary["compensated"] == orders, summary
    assert isinstance(summary["elapsed_s"], int | float) and summary["elapsed_s"] > 0
    # The store it names agrees: every order is one task of the demo's workflow, each in a final state.
    tasks = db.json("tasks", "--json")
    assert len(tasks) == orders
    assert {t["workflow"] for t in tasks} == {WORKFLOW}
    assert all(t["state"] in FINAL for t in tasks)
    by_state = {s: sum(t["state"] == s for t in tasks) for s in ("processed", "error", "compensated")}
    assert by_state == {s: summary[s] for s in by_state}, (by_state, summary)
    assert len({t["correlation_id"] for t in tasks}) == orders, "the correlation id is the order id"


def test_demo_with_chaos(tmp_path: Path) -> None:
    summary, db = run_demo(tmp_path, "--orders", "40", global_db=False)
    check_summary(summary, 40, db)
    assert summary["rescued"] >= 1, f"killing a worker mid-run must leave attempts to rescue: {summary}"
    assert summary["leader_changes"] >= 1, f"the killed worker led the supervisors: {summary}"


def test_demo_without_chaos(tmp_path: Path) -> None:
    summary, db = run_demo(tmp_path, "--orders", "20", "--no-chaos", global_db=True)
    check_summary(summary, 20, db)


def test_demo_on_postgres(tmp_path: Path, pg_url: str) -> None:
    summary, db = run_demo(tmp_path, "--orders", "40", global_db=False, pg=pg_url)
    check_summary(summary, 40, db)
    assert summary["rescued"] >= 1 and summary["leader_changes"] >= 1, summary
    assert summary["store"].startswith("postgresql://"), summary


def test_a_failed_ledger_check_exits_1_and_says_what_failed(tmp_path: Path, procs: Procs) -> None:
    """A worker of someone else's on the demo's store (here the demo's own app, talking to other
    services) takes some of its steps: their effects never reach the demo's ledger. The demo
    warns before it starts, reports the lost orders, and exits 1 (scripts and CI rely on it)."""
    db = make_db(tmp_path, "shared.db")
    other = procs.worker(db, procs.services(), "impostor")
    wait_until(lambda: db.json("workers", "--json"), 30, "the other worker's heartbeat")
    # one demo worker against the other's agents: it takes some of the 60 steps, all but surely
    r = sw(
        "--db", db.url, "demo", "--orders", "20", "--workers", "1", "--no-chaos", cwd=tmp_path, timeout=240
    )
    assert other.poll() is None, procs.log_of(other)
    assert r.returncode == 1, str(r)
    assert "Traceback" not in r.stdout + r.stderr, str(r)
    assert "1 worker(s) not started by the demo are live on this store" in r.stdout, r.stdout[-3000:]
    failed = [x for x in r.stdout_lines if x.startswith("ledger check FAILED")]
    assert failed and "lost" in failed[0], r.stdout[-3000:]
    assert "passed" not in r.stdout


def test_the_demo_ignores_stepwarden_db_and_runs_on_a_fresh_file(tmp_path: Path) -> None:
    """$STEPWARDEN_DB may name a real store: the demo's orders must not land in it unless the
    command line names it."""
    mine = make_db(tmp_path, "mine.db")
    before = mine.snapshot()
    env = clean_env(STEPWARDEN_DB=mine.url, TMPDIR=str(tmp_path))
    r = sw("demo", "--orders", "3", "--no-chaos", "--json", cwd=tmp_path, env=env, timeout=240)
    assert r.returncode == 0, str(r)
    summary = json.loads(r.stdout_lines[-1])
    assert summary["store"] != mine.url and summary["store"].startswith(f"sqlite:///{tmp_path}"), summary
    assert "not $STEPWARDEN_DB" in r.stderr, r.stderr
    assert mine.snapshot() == before, "the demo wrote to the store named by $STEPWARDEN_DB"
