"""The command-line contract's happy paths and JSON shapes (SPEC section 3, OPS1-OPS3, DEP5, SCH8)."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from .helpers import (
    DEMO_APP,
    FINAL,
    LEASE_KEYS,
    STEP_KEYS,
    SW,
    TASK_KEYS,
    TASK_STATES,
    WORKFLOW,
    Db,
    MiB,
    Procs,
    assert_one_error_line,
    clean_env,
    make_db,
    order,
    register_demo_workflows,
    sw,
    wait_until,
)

STEPS = ["reserve", "charge", "ship"]


def is_iso(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        datetime.fromisoformat(value)
    except ValueError:
        return False
    return True


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in events]


# -- init, submit, input -------------------------------------------------------------------------


def test_init_creates_the_store_and_is_idempotent(tmp_path: Path) -> None:
    db = Db(tmp_path / "fresh.db", tmp_path)
    first = db.ok("init")
    assert db.path.exists()
    assert first.stdout.strip(), "init says what it did"
    before = db.snapshot()
    migrations = sqlite3.connect(db.path).execute("SELECT COUNT(*) FROM schema_migrations").fetchone()[0]
    db.ok("init")
    assert db.snapshot() == before
    assert (
        sqlite3.connect(db.path).execute("SELECT COUNT(*) FROM schema_migrations").fetchone()[0] == migrations
    )
    assert db.json("tasks", "--json") == []


def test_submit_prints_the_task_id_and_an_idempotency_key_returns_the_same_id(db: Db) -> None:
    a = db.submit(order("o-1"), "--idempotency-key", "key-1", "--correlation-id", "o-1")
    again = db.submit(order("o-1"), "--idempotency-key", "key-1", "--correlation-id", "o-1")
    other = db.submit(order("o-2"), "--idempotency-key", "key-2")
    plain1 = db.submit(order("o-3"))
    plain2 = db.submit(order("o-3"))
    assert again == a
    assert len({a, other, plain1, plain2}) == 4, "without a repeated key every submit is a new task"
    assert sorted(t["id"] for t in db.json("tasks", "--json")) == sorted({a, other, plain1, plain2})


def test_concurrent_submits_with_one_idempotency_key_make_one_task(db: Db) -> None:
    payload = json.dumps(order("conc-1"))
    cmd = [str(SW), "--db", db.url, "submit", WORKFLOW, "--input", payload, "--idempotency-key", "conc-1"]
    running = [
        subprocess.Popen(cmd, cwd=db.cwd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(6)
    ]
    outs = []
    for p in running:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
        outs.append(out.decode().strip())
    assert len(set(outs)) == 1 and outs[0].isdigit(), outs
    assert [t["id"] for t in db.json("tasks", "--json")] == [int(outs[0])]


def test_submit_accepts_priority_reply_queue_and_correlation_id(db: Db) -> None:
    hi = db.submit(order("p-1"), "--priority", "100", "--reply-to", "web-1", "--correlation-id", "p-1")
    lo = db.submit(order("p-2"), "--priority", "-5")
    assert db.task(hi)["correlation_id"] == "p-1"
    assert db.task(lo)["correlation_id"] is None


def test_input_from_a_file_and_from_stdin(db: Db, tmp_path: Path) -> None:
    data = order("ünïcode-1", sku="SKU-✓")
    f = tmp_path / "order.json"
    f.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    from_file = int(db.ok("submit", WORKFLOW, "--input", f"@{f}").stdout)
    from_stdin = int(db.ok("submit", WORKFLOW, "--input", "-", stdin=json.dumps(data)).stdout)
    assert from_file != from_stdin
    assert db.task(from_file)["input"] == data
    assert db.task(from_stdin)["input"] == data


def test_input_of_exactly_1mib_is_accepted(db: Db, tmp_path: Path) -> None:
    empty = json.dumps({"order_id": ""}, separators=(",", ":"))
    text = json.dumps({"order_id": "x" * (MiB - len(empty))}, separators=(",", ":"))
    assert len(text.encode()) == MiB
    f = tmp_path / "limit.json"
    f.write_text(text)
    by_file = int(db.ok("submit", WORKFLOW, "--input", f"@{f}").stdout)
    by_stdin = int(db.ok("submit", WORKFLOW, "--input", "-", stdin=text).stdout)
    assert db.task(by_file)["input"] == db.task(by_stdin)["input"] == json.loads(text)


# -- listings and their JSON shapes ---------------------------------------------------------------


def test_tasks_json_shape(db: Db) -> None:
    a = db.submit(order("s-1"), "--correlation-id", "s-1")
    b = db.submit(order("s-2"))
    rows = db.json("tasks", "--json")
    assert isinstance(rows, list) and [t["id"] for t in rows] == [a, b]
    for t in rows:
        assert t.keys() >= TASK_KEYS, sorted(t)
        assert isinstance(t["id"], int)
        assert t["workflow"] == WORKFLOW
        assert t["state"] == "pending"
        assert t["failure_count"] == 0
        assert is_iso(t["created_at"]) and is_iso(t["updated_at"]), t
        assert [s["name"] for s in t["steps"]] == STEPS
        for s in t["steps"]:
            assert s.keys() >= STEP_KEYS, sorted(s)
            assert s["state"] == "pending"
            assert s["attempt"] == 0 and s["failure_count"] == 0
            assert s["locked_by"] is None and s["complete_by"] is None
    assert rows[0]["correlation_id"] == "s-1" and rows[1]["correlation_id"] is None


def test_tasks_state_filters(db: Db) -> None:
    kept = db.submit(order("f-1"))
    cancelled = db.submit(order("f-2"))
    db.ok("task", "cancel", str(cancelled))
    assert [t["id"] for t in db.json("tasks", "--state", "pending", "--json")] == [kept]
    states = {t["state"] for t in db.json("tasks", "--json")}
    assert states <= TASK_STATES and len(states) == 2
    other = (states - {"pending"}).pop()
    assert [t["id"] for t in db.json("tasks", "--state", other, "--json")] == [cancelled]
    assert db.json("tasks", "--state", "processed", "--json") == []


def test_tasks_by_correlation_id(db: Db) -> None:
    """The lookup a lost-connection error on submit points to: exact match, with --state and the
    table view too."""
    a1 = db.submit(order("c-1"), "--correlation-id", "order-7")
    db.submit(order("c-2"), "--correlation-id", "order-70")  # a prefix match would take it too
    a2 = db.submit(order("c-3"), "--correlation-id", "order-7")
    db.submit(order("c-4"))
    rows = db.json("tasks", "--correlation-id", "order-7", "--json")
    assert [t["id"] for t in rows] == [a1, a2]
    assert {t["correlation_id"] for t in rows} == {"order-7"}
    assert db.json("tasks", "--correlation-id", "order-7", "--limit", "1", "--json")[0]["id"] == a1
    db.ok("task", "cancel", str(a1))
    pending = db.json("tasks", "--correlation-id", "order-7", "--state", "pending", "--json")
    assert [t["id"] for t in pending] == [a2]
    assert db.json("tasks", "--correlation-id", "no-such-order", "--json") == []
    table = db.ok("tasks", "--correlation-id", "order-70").stdout
    assert "order-70" in table and "order-7 " not in table


def test_task_show_json(db: Db) -> None:
    data = order("show-1")
    tid = db.submit(data, "--correlation-id", "show-1")
    t = db.task(tid)
    assert t["id"] == tid and t["workflow"] == WORKFLOW and t["state"] == "pending"
    assert t["correlation_id"] == "show-1"
    assert t["input"] == data
    assert [s["name"] for s in t["steps"]] == STEPS
    for s in t["steps"]:
        assert s.keys() >= STEP_KEYS
        assert s["attempts"] == []
    assert kinds(t["events"])[0] == "received"
    assert all(is_iso(e["at"]) for e in t["events"])


def test_empty_store_listings(db: Db) -> None:
    assert db.json("tasks", "--json") == []
    assert db.json("alerts", "--json") == []
    leases = db.json("leases", "--json")
    assert isinstance(leases, list)
    assert all(x.keys() >= LEASE_KEYS for x in leases)


def test_the_tasks_table_shows_the_newest_hundred_and_says_how_many_more(db: Db) -> None:
    """A person reading `stepwarden tasks` on a busy store gets the end of the list and a line
    saying what was left out; --limit and --json keep their meaning (the first N; everything)."""
    from stepwarden import App

    app = App(db.url)
    try:
        ids = [app.submit(WORKFLOW, order(f"many-{i}"), correlation_id=f"many-{i}") for i in range(103)]
    finally:
        app.close()
    shown = [int(ln.split()[0]) for ln in db.ok("tasks").stdout_lines if ln.split()[0].isdigit()]
    assert shown == ids[3:], shown[:5]
    assert db.ok("tasks").stdout_lines[-1].startswith("the newest 100 of 103 tasks")
    first = db.ok("tasks", "--limit", "2").stdout_lines
    assert [int(ln.split()[0]) for ln in first if ln.split()[0].isdigit()] == ids[:2]
    assert not any(ln.startswith("the newest") for ln in first)
    assert [t["id"] for t in db.json("tasks", "--json")] == ids
    narrowed = db.ok("tasks", "--correlation-id", "many-7").stdout_lines
    assert [int(ln.split()[0]) for ln in narrowed if ln.split()[0].isdigit()] == [ids[7]]


def test_the_alerts_table_shows_the_newest_hundred_and_says_how_many_more(db: Db) -> None:
    """As `tasks`: the store keeps alerts until they are acknowledged (or their task pruned), so
    a busy week's `stepwarden alerts` printed every one of them."""
    from stepwarden import App
    from stepwarden.store import transitions as t

    app = App(db.url)
    try:

        def raise_alerts(tx: Any) -> None:
            for i in range(103):
                t.alert(tx, "task_error", None, "reserve", f"alert {i}")

        app.store.transact_sync(raise_alerts)
    finally:
        app.close()
    ids = [a["id"] for a in db.json("alerts", "--json")]
    assert len(ids) == 103
    table = db.ok("alerts").stdout_lines
    assert [int(ln.split()[0]) for ln in table if ln.split() and ln.split()[0].isdigit()] == ids[3:]
    assert table[-1].startswith("the newest 100 of 103 alerts")
    first = db.ok("alerts", "--limit", "2").stdout_lines
    assert [int(ln.split()[0]) for ln in first if ln.split() and ln.split()[0].isdigit()] == ids[:2]
    assert not any(ln.startswith("the newest") for ln in first)
    assert [a["id"] for a in db.json("alerts", "--json", "--limit", "5")] == ids[:5]


def test_human_outputs_show_the_task(db: Db) -> None:
    tid = db.submit(order("h-1"), "--correlation-id", "h-1")
    listing = db.ok("tasks")
    assert str(tid) in listing.stdout and "pending" in listing.stdout and "h-1" in listing.stdout
    shown = db.ok("task", "show", str(tid))
    assert f"task {tid}" in shown.stdout and "pending" in shown.stdout
    assert all(name in shown.stdout for name in STEPS)
    for args in (("alerts",), ("leases",), ("tasks", "--state", "error")):
        r = db.ok(*args)
        assert "Traceback" not in r.stderr and r.stderr.strip() == "", str(r)


# -- the store's location (DEP5) and read commands that must not create it ------------------------

READ_COMMANDS = [
    ("tasks",),
    ("tasks", "--json"),
    ("task", "show", "1"),
    ("task", "show", "1", "--json"),
    ("task", "cancel", "1"),
    ("task", "retry", "1"),
    ("alerts",),
    ("alerts", "--json"),
    ("leases",),
    ("leases", "--json"),
    ("watch", "1", "--timeout", "1"),
    ("watch", "--reply-to", "q", "--timeout", "1"),
    ("submit", WORKFLOW, "--input", json.dumps(order())),
    ("workers",),
    ("agents",),
    ("alerts", "ack", "1"),
    ("dashboard", "--port", "0"),
]


@pytest.mark.parametrize("args", READ_COMMANDS, ids=lambda a: "-".join(a[:3])[:30])
def test_commands_on_a_missing_store_exit_1_and_do_not_create_it(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    missing = tmp_path / "missing.db"
    r = sw("--db", f"sqlite:///{missing}", *args, cwd=tmp_path)
    assert_one_error_line(r, code=1)
    assert list(tmp_path.iterdir()) == [], f"a command created files: {list(tmp_path.iterdir())}\n{r}"


@pytest.mark.parametrize("content", [b"", b"not a database\n"], ids=["empty", "junk"])
def test_commands_on_a_file_that_is_no_store_exit_1_and_leave_it_as_it_was(
    tmp_path: Path, content: bytes
) -> None:
    """An existing file is not yet a store: a read or operator command neither creates the schema
    in it nor so much as sets its journal mode (no -wal or -shm file appears)."""
    path = tmp_path / "other.db"
    path.write_bytes(content)
    for args in READ_COMMANDS:
        r = sw("--db", f"sqlite:///{path}", *args, cwd=tmp_path)
        line = assert_one_error_line(r, code=1)
        assert "other.db" in line, line
        assert path.read_bytes() == content, f"{args} wrote to the file"
        assert list(tmp_path.iterdir()) == [path], f"{args} created files: {list(tmp_path.iterdir())}"


def test_a_file_whose_migration_table_is_empty_is_no_store(tmp_path: Path) -> None:
    """Not "version 0, older than this stepwarden": nothing was ever migrated into it."""
    path = tmp_path / "half.db"
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT, applied_at REAL)"
        )
    line = assert_one_error_line(sw("--db", f"sqlite:///{path}", "tasks", cwd=tmp_path), code=1)
    assert "holds no stepwarden schema" in line and "init" in line, line


def test_a_directory_named_as_the_store_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    line = assert_one_error_line(sw("--db", f"sqlite:///{tmp_path / 'd'}", "tasks", cwd=tmp_path), code=1)
    assert "is a directory" in line, line


@pytest.mark.parametrize("args", READ_COMMANDS, ids=lambda a: "-".join(a[:3])[:30])
def test_commands_on_an_empty_postgres_database_exit_1_and_create_no_table(
    make_pg_db: Any, tmp_path: Path, args: tuple[str, ...]
) -> None:
    """PostgreSQL's counterpart of a missing file: the database exists but holds no stepwarden
    schema (a mistyped database name, say). The command must say so, not migrate it."""
    db = Db(tmp_path / "unused.db", tmp_path, make_pg_db(empty=True))
    before = db.snapshot(require_schema=False)
    line = assert_one_error_line(db.sw(*args), code=1)
    assert "no stepwarden schema" in line and "init" in line, line
    assert db.snapshot(require_schema=False) == before, "a read command created the schema"


@pytest.fixture(params=["sqlite", "postgres"])
def old_store(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    """A store one schema version behind this code, as after upgrading stepwarden."""
    from stepwarden.store import open_store
    from stepwarden.store.sql import load_migrations

    pg = request.getfixturevalue("make_pg_db")(empty=True) if request.param == "postgres" else None
    db = Db(tmp_path / "old.db", tmp_path, pg)
    store = open_store(db.url, migrate=False)
    try:
        store.migrate(target=load_migrations(request.param)[-1][0] - 1)
    finally:
        store.close()
    return db


def test_read_commands_do_not_upgrade_an_older_schema_and_say_how(old_store: Db) -> None:
    """Upgrading is init's (or a starting worker's) to do, not a side effect of looking."""
    if not old_store.pg:  # the version check's read-only connection left -wal and -shm files behind
        files = sorted(p.name for p in old_store.path.parent.iterdir())
        assert_one_error_line(old_store.sw("tasks"), code=1)
        assert sorted(p.name for p in old_store.path.parent.iterdir()) == files
    before = old_store.snapshot(require_schema=False)
    for args in (("tasks",), ("leases", "--json"), ("task", "show", "1")):
        line = assert_one_error_line(old_store.sw(*args), code=1)
        assert "older than this stepwarden" in line and "init" in line, line
    assert old_store.snapshot(require_schema=False) == before
    old_store.ok("init")
    assert old_store.json("tasks", "--json") == []


def test_a_read_only_postgres_role_can_run_the_read_commands(make_pg_db: Any, tmp_path: Path) -> None:
    """Reading needs no right to create: opening a store for a read command writes nothing."""

    url = make_pg_db()
    db = make_db(tmp_path, pg=url)
    tid = db.submit(order("ro-1"), "--correlation-id", "ro-1")
    with _select_only_role(url) as ro_url:
        reader = Db(tmp_path / "unused.db", tmp_path, ro_url)
        assert [t["id"] for t in reader.json("tasks", "--json")] == [tid]
        assert reader.json("task", "show", str(tid), "--json")["correlation_id"] == "ro-1"
        assert isinstance(reader.json("leases", "--json"), list)
        r = reader.sw("task", "cancel", str(tid))  # acting needs the rights to write
        assert r.returncode == 1 and "permission denied" in r.stderr, str(r)
        # So does reading a reply queue, which gives new messages their positions: it printed
        # nothing and exited 0 (or warned forever without --timeout), as for an empty queue.
        db.submit(order("ro-2"), "--reply-to", "ro-q")
        started = time.monotonic()
        r = reader.sw("watch", "--reply-to", "ro-q", "--timeout", "20")
        line = assert_one_error_line(r, code=1)
        assert "reply queue ro-q" in line and "not only SELECT" in line, line
        assert time.monotonic() - started < 15, "it waited for the store as for an outage"


@pytest.mark.parametrize("roles", ["scheduler,agent,supervisor", "scheduler,supervisor"])
def test_a_worker_whose_postgres_role_may_only_read_exits_1_with_one_line(
    make_pg_db: Any, tmp_path: Path, roles: str
) -> None:
    """Found by review: such a worker warned "cannot record its workflows in the store yet ...
    permission denied" every 10 s for ever (without --app, it started and warned on every
    heartbeat); it never did any work. Permission denied is no outage: exit 1, one line."""

    url = make_pg_db()
    make_db(tmp_path, pg=url)
    with _select_only_role(url) as ro_url:
        app = ("--app", DEMO_APP) if "agent" in roles else ()
        r = sw("--db", ro_url, "worker", *app, "--roles", roles, cwd=tmp_path, timeout=60)
    errors = [line for line in r.stderr_lines if line.startswith("error: ")]
    assert r.returncode == 1 and len(errors) == 1, str(r)
    assert "may not write" in errors[0] and "permission denied" in errors[0], errors


@contextlib.contextmanager
def _select_only_role(url: str) -> Iterator[str]:
    """The URL of a new login role that may only read the store's tables; dropped after."""
    import uuid

    import psycopg

    role = f"sw_ro_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    try:
        parts = urlsplit(url)
        yield urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}"))
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE {role}")


def test_a_postgres_role_without_create_rights_runs_workers_and_submits_on_a_migrated_schema(
    make_pg_db: Any, tmp_path: Path, procs: Procs
) -> None:
    """Least privilege: the owner migrates with `init`; the workers' and the applications' role may
    read and write the tables and nothing more. Opening the store ran `CREATE TABLE IF NOT EXISTS
    schema_migrations` before it knew nothing was pending, and PostgreSQL checks the right to create
    even for a table that exists: such a role could not start a worker or submit at all. On a
    schema that does need migrating it is refused with one line naming `init`, and nothing changes."""
    import uuid

    import psycopg

    url = make_pg_db()
    empty = make_pg_db(empty=True)
    role = f"sw_dml_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
    for u in (url, empty):
        with psycopg.connect(u, autocommit=True) as admin:
            admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
            admin.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
            admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
            admin.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}")

    def as_role(u: str) -> str:
        parts = urlsplit(u)
        return urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}"))

    try:
        register_demo_workflows(url)
        db = Db(tmp_path / "unused.db", tmp_path, as_role(url))
        tid = db.submit(order("dml-1"), "--correlation-id", "dml-1")
        procs.worker(
            db, procs.services("--transient-rate", "0", "--hang-rate", "0", "--permanent-rate", "0"), "w"
        )
        assert db.wait_state(tid, FINAL)["state"] == "processed"
        fresh = Db(tmp_path / "unused.db", tmp_path, as_role(empty))
        before = Db(tmp_path / "unused.db", tmp_path, empty).snapshot(require_schema=False)
        r = fresh.sw("worker", "--app", DEMO_APP)
        line = assert_one_error_line(r, code=1)
        assert "stepwarden init" in line and "nothing was changed" in line, line
        assert Db(tmp_path / "unused.db", tmp_path, empty).snapshot(require_schema=False) == before
    finally:
        procs.stop_all()
        for u in (url, empty):
            with psycopg.connect(u, autocommit=True) as admin:
                admin.execute(f"DROP OWNED BY {role}")
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f"DROP ROLE {role}")


def test_read_commands_do_not_wait_for_a_writer_on_sqlite(tmp_path: Path) -> None:
    """A worker holding SQLite's write lock (a long transaction, a stuck process) does not hold up
    an operator who is looking: the read commands read the last committed state at once."""
    db = make_db(tmp_path)
    tid = db.submit(order("r-1"), "--correlation-id", "r-1")
    holder = sqlite3.connect(db.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("UPDATE tasks SET correlation_id = 'uncommitted' WHERE id = ?", (tid,))
    try:
        for args in (
            ("tasks",),
            ("task", "show", str(tid)),
            ("leases",),
            ("alerts",),
            ("workers",),
            ("agents",),
        ):
            r = db.sw(*args, "--json", timeout=20)
            assert r.returncode == 0 and r.elapsed < 5, str(r)
        assert [t["correlation_id"] for t in db.json("tasks", "--json")] == ["r-1"]
        watch = db.sw("watch", str(tid), "--timeout", "0.5", timeout=20)
        assert watch.elapsed < 5 and "received" in watch.stdout, str(watch)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_read_commands_accept_the_sqlite_url_options(tmp_path: Path) -> None:
    """The path check looks at the file, not at the URL's ``?synchronous=`` option."""
    db = make_db(tmp_path, "opts.db")
    tid = db.submit(order("opt-1"))
    r = sw("--db", f"{db.url}?synchronous=NORMAL", "tasks", "--json", cwd=tmp_path)
    assert r.returncode == 0, str(r)
    assert [t["id"] for t in json.loads(r.stdout)] == [tid]


def test_db_option_and_environment_variable_select_the_store(tmp_path: Path) -> None:
    a = make_db(tmp_path, "a.db")
    b = make_db(tmp_path, "b.db")
    in_a = a.submit(order("in-a"), "--correlation-id", "in-a")
    env_b = clean_env(STEPWARDEN_DB=b.url)
    r = sw(
        "submit",
        WORKFLOW,
        "--input",
        json.dumps(order("in-b")),
        "--correlation-id",
        "in-b",
        cwd=tmp_path,
        env=env_b,
    )
    assert r.returncode == 0, str(r)
    in_b = int(r.stdout)

    def correlations(r: Any) -> list[str]:
        assert r.returncode == 0, str(r)
        return [t["correlation_id"] for t in json.loads(r.stdout)]

    assert correlations(sw("tasks", "--json", cwd=tmp_path, env=env_b)) == ["in-b"]
    assert correlations(sw("--db", a.url, "tasks", "--json", cwd=tmp_path, env=env_b)) == ["in-a"], (
        "--db wins over STEPWARDEN_DB"
    )
    assert a.task(in_a)["correlation_id"] == "in-a" and b.task(in_b)["correlation_id"] == "in-b"


def test_default_store_is_stepwarden_db_in_the_working_directory(tmp_path: Path) -> None:
    r = sw("tasks", "--json", cwd=tmp_path)
    assert_one_error_line(r, code=1)
    assert "stepwarden.db" in r.stderr
    assert not (tmp_path / "stepwarden.db").exists()
    r = sw("init", cwd=tmp_path)
    assert r.returncode == 0, str(r)
    assert (tmp_path / "stepwarden.db").exists()
    r = sw("tasks", "--json", cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout) == [], str(r)


# -- with a worker: cancel, finish, watch, leases (a store and a worker per module) ----------------


@dataclass
class World:
    db: Db
    procs: Procs
    services: str
    worker: subprocess.Popen[bytes]
    cancelled: int
    cancel_output: str
    web: int


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    """The CLI's happy paths on both stores (bad input is in test_bad_input, on both stores too)."""
    if request.param == "sqlite":
        return make_db(tmp_path)
    return make_db(tmp_path, pg=request.getfixturevalue("pg_url"))


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A store with two tasks submitted before any worker ran: one cancelled while pending, one with a
    reply queue; then the demo's services (no failures) and one worker for the demo app."""
    folder = tmp_path_factory.mktemp("world")
    procs = Procs(folder)
    try:
        pg = request.getfixturevalue("make_pg_db")() if request.param == "postgres" else None
        db = make_db(folder, pg=pg)
        cancelled = db.submit(order("cancel-me"), "--correlation-id", "cancel-me")
        web = db.submit(order("web-order"), "--correlation-id", "web-order", "--reply-to", "web-1")
        out = db.ok("task", "cancel", str(cancelled)).stdout
        url = procs.services()
        worker = procs.worker(db, url, "acc")
        yield World(db, procs, url, worker, cancelled, out, web)
    finally:
        procs.stop_all()


def final(world: World, task_id: int) -> dict[str, Any]:
    try:
        return world.db.wait_state(task_id, FINAL)
    except BaseException:
        print(world.procs.log_of(world.worker))
        raise


def test_cancel_a_pending_task_then_a_worker_ends_it_cancelled(world: World) -> None:
    assert str(world.cancelled) in world.cancel_output
    t = final(world, world.cancelled)
    assert t["state"] == "cancelled"
    assert all(s["state"] in ("skipped", "pending") for s in t["steps"]), t["steps"]
    assert all(s["attempts"] == [] for s in t["steps"]), "a task cancelled before it started calls nothing"
    effects = httpx.get(f"{world.services}/ledger", timeout=10).json()["effects"]
    assert not [k for k in effects if k.startswith(f"{world.cancelled}:")], effects


def test_a_worker_processes_a_task(world: World) -> None:
    t = final(world, world.web)
    assert t["state"] == "processed"
    assert [s["state"] for s in t["steps"]] == ["completed"] * 3
    assert all(s["attempt"] >= 1 and s["attempts"] for s in t["steps"])
    k = kinds(t["events"])
    assert k[0] == "received" and k[-1] == "processed", k
    assert k.count("step_completed") == 3, k
    rows = world.db.json("tasks", "--state", "processed", "--json")
    assert world.web in [r["id"] for r in rows]


def test_task_show_in_text_lists_the_replies_and_full_values_in_a_pipe(world: World) -> None:
    """Piped (no terminal, no COLUMNS): a tool like grep gets whole ids, names and times, not a
    table cut to 80 columns; the text shows the replies as --json does."""
    t = final(world, world.web)
    env = {k: v for k, v in clean_env().items() if k != "COLUMNS"}
    shown = sw("--db", world.db.url, "task", "show", str(world.web), cwd=world.db.cwd, env=env)
    assert shown.returncode == 0, str(shown)
    replies = t["replies"]
    assert replies and all(r["status"] == "accepted" for r in replies), replies
    lines = shown.stdout_lines
    at = next(i for i, ln in enumerate(lines) if ln.strip() == "replies")
    rows = [ln.split() for ln in lines[at + 2 :] if ln.strip()]
    assert [(r[2], r[3], r[4], r[5], r[6], r[7]) for r in rows] == [
        (s["name"], "1", "do", "ok", "accepted", s["attempts"][0]["taken_by"]) for s in t["steps"]
    ], shown.stdout
    dispatched = [ln for ln in lines if " dispatched " in ln]
    assert len(dispatched) == 3 and all(
        re.search(r"complete_by=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}(\s|$)", ln) for ln in dispatched
    ), dispatched
    assert all(  # --json keeps the value as recorded, for tools that compute with it
        isinstance(e["detail"]["complete_by"], float) for e in t["events"] if e["kind"] == "dispatched"
    )
    step = t["steps"][0]["attempts"][0]
    assert (
        step["taken_by"] in shown.stdout and step["complete_by"].replace("T", " ").rstrip("Z") in shown.stdout
    )

    # the timings --json has (found missing by review): the task's, each step's, each attempt's
    def as_shown(at: str) -> str:
        return at.replace("T", " ").rstrip("Z")

    for at in (t["created_at"], t["finished_at"], t["steps"][0]["started_at"], t["steps"][-1]["finished_at"]):
        assert as_shown(at) in shown.stdout, (at, shown.stdout)
    for at in (step["dispatched_at"], step["taken_at"], step["finished_at"]):
        assert as_shown(at) in shown.stdout, (at, shown.stdout)
    assert f"priority={t['priority']}" in shown.stdout
    listing = sw("--db", world.db.url, "tasks", cwd=world.db.cwd, env=env)
    row = next(ln for ln in listing.stdout_lines if ln.split()[:1] == [str(world.web)])
    assert "web-order" in row and t["updated_at"].replace("T", " ").rstrip("Z") in row, listing.stdout


@pytest.mark.parametrize("columns", ["0", "5", "wide"])
def test_a_columns_that_is_no_usable_width_still_shows_the_tasks(world: World, columns: str) -> None:
    """COLUMNS=0 made every table print nothing at all, with exit 0, and COLUMNS=5 blank lines:
    a width under 80 is taken as 80, and a value that is not a positive number is ignored."""
    final(world, world.web)
    env = {**clean_env(), "COLUMNS": columns}
    listing = sw("--db", world.db.url, "tasks", cwd=world.db.cwd, env=env)
    assert listing.returncode == 0, str(listing)
    assert any(ln.split()[:1] == [str(world.web)] for ln in listing.stdout_lines), listing.stdout


def test_cancel_of_a_processed_task_exits_2(world: World) -> None:
    final(world, world.web)
    before = world.db.task(world.web)
    assert_one_error_line(world.db.sw("task", "cancel", str(world.web)))
    assert world.db.task(world.web) == before


def test_retry_of_a_task_not_in_error_exits_2(world: World) -> None:
    final(world, world.web)
    before = world.db.task(world.web)
    assert_one_error_line(world.db.sw("task", "retry", str(world.web)))
    assert_one_error_line(world.db.sw("task", "retry", str(world.web), "--step", "reserve"))
    assert world.db.task(world.web) == before


def test_watch_a_task_until_it_is_final(world: World) -> None:
    tid = world.db.submit(order("watched"), "--correlation-id", "watched")
    r = world.db.sw("watch", str(tid), "--timeout", "30")
    assert r.returncode == 0, str(r)
    lines = r.stdout_lines
    assert lines[-1] == f"task {tid} is processed", str(r)
    assert r.elapsed < 30, "watch ends when the task is final, not at its timeout"
    events = [ln.split()[1] for ln in lines[:-1]]
    assert events[0] == "received" and events[-1] == "processed", events
    assert events.count("step_completed") == 3, events
    assert all(is_iso(ln.split()[0]) for ln in lines[:-1])
    dispatched = [ln for ln in lines if ln.split()[1] == "dispatched"]
    assert len(dispatched) == 3 and all(  # a time, as task show prints it, not epoch seconds
        re.search(r"complete_by=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}(\s|$)", ln) for ln in dispatched
    ), dispatched


def test_watch_a_reply_queue_prints_its_status_messages_in_order(world: World) -> None:
    final(world, world.web)
    r = world.db.sw("watch", "--reply-to", "web-1", "--timeout", "1")
    assert r.returncode == 0, str(r)
    msgs = [json.loads(ln) for ln in r.stdout_lines]
    assert msgs and all(m["task_id"] == world.web and m["correlation_id"] == "web-order" for m in msgs), msgs
    seq: list[tuple[str, str | None]] = []
    for m in msgs:  # at least once (SCH8): collapse repeats, the order must hold
        item = (m["kind"], m.get("step"))
        if not seq or seq[-1] != item:
            seq.append(item)
    expected = [("received", None), *(("step_completed", s) for s in STEPS), ("processed", None)]
    assert seq == expected, seq


def test_watch_an_empty_reply_queue_ends_at_its_timeout(world: World) -> None:
    r = world.db.sw("watch", "--reply-to", "nobody-listens", "--timeout", "0.5")
    assert r.returncode == 0 and r.stdout.strip() == "", str(r)


def test_leases_json_names_the_supervisor_and_its_holder(world: World) -> None:
    def supervisor() -> dict[str, Any] | None:
        rows = world.db.json("leases", "--json")
        assert isinstance(rows, list) and all(x.keys() >= LEASE_KEYS for x in rows), rows
        return next((x for x in rows if x["name"] == "supervisor" and x["holder"]), None)

    lease = wait_until(supervisor, 30, "the worker to lead the supervisor lease", 0.3)
    name, pid, rand = lease["holder"].split(":")
    assert name == "acc" and pid == str(world.worker.pid) and rand, lease
    assert isinstance(lease["term"], int) and lease["term"] >= 1
    assert is_iso(lease["expires_at"])
    human = world.db.ok("leases").stdout
    assert "supervisor" in human and lease["holder"] in human


def test_alerts_json_is_a_list(world: World) -> None:
    final(world, world.web)
    alerts = world.db.json("alerts", "--json")
    assert isinstance(alerts, list)


# -- a step that fails for good: error, alert, retry, cancel (SCH7, OPS2-OPS4) ----------------------


def test_failed_task_alerts_and_can_be_retried_and_cancelled(db: Db, procs: Procs) -> None:
    url = procs.services("--permanent-rate", "1")
    worker = procs.worker(db, url, "err")
    tid = db.submit(order("doomed"), "--correlation-id", "doomed")
    try:
        t = db.wait_state(tid, FINAL)
    except BaseException:
        print(procs.log_of(worker))
        raise
    assert t["state"] == "error", t
    assert t["steps"][0]["state"] == "failed"
    assert [s["state"] for s in t["steps"][1:]] != ["completed", "completed"]

    alerts = db.json("alerts", "--json")
    mine = [a for a in alerts if a.get("task_id") == tid]
    assert mine, alerts
    assert {"id", "kind", "task_id", "message", "created_at"} <= mine[0].keys()
    assert str(tid) in db.ok("alerts").stdout
    assert "error" in db.ok("task", "show", str(tid)).stdout

    assert_one_error_line(db.sw("task", "retry", str(tid), "--step", "no-such-step"))
    assert_one_error_line(db.sw("task", "retry", str(tid), "--step", "ship"))  # after the failed step
    assert db.task(tid)["state"] == "error"
    r = db.ok("task", "retry", str(tid))
    assert str(tid) in r.stdout

    def failed_again() -> dict[str, Any] | None:
        t = db.task(tid)
        return t if t["state"] == "error" and "retried" in kinds(t["events"]) else None

    t = wait_until(failed_again, 45, f"task {tid} to be retried and fail again", 0.2)
    assert t["steps"][0]["attempt"] >= 2, "the retry dispatched a new attempt"

    r = db.ok("task", "cancel", str(tid))
    assert str(tid) in r.stdout
    assert db.wait_state(tid, FINAL - {"error"})["state"] == "cancelled"
    # undone: a retry would send its steps again under the same idempotency keys (REL2)
    before = db.task(tid)
    line = assert_one_error_line(db.sw("task", "retry", str(tid)))
    assert "is cancelled: its effects were undone" in line and "submit a new task" in line, line
    assert db.task(tid) == before


def test_watch_of_a_task_that_does_not_finish_in_time_exits_1_and_says_so(tmp_path: Path) -> None:
    db = make_db(tmp_path, "w.db")
    tid = db.submit(order("slow"))  # no worker runs: it stays pending
    started = time.monotonic()
    r = sw("--db", db.url, "watch", str(tid), "--timeout", "0.6", cwd=tmp_path)
    assert 0.5 <= time.monotonic() - started < 10
    assert r.returncode == 1, str(r)
    assert "received" in r.stdout  # the events so far were printed
    assert r.stderr.strip() == f"error: task {tid} is still pending after 0.6s"
