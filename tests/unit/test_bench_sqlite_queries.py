"""bench/sqlite_queries.py: one small W1 run on SQLite, timed query by query in the submitting
process and in the worker (a real ``stepwarden worker`` subprocess that writes its times when it
stops)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
TASKS = 40
WARM_UP = 4  # the harness's own warm-up submissions, one per worker times four


def test_a_w1_run_is_timed_query_by_query_in_both_processes(tmp_path: Path) -> None:
    out = tmp_path / "times.json"
    run = subprocess.run(
        [sys.executable, str(BENCH / "sqlite_queries.py"), "--tasks", str(TASKS), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["run"]["not_processed"] == 0
    submitter = {r["key"]: r for r in doc["submitter"]}
    worker = {r["key"]: r for r in doc["worker"]}
    # Every submission is one transaction with its insert and its `received` event.
    assert submitter["TX submit"]["calls"] == TASKS + WARM_UP
    assert submitter["insert_task"]["calls"] == TASKS + WARM_UP
    assert submitter["kept insert_event"]["rows"] == TASKS + WARM_UP
    assert submitter["insert_step"]["calls"] == TASKS + WARM_UP  # sent at once (Tx.put), not deferred
    # The worker claimed, dispatched, completed and finished each task: four events apiece, in
    # the transactions of its scheduler rounds and reply batches.
    assert worker["kept insert_event"]["rows"] >= 4 * (TASKS + WARM_UP)
    assert worker["deferred insert_request"]["rows"] == TASKS + WARM_UP
    for times in (submitter, worker):  # a transaction's statements are a part of it
        for key, r in times.items():
            if key.startswith("TX ") and not key.endswith(" statements"):
                assert 0 <= times[key + " statements"]["s"] <= r["s"], key
    assert submitter["TX submit statements"]["s"] > 0
    assert worker["TX send_all statements"]["s"] > 0
    text = run.stdout
    assert "the submitting process" in text and "the worker (" in text
    assert any(line.endswith("TX submit") for line in text.splitlines())
