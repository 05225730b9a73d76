"""The benchmark harness's summary: the ratios the performance doc quotes are taken per repetition,
and issue 5's goals are set against the ceilings measured in the same repetition (submission alone,
the raw-SQL floors of W1 and W2)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "run.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_run_under_test", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def results(bench: ModuleType, tmp_path: Path, series: list[tuple[dict[str, Any], list[float]]]) -> Any:
    res = bench.Results(tmp_path / "r.json", tmp_path / "r.md", {"machine": {}})
    for key, rates in series:
        for rep, rate in enumerate(rates, 1):
            res.series.setdefault(json.dumps(key, sort_keys=True), {**key, "runs": []})["runs"].append(
                {"rep": rep, "rate": rate, "submit_rate": rate}
            )
    return res


def render(bench: ModuleType, res: Any) -> str:
    """The run's Markdown, as bench/run.py writes it, with a made-up machine."""
    machine = {"cores": 2, "cpu": "x", "memory_gib": 1, "platform": "p", "python": "3", "sqlite": "3"}
    res.meta.update(date="d", command="c", settings={}, machine={**machine, "load_start": 0, "note": ""})
    return str(bench.markdown(res, {**res.meta, "summary": bench.summarise(res)}))


def by_what(summary: dict[str, Any], what: str, store: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [r for r in summary["ratios"] if r["what"] == what and r["store"] == store]
    assert len(found) == 1, summary["ratios"]
    return found[0]


def test_the_goal_is_set_against_submission_alone_in_each_repetition(
    bench: ModuleType, tmp_path: Path
) -> None:
    res = results(
        bench,
        tmp_path,
        [
            ({"system": "huey", "store": "sqlite", "workload": "w1", "workers": 1}, [1500, 1800, 2000]),
            (
                {"system": "stepwarden", "store": "sqlite", "workload": "submit", "workers": 0},
                [3000, 3000, 2000],
            ),
            ({"system": "stepwarden", "store": "sqlite", "workload": "w1", "workers": 1}, [1500, 1200, 1000]),
        ],
    )
    s = bench.summarise(res)
    goal = by_what(s, "issue 5's W1 goal (2x huey) / submission alone", "sqlite")
    # 2 x 1500/3000, 2 x 1800/3000, 2 x 2000/2000: taken per repetition, not from the medians
    assert (goal["min"], goal["median"], goal["max"], goal["n"]) == (1.0, 1.2, 2.0, 3)
    w1 = by_what(s, "stepwarden w1 / submission alone", "sqlite")
    assert (w1["min"], w1["median"], w1["max"]) == (0.4, 0.5, 0.5)


def test_no_goal_without_the_peer_or_the_submission_run(bench: ModuleType, tmp_path: Path) -> None:
    res = results(
        bench,
        tmp_path,
        [
            ({"system": "stepwarden", "store": "postgres", "workload": "submit", "workers": 0}, [2300]),
            ({"system": "huey", "store": "sqlite", "workload": "w1", "workers": 1}, [1500]),
        ],
    )
    assert not [r for r in bench.summarise(res)["ratios"] if "goal" in r["what"]]


def test_the_table_shows_submission_alone_and_the_goal(bench: ModuleType, tmp_path: Path) -> None:
    res = results(
        bench,
        tmp_path,
        [
            ({"system": "procrastinate", "store": "postgres", "workload": "w1", "workers": 1}, [540]),
            ({"system": "stepwarden", "store": "postgres", "workload": "submit", "workers": 0}, [2160]),
        ],
    )
    text = render(bench, res)
    assert (
        "| stepwarden (submission alone, no worker) | postgres | W1's submissions | 0 | — | — | 2160 |"
        in text
    )
    assert "| issue 5's W1 goal (4x procrastinate) / submission alone | postgres | — | 1 |" in text


def test_each_goal_and_stepwarden_are_set_against_the_floor_of_their_own_workload(
    bench: ModuleType, tmp_path: Path
) -> None:
    res = results(
        bench,
        tmp_path,
        [
            ({"system": "procrastinate", "store": "postgres", "workload": "w1", "workers": 1}, [500, 600]),
            ({"system": "procrastinate", "store": "postgres", "workload": "w2", "workers": 1}, [150, 200]),
            ({"system": "floor", "store": "postgres", "workload": "w1", "workers": 1}, [2500, 2000]),
            ({"system": "floor", "store": "postgres", "workload": "w2", "workers": 1}, [1000, 800]),
            ({"system": "stepwarden", "store": "postgres", "workload": "w1", "workers": 1}, [1250, 1200]),
            ({"system": "stepwarden", "store": "postgres", "workload": "w2", "workers": 1}, [600, 400]),
        ],
    )
    s = bench.summarise(res)
    g1 = by_what(s, "issue 5's W1 goal (4x procrastinate) / raw floor", "postgres")
    assert (g1["min"], g1["max"], g1["n"]) == (0.8, 1.2, 2)  # 4 x 500/2500, 4 x 600/2000
    g2 = by_what(s, "issue 5's W2 goal (4x procrastinate) / raw floor", "postgres")
    assert (g2["min"], g2["max"], g2["n"]) == (0.6, 1.0, 2)  # 4 x 150/1000, 4 x 200/800
    w2 = by_what(s, "stepwarden w2 / raw floor", "postgres")
    assert (w2["min"], w2["max"]) == (0.5, 0.6)  # 600/1000, 400/800: W2's floor, not W1's
    w1 = by_what(s, "stepwarden w1 / raw floor", "postgres")
    assert (w1["min"], w1["max"]) == (0.5, 0.6)
    # no submission-alone run: that goal is left out, the others stand
    assert not [r for r in s["ratios"] if r["what"].endswith("submission alone")]


def test_a_goal_is_scaled_in_each_repetition_before_it_is_rounded(bench: ModuleType, tmp_path: Path) -> None:
    res = results(
        bench,
        tmp_path,
        [
            ({"system": "procrastinate", "store": "postgres", "workload": "w1", "workers": 1}, [533]),
            ({"system": "floor", "store": "postgres", "workload": "w1", "workers": 1}, [2693]),
        ],
    )
    goal = by_what(bench.summarise(res), "issue 5's W1 goal (4x procrastinate) / raw floor", "postgres")
    assert goal["median"] == 0.79  # 4 x 533 / 2693 = 0.7917; rounding 533 / 2693 first gave 4 x 0.20


def test_the_floor_runs_each_chain_of_steps_to_its_end_once(bench: ModuleType, tmp_path: Path) -> None:
    """W2's raw floor: each job queues its chain's next step in the transaction that completes it,
    so three-step chains end with three done jobs each, and the finished count sees only the ends."""
    floor = sys.modules["floor"]
    url = f"sqlite:///{tmp_path / 'floor.db'}"
    floor.setup(url)
    floor.produce(url, 5, steps=3)
    floor.produce(url, 2)  # W1's one-step jobs
    proc = subprocess.Popen([sys.executable, str(BENCH.parent / "floor.py"), "consume", "--db", url])
    conn = floor.connect(url)
    try:
        deadline = time.monotonic() + 30
        while conn.execute(floor.FINISHED).fetchone()[0] < 7:
            assert time.monotonic() < deadline, "the floor's consumer did not finish 7 chains in 30 s"
            time.sleep(0.02)
        rows = conn.execute(
            "SELECT steps, step, state, count(*) FROM jobs GROUP BY 1, 2, 3 ORDER BY 1, 2"
        ).fetchall()
    finally:
        proc.terminate()
        code = proc.wait(30)
        conn.close()
    assert code == 0  # it stops on SIGTERM, as the harness stops it
    assert rows == [(1, 0, "done", 2), (3, 0, "done", 5), (3, 1, "done", 5), (3, 2, "done", 5)]


def test_a_task_w3_did_not_process_is_listed_with_its_events(bench: ModuleType, tmp_path: Path) -> None:
    res = results(bench, tmp_path, [])
    unfinished = {
        "task_id": 17,
        "state": "error",
        "last_error": "OperationalError: database is locked",
        "events": ["received", "claimed by=w1", "error attempt=1 by=w1"],
    }
    run = {
        "rep": 3,
        "lost": 1,
        "duplicated_executions": 0,
        "duplicated_completions": 0,
        "orphaned_steps": 8,
        "rescue_s": {"first": 0.3, "median": 0.3, "last": 0.3},
        "all_final_after_kill_s": 4.7,
        "unfinished_tasks": [unfinished],
    }
    key = {"system": "stepwarden", "store": "postgres", "workload": "w3", "workers": 1}
    res.series["w3"] = {**key, "runs": [run]}
    assert (
        "- postgres, rep 3: task 17 `error` (OperationalError: database is locked): "
        "received; claimed by=w1; error attempt=1 by=w1"
    ) in render(bench, res)


@pytest.fixture(scope="module")
def cpu(bench: ModuleType) -> ModuleType:
    return sys.modules["cpu"]  # imported by run.py from bench/


def test_a_servers_cpu_counts_the_backends_that_already_exited(cpu: ModuleType) -> None:
    """A PostgreSQL backend lives as long as its connection: what one spent before it exited
    must still count, through its parent's reaped-children time."""
    me = os.getpid()
    before = cpu.tree_cpu(me)
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass"]
    )
    child.wait(30)  # reaped: its time is now in this process's cutime/cstime
    after = cpu.tree_cpu(me)
    assert before is not None and after is not None
    assert after - before >= 0.25
    assert cpu.tree_cpu(2**22 + 7) is None  # no such process: unknown, not zero


def test_the_meter_gives_cpu_per_task_and_cores_busy(cpu: ModuleType) -> None:
    readings = {"cpu_workers": iter([1.0, 2.5]), "cpu_server": iter([4.0, 5.5])}
    meter = cpu.CpuMeter({k: it.__next__ for k, it in readings.items()}, clock=iter([100.0, 102.0]).__next__)
    meter.start()
    out = meter.stop(1000)
    # 1.5 s each over 1,000 tasks, 3 s of CPU in 2 s of wall time
    assert out == {"cpu_workers_ms": 1.5, "cpu_server_ms": 1.5, "cpu_total_ms": 3.0, "cores_busy": 1.5}
    lost = cpu.CpuMeter(
        {"cpu_workers": iter([1.0, 2.0]).__next__, "cpu_server": iter([1.0, None]).__next__},
        clock=iter([0.0, 1.0]).__next__,
    )
    lost.start()
    assert lost.stop(10) == {
        "cpu_workers_ms": 100.0,
        "cpu_server_ms": None,
        "cpu_total_ms": None,
        "cores_busy": None,
    }


def test_the_table_shows_where_the_cpu_goes_and_the_goals_budget(bench: ModuleType, tmp_path: Path) -> None:
    res = results(
        bench,
        tmp_path,
        [
            ({"system": "procrastinate", "store": "postgres", "workload": "w1", "workers": 1}, [500]),
            ({"system": "stepwarden", "store": "postgres", "workload": "w1", "workers": 1}, [1300]),
        ],
    )
    run = next(s for s in res.series.values() if s["system"] == "stepwarden")["runs"][0]
    run.update(
        cpu_submitter_ms=0.25, cpu_workers_ms=0.4, cpu_server_ms=0.65, cpu_total_ms=1.3, cores_busy=1.69
    )
    lines = bench.cpu_table(res, 2)
    assert "| stepwarden | postgres | W1 | 1 | 0.25 | 0.4 | 0.65 | 1.3 | 1.69 |" in lines
    # 4 x 500 tasks/s on 2 cores: 1 ms per task at most
    assert any(
        "2,000 tasks/s" in line and "= 1.000 ms" in line and "with 1 worker(s) 1.3 ms" in line
        for line in lines
    )
    assert bench.cpu_table(results(bench, tmp_path, []), 2) == []  # nothing measured, no section


def test_reply_counters_are_read_from_a_workers_metrics_text(bench: ModuleType) -> None:
    text = "\n".join(
        [
            "# HELP stepwarden_worker_requests_completed_total Replies sent by this process's agents.",
            "# TYPE stepwarden_worker_requests_completed_total counter",
            "stepwarden_worker_requests_completed_total 6008.0",
            "stepwarden_worker_requests_completed_created 1.7e+09",
            "# TYPE stepwarden_worker_reply_batches_total counter",
            "stepwarden_worker_reply_batches_total 751.0",
            'stepwarden_worker_inflight{agent="noop"} 8.0',
        ]
    )
    assert bench.parse_reply_counters(text) == (6008.0, 751.0)
    assert bench.parse_reply_counters("") == (0.0, 0.0)  # an older worker: no figure, not an error


def test_replies_per_transaction_are_reported_per_series(bench: ModuleType, tmp_path: Path) -> None:
    key = {"system": "stepwarden", "store": "postgres", "workload": "w2", "workers": 1}
    res = results(bench, tmp_path, [(key, [560.0, 540.0, 350.0])])
    runs = next(iter(res.series.values()))["runs"]
    for run, per in zip(runs, (8.0, 7.9, 4.0), strict=True):
        run["replies_per_batch"] = per
    md = render(bench, res)
    assert "## Replies per reply transaction (stepwarden)" in md
    assert "| stepwarden | postgres | W2 | 1 | 7.9 (4-8) |" in md


def _serve(body: str) -> tuple[Any, str]:
    """A loopback HTTP server answering every GET with ``body`` (a worker's metrics page)."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/metrics"


def test_reply_counters_sum_the_workers_and_give_up_on_one_that_does_not_answer(
    bench: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    one, url1 = _serve(
        "stepwarden_worker_requests_completed_total 80\nstepwarden_worker_reply_batches_total 10\n"
    )
    two, url2 = _serve(
        "stepwarden_worker_requests_completed_total 16\nstepwarden_worker_reply_batches_total 4\n"
    )
    try:
        assert bench.reply_counters([url1, url2]) == (96.0, 14.0)
        two.shutdown()
        two.server_close()
        assert bench.reply_counters([url1, url2]) is None  # no figure rather than a wrong one
        assert f"worker metrics at {url2} did not answer" in capsys.readouterr().out
    finally:
        one.shutdown()
        one.server_close()


def test_metrics_urls_are_read_from_what_each_worker_printed(bench: ModuleType, tmp_path: Path) -> None:
    logs = [tmp_path / "worker-0.log", tmp_path / "worker-1.log"]
    logs[0].write_text("worker metrics on http://127.0.0.1:40001/metrics\n")
    logs[1].write_text("starting\n")
    with pytest.raises(TimeoutError):
        bench.metrics_urls(logs, [], timeout=0.2)  # one has not said it yet
    logs[1].write_text("starting\nworker metrics on http://127.0.0.1:40002/metrics\n")
    assert bench.metrics_urls(logs, []) == [
        "http://127.0.0.1:40001/metrics",
        "http://127.0.0.1:40002/metrics",
    ]


def test_the_machine_section_carries_the_calibration_probes(bench: ModuleType, tmp_path: Path) -> None:
    """Runs on different machines (s37's EPYC, s39's Xeon) differ by more than the CPU's name:
    each run records how fast plain Python runs and what a durable SQLite commit costs."""
    m = bench.machine(None, tmp_path)
    assert 0 < m["python_loop_s"] < 30
    assert 0 < m["sqlite_commit_us"] < 1_000_000
    assert not list((tmp_path / "calibrate").iterdir())  # the probe's database is removed
    res = results(bench, tmp_path, [])
    res.meta.update(date="d", command="c", settings={}, machine={**m, "note": ""})
    text = str(bench.markdown(res, {**res.meta, "summary": bench.summarise(res)}))
    assert f"took {m['python_loop_s']} s; a one-row SQLite commit" in text
    assert f"{m['sqlite_commit_us']} µs" in text
    # A run recorded before the probes existed renders without the line.
    assert "calibration" not in render(bench, results(bench, tmp_path, []))
