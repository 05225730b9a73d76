"""``stepwarden demo --json`` end to end (SPEC section 4): the summary's shape and its consistency check."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from stepwarden.liveness import proc_start

from .helpers import (
    FINAL,
    SW,
    WORKFLOW,
    Db,
    Procs,
    clean_env,
    make_db,
    register_demo_workflows,
    submit_in_process,
    sw,
    wait_until,
)

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
    # The warning (on stderr, naming the worker) and the error line are on stderr; the summary
    # on stdout says what failed. The exit-1 run had said nothing on stderr.
    warned = [x for x in r.stderr_lines if "1 worker(s) not started by the demo are live" in x]
    assert warned and "impostor" in warned[0], str(r)
    assert r.stderr_lines[-1] == "error: the demo's ledger check failed: see the summary for what", str(r)
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


def test_the_demo_refuses_a_store_with_unfinished_tasks_and_writes_nothing(tmp_path: Path) -> None:
    """Found by review: given a store where an interrupted demo had left orders pending, the
    demo's workers finished them against this run's services and the ledger check failed on
    "effects of no known order"; another application's pending task was taken by the demo's
    scheduler (and, its worker stopped, later charged a failed attempt). Refused now, before
    anything starts or is written, with one line that says what to do."""
    db = make_db(tmp_path, "busy.db")
    register_demo_workflows(db.url)
    submit_in_process(db.url)
    before = db.snapshot()
    r = sw(
        "demo",
        "--db",
        db.url,
        "--orders",
        "3",
        "--no-chaos",
        cwd=tmp_path,
        env=clean_env(TMPDIR=str(tmp_path)),
    )
    assert r.returncode == 2, str(r)
    assert r.stderr_lines == [
        f"error: the store {db.url} has 1 unfinished task(s) (1 of {WORKFLOW}): the demo's workers would"
        " run them, and its ledger check would count their effects; give the demo a store of its"
        " own (leave out --db for a fresh one), or let the tasks finish first"
    ], str(r)
    assert db.snapshot() == before
    assert not list(tmp_path.glob("stepwarden-demo-*")), "a refused demo made its work folder"


def _stat(pid: int) -> tuple[int, str] | None:
    """``(parent pid, start time)`` of a process, from /proc (None: no such process). The start
    time tells a process from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[19]  # ppid, starttime (fields 4 and 22 of proc(5))


def _children(pid: int) -> dict[int, str]:
    """The live children of ``pid``, with their start times."""
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] == pid:
                out[int(entry)] = st[1]
    return out


# Runs the demo with SIGHUP as the test wants it, whatever this process inherited: a test run
# under nohup (or from a CI runner that ignores SIGHUP) passes the ignored SIGHUP on to every
# child, and the demo rightly keeps an ignored SIGHUP ignored.
_SIGHUP_AS = (
    "import os, signal, sys;"
    " signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[1] == 'ignored' else signal.SIG_DFL);"
    " os.execv(sys.argv[2], sys.argv[2:])"
)


class _Demo:
    """``stepwarden demo --orders 1000 --no-chaos`` in the background, with SIGHUP ``default`` or
    ``ignored`` (as under nohup); the processes it starts are recorded as they appear."""

    def __init__(self, tmp_path: Path, sighup: str) -> None:
        self.out_path, self.err_path = tmp_path / "demo.out", tmp_path / "demo.err"
        self.seen: dict[int, str] = {}
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SIGHUP_AS, sighup, str(SW), "demo", "--orders", "1000", "--no-chaos"],
                cwd=tmp_path,
                env=clean_env(TMPDIR=str(tmp_path)),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
            )

    def progress_lines(self) -> int:
        return len(re.findall(r"final \d+/1000", self.out_path.read_text()))

    def wait_running(self) -> None:
        def running() -> bool:
            """Its services and three workers run, and it has shown its progress once."""
            assert self.proc.poll() is None, (
                f"the demo exited {self.proc.returncode}: {self.err_path.read_text()[-2000:]}"
            )
            self.seen.update(_children(self.proc.pid))
            return len(_children(self.proc.pid)) >= 4 and self.progress_lines() > 0

        wait_until(running, 60, "the demo to run its services and workers and show its progress", 0.05)

    def stopped_by(self, sig: signal.Signals) -> None:
        """Send ``sig``: the demo stops every process it started, by pid, then exits with 128 + the
        signal's number and one line saying so."""
        sent = time.monotonic()
        self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the demo did not exit within 30 s of {sig.name}")
        took = time.monotonic() - sent
        stderr = self.err_path.read_text()
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 128 + sig, f"exit {code} after {took:.1f}s of {sig.name}:\n{stderr[-3000:]}"
        assert took < 10, f"took {took:.1f}s to stop"
        assert len(lines) == 1 and lines[0].startswith("error: ") and sig.name in lines[0], stderr[-3000:]
        assert "Traceback" not in stderr
        # Every process it had is gone: stopped and waited for by the demo, not left to init.
        left = {pid: started for pid, started in self.seen.items() if proc_start(pid) == started}
        assert left == {}, f"still running after the demo exited: {sorted(left)}"

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid, started in self.seen.items():  # only what this test saw the demo start, by pid
            if proc_start(pid) == started:
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_demo_stopped_by_a_signal_stops_every_process_it_started(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """``kill -TERM`` (or a closed terminal's SIGHUP) mid-run: the demo stops its workers and its
    services, by pid, then exits with 128 + the signal's number and one line saying so. It used
    to die on the spot, leaving its four processes running against its store, children of init."""
    demo = _Demo(tmp_path, "default")
    try:
        demo.wait_running()
        # Its workers get the store from the environment: a URL on a command line (a PostgreSQL
        # password) is there for every local user to read (found by review).
        workers = [pid for pid in demo.seen if "worker" in _cmdline(pid)]
        assert len(workers) == 3, {pid: _cmdline(pid) for pid in demo.seen}
        for pid in workers:
            assert "--db" not in _cmdline(pid) and "demo.db" not in " ".join(_cmdline(pid)), _cmdline(pid)
        demo.stopped_by(sig)
    finally:
        demo.end()


def test_a_demo_killed_by_sigkill_leaves_none_of_its_processes_running(tmp_path: Path) -> None:
    """Found by review: SIGKILL, which the demo cannot see, left its workers and services
    running as children of init, polling its store and listening on its port. They now ask the
    kernel for SIGTERM when their parent dies (Linux), and stop as on an operator's SIGTERM."""
    demo = _Demo(tmp_path, "default")
    try:
        demo.wait_running()
        demo.proc.kill()
        demo.proc.wait(timeout=10)

        def all_gone() -> bool:
            return not any(proc_start(pid) == started for pid, started in demo.seen.items())

        wait_until(all_gone, 30, "every process the killed demo had started to end")
    finally:
        demo.end()


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return []


@pytest.mark.parametrize("what", ["services", "workers"])
def test_a_demo_whose_services_or_workers_all_die_stops_at_once_saying_which(
    tmp_path: Path, what: str
) -> None:
    """Found by review: with its services killed, the demo waited while every order failed, then
    ended on "URLError: Connection refused" with no summary; with every worker killed, it waited
    out its deadline (90 s) and reported the orders stuck. It now stops within a poll, one line
    naming what exited, exit 1, and stops the rest of what it started."""
    demo = _Demo(tmp_path, "default")
    try:
        demo.wait_running()
        victims = [
            pid for pid in demo.seen if ("stepwarden.demo.services" in _cmdline(pid)) == (what == "services")
        ]
        assert victims and len(victims) == (1 if what == "services" else 3), {
            p: _cmdline(p) for p in demo.seen
        }
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        try:
            code = demo.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the demo went on for 30 s without its " + what)
        lines = [line for line in demo.err_path.read_text().splitlines() if line.strip()]
        said = (
            "the demo's services (pid" if what == "services" else "every worker the demo started has exited"
        )
        assert code == 1 and len(lines) == 1 and said in lines[0], (code, lines)
        left = {pid for pid, started in demo.seen.items() if proc_start(pid) == started}
        assert left == set(), f"still running after the demo exited: {sorted(left)}"
    finally:
        demo.end()


def test_a_demo_started_under_nohup_runs_on_through_sighup(tmp_path: Path) -> None:
    """Started with SIGHUP ignored (``nohup stepwarden demo &``), the demo keeps it ignored: a
    closed terminal does not stop it. It still stops in order on SIGTERM."""
    demo = _Demo(tmp_path, "ignored")
    try:
        demo.wait_running()
        shown = demo.progress_lines()
        demo.proc.send_signal(signal.SIGHUP)

        def went_on() -> bool:
            """A progress line printed after the signal (one every 2 s), the demo still running."""
            assert demo.proc.poll() is None, f"SIGHUP stopped it: {demo.err_path.read_text()[-2000:]}"
            return demo.progress_lines() > shown + 1

        wait_until(went_on, 30, "the demo to go on after SIGHUP", 0.05)
        assert len(_children(demo.proc.pid)) >= 4
        demo.stopped_by(signal.SIGTERM)
    finally:
        demo.end()
