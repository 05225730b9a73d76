"""W3's harness: the operation's ledger is ready before a worker's slots open it together, and a
task that did not end ``processed`` is shown with its own account in the results."""

from __future__ import annotations

import importlib.util
import sqlite3
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


@pytest.fixture(scope="module")
def slow() -> ModuleType:
    return _load("benchapp_slow")


class Req:
    idempotency_key = "1:0"
    task_id = 1
    attempt = 1


def test_the_ledger_is_made_in_wal_mode_and_eight_slots_record_at_once(
    slow: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = tmp_path / "ledger.db"
    slow.prepare_ledger(str(ledger))
    conn = sqlite3.connect(ledger)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    monkeypatch.setattr(slow, "LEDGER", str(ledger))
    errors: list[BaseException] = []

    def execute() -> None:
        try:
            slow.record("start", Req())
        except BaseException as e:  # collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=execute) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert conn.execute("SELECT count(*) FROM executions WHERE phase = 'start'").fetchone()[0] == 8
    conn.close()


def test_a_task_w3_did_not_process_is_listed_with_its_events() -> None:
    run = _load("run")
    res = run.Results(Path("/nonexistent/r.json"), Path("/nonexistent/r.md"), {"machine": {}})
    unfinished: dict[str, Any] = {
        "task_id": 17,
        "state": "error",
        "last_error": "OperationalError: database is locked",
        "events": ["received", "claimed by=w1", "error attempt=1 by=w1"],
    }
    key = {"system": "stepwarden", "store": "postgres", "workload": "w3", "workers": 1}
    run_row = {
        "rep": 3,
        "lost": 1,
        "duplicated_executions": 0,
        "duplicated_completions": 0,
        "orphaned_steps": 8,
        "rescue_s": {"first": 0.3, "median": 0.3, "last": 0.3},
        "all_final_after_kill_s": 4.7,
        "unfinished_tasks": [unfinished],
    }
    res.series["w3"] = {**key, "runs": [run_row]}
    res.meta.update(
        date="d",
        command="c",
        settings={},
        machine={
            "cores": 2,
            "cpu": "x",
            "memory_gib": 1,
            "platform": "p",
            "python": "3",
            "sqlite": "3",
            "load_start": 0,
            "note": "",
        },
    )
    text = run.markdown(res, {**res.meta, "summary": run.summarise(res)})
    assert (
        "- postgres, rep 3: task 17 `error` (OperationalError: database is locked): "
        "received; claimed by=w1; error attempt=1 by=w1"
    ) in text
