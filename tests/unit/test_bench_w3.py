"""W3's harness: the operation's ledger is ready before a worker's slots open it together (the
results' list of unfinished tasks is tested with the summary, in test_bench_summary.py)."""

from __future__ import annotations

import importlib.util
import sqlite3
import threading
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def slow() -> ModuleType:
    """bench/benchapp_slow.py, W3's application (it imports only stepwarden)."""
    spec = importlib.util.spec_from_file_location("benchapp_slow_under_test", BENCH / "benchapp_slow.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
