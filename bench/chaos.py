"""Chaos harness: the demo's order workload under injected faults, on SQLite or PostgreSQL.

    .venv/bin/python bench/chaos.py --store sqlite|postgres [--db URL] [--workers N] [--duration S]
        [--tasks N] [--seed S] [--faults kill,stop,term,proxy,restart,services] [--json PATH]
        [--retention SECONDS] [--operator-every SECONDS]

It starts the demo's fake services (seeded transient, hang-then-apply and permanent faults), N
worker processes (some with every role, one scheduler-only, one agent-only and one supervisor-only,
so each role gets killed), and on PostgreSQL -- unless ``--db`` names a server -- a throwaway
server of its own, with the workers connected through a loopback TCP proxy (``tcpproxy.py``).
During the injection window (``--duration``) it submits orders at a steady rate and injects faults
on a schedule drawn from ``--seed``:

- ``kill``: SIGKILL of a random worker (rotating over the role mixes), and of the supervisor
  leader; a replacement is started at once;
- ``stop``: SIGSTOP of the supervisor leader for longer than its lease TTL, and of an ordinary
  worker for 1-4 s (a GC pause), then SIGCONT;
- ``term``: SIGTERM of the supervisor leader (graceful: it resigns), replacement started;
- ``proxy`` (PostgreSQL): every worker connection reset (RST), or black-holed for a few seconds;
- ``restart`` (PostgreSQL, own server): the server restarted mid-run;
- ``services``: the services' own faults, at the demo's rates;
- with ``--operator-every``, an operator: ``stepwarden task cancel`` and ``task retry`` through the
  real CLI on random tasks; with ``--retention``, the workers keep finished tasks that many seconds,
  so the leader prunes the run's tasks while it runs (and while leaders are killed).

A thread follows the store meanwhile (``Tracker``), so that what a prune deletes is counted before
it goes. Then it stops injecting, waits (bounded) for every task to end, stops its processes by
pid, reads the services' ledger and the store's own records (events, lease_terms, requests, as
the tracker kept them), and prints and writes a JSON report; see ``bench/CHAOS.md`` for what each
figure means. Exit status 1 when any task is stuck, lost or unaccounted, any effect was applied
twice (or a compensated one survives), a cancelled task was not undone, two leader terms acted at
once, or a running worker crashed; 2 on bad arguments.

Every loop is bounded in time and count, every process it starts is ended by its pid, and all
traffic stays on 127.0.0.1. Fault times are taken from the host's wall clock, which is the database
clock of the SQLite store and of a PostgreSQL server on the same host.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by path (tests/chaos): its modules sit beside it
    sys.path.append(str(HERE))

from chaos_analysis import rescue_samples, term_analysis  # noqa: E402
from chaos_common import FAULT_GROUPS, FINAL, LEADER_FAULTS, Options, Reader, now  # noqa: E402
from chaos_faults import plan_faults  # noqa: E402
from chaos_procs import load_tcpproxy, serve_counting_services  # noqa: E402
from chaos_report import summary_lines  # noqa: E402
from chaos_run import execute  # noqa: E402
from chaos_tracker import Tracker  # noqa: E402

# What callers of this module use (tests/chaos loads it as a module).
__all__ = [
    "FINAL",
    "LEADER_FAULTS",
    "Options",
    "Reader",
    "Tracker",
    "execute",
    "load_tcpproxy",
    "main",
    "now",
    "parse_args",
    "plan_faults",
    "rescue_samples",
    "summary_lines",
    "term_analysis",
]

MIN_RETENTION = 5.0  # seconds: see parse_args


def parse_args(argv: list[str] | None) -> Options:
    p = argparse.ArgumentParser(
        prog="bench/chaos.py", description="Run the demo workload under injected faults and report."
    )
    p.add_argument("--store", choices=("sqlite", "postgres"), default="sqlite")
    p.add_argument("--db", help="store URL (default: a fresh SQLite file, or a PostgreSQL server of our own)")
    p.add_argument("--workers", type=int, default=5, help="worker processes (default 5)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of fault injection (default 60)")
    p.add_argument("--tasks", type=int, help="orders to submit, spread over the window")
    p.add_argument("--rate", type=float, help="orders per second (default tasks/duration, else 8)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--faults",
        default=",".join(FAULT_GROUPS),
        help=f"comma-separated fault kinds (default all: {','.join(FAULT_GROUPS)}); 'none' for none",
    )
    p.add_argument("--fault-every", type=float, default=4.0, help="mean seconds between faults (default 4)")
    p.add_argument("--settle", type=float, default=120.0, help="max seconds to wait for every task to end")
    p.add_argument(
        "--retention",
        type=float,
        help="seconds the workers keep finished tasks before the leader prunes them (default: the "
        "workers' own, 7 days); a few seconds prunes the run's tasks while it runs",
    )
    p.add_argument(
        "--operator-every",
        type=float,
        default=0.0,
        help="mean seconds between operator actions, `task cancel` and `task retry` (default 0: none)",
    )
    p.add_argument("--json", dest="json_path", help="write the report here")
    p.add_argument("--workdir", help="keep logs and data here (default: a temp dir, removed on success)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir even on success")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--note", default="", help="free text kept in the report (e.g. which code ran)")
    a = p.parse_args(argv)
    faults = tuple(x.strip() for x in a.faults.split(",") if x.strip() and x.strip() != "none")
    bad = [x for x in faults if x not in FAULT_GROUPS]
    if bad:
        p.error(f"unknown fault kind(s) {', '.join(bad)}; choose from {', '.join(FAULT_GROUPS)}")
    if not 1 <= a.workers <= 64:
        p.error("--workers must be between 1 and 64")
    if not 1 <= a.duration <= 24 * 3600 or not 1 <= a.settle <= 3600:
        p.error("--duration must be within [1, 86400] and --settle within [1, 3600] seconds")
    if a.tasks is not None and not 1 <= a.tasks <= 10_000_000:
        p.error("--tasks must be between 1 and 10000000")
    if a.rate is not None and not 0 < a.rate <= 10_000:
        p.error("--rate must be within (0, 10000]")
    if not 0.2 <= a.fault_every <= 3600:
        p.error("--fault-every must be within [0.2, 3600] seconds")
    # The tracker reads every finished task within about a second, blind at most while the store
    # restarts: a retention shorter than a few seconds would let the prune outrun it.
    if a.retention is not None and not MIN_RETENTION <= a.retention <= 36500 * 86400:
        p.error(f"--retention must be within [{MIN_RETENTION:g}, 3153600000] seconds")
    if a.operator_every and not 0.5 <= a.operator_every <= 3600:
        p.error("--operator-every must be 0 (none) or within [0.5, 3600] seconds")
    return Options(
        store=a.store,
        db=a.db,
        workers=a.workers,
        duration=a.duration,
        tasks=a.tasks,
        rate=a.rate,
        seed=a.seed,
        faults=faults,
        fault_every=a.fault_every,
        settle=a.settle,
        retention=a.retention,
        operator_every=a.operator_every,
        json_path=a.json_path,
        workdir=a.workdir,
        keep=a.keep,
        quiet=a.quiet,
        note=a.note,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_services"]:
        return serve_counting_services(argv[1:])
    o = parse_args(argv)

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds through execute(), which ends every process it started

    signal.signal(signal.SIGTERM, interrupted)
    try:
        report, ok = execute(o)
    except KeyboardInterrupt:
        print("[chaos] interrupted; every process it started was ended", file=sys.stderr)
        return 130
    text = json.dumps(report, indent=2, default=str)
    if o.json_path:
        Path(o.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(o.json_path).write_text(text + "\n")
    for line in summary_lines(report):
        print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
