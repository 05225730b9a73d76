"""Threads that follow the store while a chaos run goes on: the ``Tracker``, which reads what the
leader's prunes will delete before it goes, and the ``Operator``, which cancels and retries tasks
through the real CLI."""

from __future__ import annotations

import copy
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any, cast

from chaos_common import LEASE_NAME, TERMINAL, Options, Reader, log_line, now, pruned_total

from stepwarden.metrics.tally import _IdTail, _XactTail
from stepwarden.store import Tx

# -- following the run while it runs --------------------------------------------------------------


# The events the analysis needs row by row; every other kind is only counted.
KEPT_EVENTS = ("rescued", "retry_scheduled", "dispatched", "lease_acquired", "lease_resigned")
# A finished task is read again by every poll for this long after the last good poll began: a
# transaction stamps ``finished_at`` with its own clock reading and may commit a little later
# (at most seconds: PostgreSQL ends a session idle in a transaction after 5 s).
FINISH_MARGIN = 15.0
EVENT_COLUMNS = "x.id, x.task_id, x.step_idx, x.attempt, x.kind, x.actor, x.detail, x.at"


class RunEvents:
    """The run's events (those after ``first_event``), each read once, by the tails the store's own
    event counts use (``stepwarden.metrics.tally``): on SQLite by id, which is commit order; on
    PostgreSQL by the transaction that wrote each row, the rows of every transaction older than the
    snapshot's ``xmin`` being final, and those committed above it read at once and remembered (a
    bounded number) until the cursor passes them.

    The tails ask a store transaction for one thing, ``sql``: this adapter answers it with the
    harness's ``Reader``, and puts a tail back as it was when a read fails half-way (a restarting
    server), so that the next read reads those rows again rather than skipping them."""

    def __init__(self, reader: Reader, first_event: int) -> None:
        self.reader = reader
        self.tail: _IdTail | _XactTail
        if reader.sqlite_path is not None:
            self.tail = _IdTail("events", EVENT_COLUMNS, "events x")
            self.tail.horizon = first_event
        else:  # the rows of a reused database from before the run are never read
            self.tail = _XactTail(
                "events", EVENT_COLUMNS, f"(SELECT * FROM events WHERE id > {first_event:d}) x"
            )

    def sql(self, text: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        """``Tx.sql``, as the tails call it: ``?`` placeholders and a tuple of parameters."""
        assert isinstance(params, tuple)
        return self.reader.rows(text, params)

    def read(self) -> list[dict[str, Any]]:
        """The events not read before (on PostgreSQL with their ``xact_id``), each once."""
        before = copy.deepcopy(self.tail)
        try:
            return self.tail.read(cast(Tx, self))
        except Exception:
            self.tail = before
            raise


class Tracker(threading.Thread):
    """Follows the store while the run goes on, so a prune cannot take records away uncounted.

    With a short retention (``--retention``) the leader deletes the run's finished tasks -- steps,
    requests, replies, events and messages with them -- and old lease terms and task-less events,
    minutes before the harness would read them at the end. So this thread reads them as they
    appear, every ``every`` seconds, and keeps what the end of the run needs:

    - each task of the run (``tasks``): its latest state and whether a cancel was ever requested.
      A poll reads the tasks not finished and those finished since shortly before the previous
      good poll, so each task is seen in its final state before its retention is up, however
      many tasks the run has;
    - every event once (``kinds`` by kind, and the rows of ``KEPT_EVENTS``), read by ``RunEvents``
      as ``stepwarden.metrics.tally`` reads them, late commits on PostgreSQL included;
    - every supervisor lease term (``terms``), and when ``event_totals`` -- what prunes deleted,
      counted by the deleting transaction -- grew: the moments prunes ran (``prunes``).

    Its last poll (``finish``, once the workers are stopped and nothing moves) reads every task of
    the run: those it returns are in the store, the others were pruned, in the last state seen.
    A task that was pruned before it was ever seen in a final state (``unaccounted``) would mean
    the thread was blind for longer than the retention: the harness cannot vouch for it, and the
    run fails. With the default retention nothing is pruned and this is what the end read gave.
    """

    def __init__(
        self, url: str, prefix: str, first_event: int, run_started: float, every: float = 0.5
    ) -> None:
        super().__init__(name="chaos-tracker", daemon=True)
        self.reader = Reader(url)
        self.prefix = prefix
        self.run_started = run_started
        self.every = every
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.tasks: dict[int, dict[str, Any]] = {}
        self.in_store_at_end: set[int] | None = None
        self.events: list[dict[str, Any]] = []
        self.kinds: Counter[str] = Counter()
        self.terms: dict[int, dict[str, Any]] = {}
        self.pruned_totals: list[tuple[float, int]] = []  # (when, SUM(event_totals.pruned)) as it grew
        self.polls = 0
        self.failed_polls = 0
        self.longest_blind_s = 0.0
        self._events = RunEvents(self.reader, first_event)
        self._horizon = 0.0  # tasks finished before it were seen final by an earlier poll
        self._last_ok = time.monotonic()

    # -- reading --
    def poll(self, full: bool = False) -> None:
        """One read of everything; ``full``: every task of the run, not only the recent ones. The
        events are read last: a poll that fails before the end keeps nothing, and reads it all again."""
        began = now()
        tasks = self.reader.rows(
            "SELECT id, correlation_id, state, cancel_requested FROM tasks"
            " WHERE substr(correlation_id, 1, ?) = ? AND (finished_at IS NULL OR finished_at >= ?)",
            (len(self.prefix), self.prefix, 0.0 if full else self._horizon),
        )
        terms = self.reader.rows(
            "SELECT term, holder, acquired_at, ended_at FROM lease_terms WHERE name = ? AND acquired_at >= ?",
            (LEASE_NAME, self.run_started - 1.0),
        )
        pruned = pruned_total(self.reader)
        events = self._events.read()
        with self.lock:
            for r in tasks:
                t = self.tasks.setdefault(
                    int(r["id"]), {"correlation_id": r["correlation_id"], "cancel_requested": False}
                )
                t["state"] = r["state"]
                t["cancel_requested"] = t["cancel_requested"] or bool(r["cancel_requested"])
                t.setdefault("seen_at", began)  # when first seen: a task seen long ago and not final is slow
            for e in events:
                self.kinds[e["kind"]] += 1
                if e["kind"] in KEPT_EVENTS:
                    e.pop("xact_id", None)
                    self.events.append(e)
            for r in terms:
                self.terms[int(r["term"])] = r
            if not self.pruned_totals or pruned > self.pruned_totals[-1][1]:
                self.pruned_totals.append((began, pruned))
            if full:
                self.in_store_at_end = {int(r["id"]) for r in tasks}
        self._horizon = began - FINISH_MARGIN
        self.polls += 1

    def _poll_once(self, full: bool = False) -> bool:
        try:
            self.poll(full)
        except Exception:  # the store is restarting or cut off: the next poll reads it all
            self.failed_polls += 1
            return False
        t = time.monotonic()
        self.longest_blind_s = max(self.longest_blind_s, t - self._last_ok)
        self._last_ok = t
        return True

    def run(self) -> None:
        while not self.halt.is_set():
            t = time.monotonic()
            self._poll_once()
            self.halt.wait(max(0.05, self.every - (time.monotonic() - t)))
        for _ in range(10):  # the last read: every task; bounded in count
            if self._poll_once(full=True):
                break
            time.sleep(1.0)
        self.reader.close()

    def finish(self) -> None:
        """Stop after one last, full poll (call it once the workers are stopped)."""
        self.halt.set()
        self.join(timeout=180)

    # -- what others read while it runs --
    def snapshot(self) -> dict[int, tuple[str, bool, float]]:
        """Task id -> (state, cancel ever requested, when first seen), as of the last poll."""
        with self.lock:
            return {i: (t["state"], t["cancel_requested"], t["seen_at"]) for i, t in self.tasks.items()}

    def seen_terminal(self) -> set[int]:
        with self.lock:
            return {i for i, t in self.tasks.items() if t["state"] in TERMINAL}

    def prune_moments(self) -> list[float]:
        """When the store's count of pruned events was seen to grow (the first reading is the base)."""
        with self.lock:
            return [t for t, _ in self.pruned_totals[1:]]


# -- operator actions -----------------------------------------------------------------------------


class Operator(threading.Thread):
    """An operator at the console during the window: ``stepwarden task cancel`` and ``task retry``
    on random tasks, through the real CLI in a process of its own, as a user's script would call it
    (exit 0: done; 2: refused, the task being in no state for it; 1: failed).

    A seeded schedule, an action every ``every`` seconds on average (each gap uniform in 0.5-1.5 x).
    A retry needs a task in ``error`` (the demo's are the orders whose stock reservation was refused
    for good): the first action after one appears is a retry, then one action in three while some
    exist. Every other action is a cancel: of a task in flight (pending or processing) mostly, one
    time in ten of a task in ``error`` (a cancel undoes it), one in ten of a ``processed`` one (to be
    refused). Most tasks finish in well under a second, before the CLI has even started, so a cancel
    goes to a *slow* task in flight when there is one -- seen in flight for a second or more: its
    step hung, or is being retried, or its worker was killed -- the cases where a cancel has work to
    do. Targets come from the tracker's last poll, so a target may have moved on since: a refusal
    then is the CLI doing its job, counted, not a failure.
    """

    def __init__(
        self,
        o: Options,
        url: str,
        env: dict[str, str],
        tracker: Tracker,
        seed: int,
        stop_at: float,
        t0: float,
    ) -> None:
        super().__init__(name="chaos-operator", daemon=True)
        self.o = o
        self.url = url
        self.env = env
        self.tracker = tracker
        self.rng = random.Random(seed)
        self.stop_at = stop_at
        self.t0 = t0
        self.halt = threading.Event()
        self.actions: list[dict[str, Any]] = []
        self.skipped = 0

    def run(self) -> None:
        every = self.o.operator_every
        due = time.monotonic() + self.rng.uniform(0.3, 0.7) * every
        for _ in range(1_000_000):  # bounded: one action per iteration
            while not self.halt.is_set() and time.monotonic() < due:
                self.halt.wait(min(0.1, max(0.0, due - time.monotonic())))
            if self.halt.is_set() or time.monotonic() >= self.stop_at:
                return
            self.act()
            due = max(due + self.rng.uniform(0.5, 1.5) * every, time.monotonic())

    def pick(self) -> tuple[str, int, str] | None:
        """(action, task id, its state as last seen), or None if no task fits."""
        snap = self.tracker.snapshot()
        by_state: dict[str, list[int]] = {}
        slow_before = now() - 1.0
        for tid, (state, cancel_requested, seen_at) in sorted(snap.items()):
            if not cancel_requested:
                by_state.setdefault(state, []).append(tid)
                if state in ("pending", "processing") and seen_at <= slow_before:
                    by_state.setdefault("slow", []).append(tid)
        errors = by_state.get("error", [])
        retried = any(a["action"] == "retry" and a["outcome"] == "accepted" for a in self.actions)
        if errors and (not retried or self.rng.random() < 1 / 3):
            return "retry", self.rng.choice(errors), "error"
        r = self.rng.random()
        in_flight = by_state.get("pending", []) + by_state.get("processing", [])
        processed = by_state.get("processed", [])
        if r < 0.1 and errors:
            return "cancel", self.rng.choice(errors), "error"
        if r < 0.2 and processed:
            return "cancel", self.rng.choice(processed[-200:]), "processed"
        if in_flight:
            tid = self.rng.choice(by_state.get("slow") or in_flight)
            return "cancel", tid, snap[tid][0]
        return None

    def act(self) -> None:
        choice = self.pick()
        if choice is None:
            self.skipped += 1
            return
        action, tid, seen = choice
        at = now()
        t = time.monotonic()
        cmd = [sys.executable, "-m", "stepwarden", "--db", self.url, "task", action, str(tid)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=60)
            code, said = p.returncode, (p.stdout.strip() or p.stderr.strip()).splitlines()
        except subprocess.TimeoutExpired:  # run() has killed it
            code, said = -1, ["timed out after 60 s"]
        outcome = {0: "accepted", 2: "refused"}.get(code, "failed")
        rec = {
            "t": round(at - self.t0, 3),
            "action": action,
            "task_id": tid,
            "seen_state": seen,
            "exit": code,
            "outcome": outcome,
            "said": (said[-1] if said else "")[:300],
            "took_s": round(time.monotonic() - t, 3),
        }
        self.actions.append(rec)
        log_line(self.o, f"operator {action} {tid} ({seen}): {outcome}: {rec['said']}")
