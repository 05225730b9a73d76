"""`init` (or a worker's start) while another session migrates the same PostgreSQL database: it
says whose migration it waits for, then finishes once that one ends, with no error lines."""

from __future__ import annotations

from pathlib import Path

import psycopg

from stepwarden.store.postgres import MIGRATION_LOCK

from .helpers import SW, Procs, wait_until


def test_init_waits_for_another_sessions_migration_and_names_it(
    pg_url: str, tmp_path: Path, procs: Procs
) -> None:
    with psycopg.connect(pg_url, application_name="someone else's init") as holder:
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        p = procs.start([str(SW), "--db", pg_url, "init"], "init")
        wait_until(
            lambda: "waiting for another session" in procs.log_of(p) or None, 20, "init to say it waits"
        )
        log = procs.log_of(p)
        assert f"pid {holder.info.backend_pid}" in log and "someone else's init" in log, log
        assert p.poll() is None, "init did not wait for the migration lock"
        holder.rollback()
        assert p.wait(timeout=20) == 0, procs.log_of(p)
    log = procs.log_of(p)
    assert "store ready" in log, log
    assert "error" not in log.lower() and "Traceback" not in log, log
