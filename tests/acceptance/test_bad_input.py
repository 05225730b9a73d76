"""Bad command-line input: exit 2, one ``error:`` line on stderr, nothing written (SPEC 3, SUB4, REL4).

Every case runs on both stores, SQLite and PostgreSQL, against a store holding one task; the store
(every row of every table, read straight from the database) must be identical before and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from .helpers import (
    DEMO_APP,
    SW,
    WORKFLOW,
    Db,
    MiB,
    Result,
    assert_one_error_line,
    clean_env,
    make_db,
    order,
    refused_without_store,
    submit_in_process,
    sw,
)

GOOD = json.dumps(order())
SUBMIT = ("submit", WORKFLOW, "--input", GOOD)

# "{tid}" stands for the id of the task already in the store.
CASES: dict[str, tuple[str, ...]] = {
    # submit: the workflow and the input (SUB4)
    "unknown-workflow": ("submit", "no-such-workflow", "--input", GOOD),
    "non-json-input": ("submit", WORKFLOW, "--input", "{not json"),
    "empty-input": ("submit", WORKFLOW, "--input", ""),
    "nan-input": ("submit", WORKFLOW, "--input", '{"order_id": NaN}'),
    "infinite-input": ("submit", WORKFLOW, "--input", "1e999"),
    "missing-input-option": ("submit", WORKFLOW),
    "input-file-missing": ("submit", WORKFLOW, "--input", "@missing-file.json"),
    "input-file-empty-name": ("submit", WORKFLOW, "--input", "@"),
    "input-file-is-directory": ("submit", WORKFLOW, "--input", "@."),
    # submit: names (SUB4)
    "workflow-with-spaces": ("submit", "process order", "--input", GOOD),
    "workflow-sql": ("submit", ";DROP TABLE tasks", "--input", GOOD),
    "workflow-quote": ("submit", "process-order' OR '1'='1", "--input", GOOD),
    "workflow-empty": ("submit", "", "--input", GOOD),
    "workflow-too-long": ("submit", "w" * 129, "--input", GOOD),
    "reply-to-semicolon": (*SUBMIT, "--reply-to", "q;DROP TABLE messages"),
    "reply-to-space": (*SUBMIT, "--reply-to", "web 1"),
    "reply-to-slash": (*SUBMIT, "--reply-to", "../queue"),
    "reply-to-empty": (*SUBMIT, "--reply-to", ""),
    "reply-to-too-long": (*SUBMIT, "--reply-to", "q" * 129),
    "correlation-id-too-long": (*SUBMIT, "--correlation-id", "c" * 256),
    "correlation-id-escape": (*SUBMIT, "--correlation-id", "c\x1b[31md"),
    "correlation-id-newline": (*SUBMIT, "--correlation-id", "c\nd"),
    "correlation-id-empty": (*SUBMIT, "--correlation-id", ""),
    "idempotency-key-too-long": (*SUBMIT, "--idempotency-key", "k" * 256),
    "idempotency-key-bell": (*SUBMIT, "--idempotency-key", "k\x07"),
    "idempotency-key-tab": (*SUBMIT, "--idempotency-key", "k\tk"),
    "idempotency-key-trailing-newline": (*SUBMIT, "--idempotency-key", "k\n"),
    # submit: priority (SUB5)
    "priority-word": (*SUBMIT, "--priority", "high"),
    "priority-float": (*SUBMIT, "--priority", "1.5"),
    "priority-huge": (*SUBMIT, "--priority", "99999999999999999999"),
    "priority-over-int32": (*SUBMIT, "--priority", "2147483648"),
    "priority-under-int32": (*SUBMIT, "--priority", "-2147483648"),
    # task ids
    "show-word": ("task", "show", "abc"),
    "show-zero": ("task", "show", "0"),
    "show-negative": ("task", "show", "-1"),
    "show-float": ("task", "show", "1.0"),
    "show-20-digits": ("task", "show", "9" * 20),
    "show-sql": ("task", "show", "1 OR 1=1"),
    "show-unknown": ("task", "show", "999999"),
    "show-unknown-json": ("task", "show", "999999", "--json"),
    "cancel-unknown": ("task", "cancel", "999999"),
    "cancel-word": ("task", "cancel", "abc"),
    "retry-unknown": ("task", "retry", "999999"),
    "retry-pending-task": ("task", "retry", "{tid}"),
    "retry-sql-step": ("task", "retry", "{tid}", "--step", "x'; DROP TABLE steps; --"),
    "task-unknown-subcommand": ("task", "frobnicate", "{tid}"),
    # listings
    "tasks-state-bogus": ("tasks", "--state", "bogus"),
    "tasks-state-sql": ("tasks", "--state", "pending' OR '1'='1"),
    "tasks-limit-zero": ("tasks", "--limit", "0"),
    # watch
    "watch-neither": ("watch",),
    "watch-both": ("watch", "{tid}", "--reply-to", "q1"),
    "watch-unknown-task": ("watch", "999999", "--timeout", "10"),
    "watch-word": ("watch", "abc", "--timeout", "10"),
    "watch-timeout-word": ("watch", "{tid}", "--timeout", "soon"),
    "watch-timeout-negative": ("watch", "{tid}", "--timeout", "-1"),
    "watch-timeout-zero": ("watch", "{tid}", "--timeout", "0"),
    "watch-timeout-nan": ("watch", "{tid}", "--timeout", "nan"),
    # click usage errors are one line too
    "unknown-command": ("frobnicate",),
    "unknown-option": ("tasks", "--frobnicate"),
    "unknown-global-option": ("--frobnicate", "tasks"),
    "extra-argument": ("tasks", "extra"),
    "bad-log-level": ("--log-level", "LOUD", "tasks"),
    "missing-command": (),
    "demo-zero-orders": ("demo", "--orders", "0"),
    "demo-empty-db": ("demo", "--db", ""),
    # worker: validated before it runs
    "worker-roles-bogus": ("worker", "--roles", "bogus"),
    "worker-roles-empty": ("worker", "--roles", ""),
    "worker-agent-role-without-app": ("worker", "--roles", "agent"),
    "worker-app-no-such-module": ("worker", "--app", "nosuchmodule_stepwarden_test:app"),
    "worker-app-not-an-app": ("worker", "--app", "os:path"),
    "worker-app-no-attribute": ("worker", "--app", "stepwarden.demo.app:no_such_attr"),
    "worker-app-no-colon": ("worker", "--app", "stepwarden.demo.app"),
    "worker-name": ("worker", "--app", DEMO_APP, "--name", "bad name;"),
    "worker-concurrency-zero": ("worker", "--app", DEMO_APP, "--concurrency", "0"),
    "worker-retention-zero": ("worker", "--app", DEMO_APP, "--retention", "0"),
    "worker-retention-and-keep": ("worker", "--app", DEMO_APP, "--retention", "3", "--keep-finished"),
    "worker-dead-after-too-short": ("worker", "--app", DEMO_APP, "--dead-after", "1"),
    "worker-dead-after-not-a-number": ("worker", "--app", DEMO_APP, "--dead-after", "soon"),
    # nan compares false with every bound: a plain range would let it through
    "worker-dead-after-nan": ("worker", "--app", DEMO_APP, "--dead-after", "nan"),
    "worker-retention-nan": ("worker", "--app", DEMO_APP, "--retention", "nan"),
    "worker-retention-inf": ("worker", "--app", DEMO_APP, "--retention", "inf"),
    "worker-concurrency-word": ("worker", "--app", DEMO_APP, "--concurrency", "many"),
    "worker-agents-unknown": ("worker", "--app", DEMO_APP, "--agents", "bogus"),
    # Found by review: the agents named were ignored by a worker without the agent role.
    "worker-agents-without-agent-role": (
        "worker",
        "--app",
        DEMO_APP,
        "--roles",
        "scheduler",
        "--agents",
        "inventory",
    ),
}


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Db, int]:
    """One store of each kind per module with one pending task (correlation id, idempotency key and
    reply queue set).

    Shared by every case that must write nothing: each compares the store before and after itself.
    """
    pg = request.getfixturevalue("make_pg_db")() if request.param == "postgres" else None
    db = make_db(tmp_path_factory.mktemp("bad-input"), pg=pg)
    tid = submit_in_process(
        db.url, order("seed-1"), correlation_id="seed-1", idempotency_key="seed-key", reply_to="q1"
    )
    return db, tid


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Db:
    """A fresh store of each kind knowing the demo workflow, for the cases that write (REL4)."""
    pg = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    return make_db(tmp_path, pg=pg)


def refused_and_unchanged(db: Db, *args: str | bytes, **kw: object) -> str:
    """Run a bad command: exit 2 with one clear line, and the store exactly as it was."""
    before = db.snapshot()
    r = db.sw(*args, timeout=30, **kw)
    line = assert_one_error_line(r)
    assert len(line) < 400, f"an error line must be short, not echo the input: {line[:200]}..."
    assert db.snapshot() == before, f"a refused command changed the store\n{r}"
    return line


@pytest.mark.parametrize("args", list(CASES.values()), ids=list(CASES))
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    seeded: tuple[Db, int], args: tuple[str, ...]
) -> None:
    db, tid = seeded
    refused_and_unchanged(db, *(a.replace("{tid}", str(tid)) for a in args))


def test_unknown_workflow_names_the_workflow(seeded: tuple[Db, int]) -> None:
    line = refused_and_unchanged(seeded[0], "submit", "no-such-workflow", "--input", GOOD)
    assert "no-such-workflow" in line


@pytest.mark.parametrize("value", ["0", "10001"])
def test_a_bad_concurrency_names_the_option_typed(seeded: tuple[Db, int], value: str) -> None:
    """Not the settings class behind it (it said "WorkerSettings.concurrency must be ...")."""
    line = refused_and_unchanged(seeded[0], "worker", "--app", DEMO_APP, "--concurrency", value)
    assert "'--concurrency'" in line and "1<=x<=10000" in line, line


def test_input_file_over_1mib_is_refused(seeded: tuple[Db, int], tmp_path: Path) -> None:
    db, _ = seeded
    big = tmp_path / "big.json"
    big.write_text(json.dumps(order("x" * (2 * MiB))))
    line = refused_and_unchanged(db, "submit", WORKFLOW, "--input", f"@{big}")
    assert "limit" in line or "large" in line or "bytes" in line, line


def test_input_file_one_byte_over_the_limit_is_refused(seeded: tuple[Db, int], tmp_path: Path) -> None:
    db, _ = seeded
    text = json.dumps({"order_id": ""}, separators=(",", ":"))
    text = json.dumps({"order_id": "x" * (MiB + 1 - len(text))}, separators=(",", ":"))
    assert len(text.encode()) == MiB + 1
    f = tmp_path / "over.json"
    f.write_text(text)
    refused_and_unchanged(db, "submit", WORKFLOW, "--input", f"@{f}")


def test_a_pretty_printed_file_is_judged_by_its_compact_size(db: Db, tmp_path: Path) -> None:
    """1.6 MiB as written by ``jq .`` (indentation, a space after each colon), 0.9 MiB of compact
    JSON: App.submit takes it, and the command line refused it at the raw size. The compact limit
    still holds, and text far over it is refused unread."""
    fine = {"order_id": "p-1", "sku": "S", "quantity": 1, "amount_cents": 1, "lines": ["x" * 8] * 60_000}
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(fine, indent=4))
    compact = len(json.dumps(fine, separators=(",", ":")).encode())
    assert compact < MiB < pretty.stat().st_size
    r = db.sw("submit", WORKFLOW, "--input", f"@{pretty}", timeout=60)
    assert r.returncode == 0, str(r)
    assert db.json("task", "show", r.stdout.strip(), "--json")["state"] == "pending"
    over = dict(fine, lines=["x" * 8] * 120_000)  # 1.8 MiB compact
    pretty.write_text(json.dumps(over, indent=1))
    line = refused_and_unchanged(db, "submit", WORKFLOW, "--input", f"@{pretty}")
    assert "over the limit of 1048576 bytes" in line, line
    pretty.write_text(" " * (8 * MiB + 1) + "{}")
    line = refused_and_unchanged(db, "submit", WORKFLOW, "--input", f"@{pretty}")
    assert "as written, far over the limit" in line, line


def test_stdin_over_1mib_is_refused(seeded: tuple[Db, int]) -> None:
    db, _ = seeded
    refused_and_unchanged(db, "submit", WORKFLOW, "--input", "-", stdin=json.dumps(order("x" * (2 * MiB))))


def test_stdin_of_multibyte_text_over_1mib_in_bytes_is_refused(seeded: tuple[Db, int]) -> None:
    # 600 Ki characters, 1.2 MiB of UTF-8: the limit is in bytes.
    db, _ = seeded
    refused_and_unchanged(
        db, "submit", WORKFLOW, "--input", "-", stdin=json.dumps(order("é" * 600_000), ensure_ascii=False)
    )


def test_non_json_stdin_is_refused(seeded: tuple[Db, int]) -> None:
    refused_and_unchanged(seeded[0], "submit", WORKFLOW, "--input", "-", stdin="{not json")


def test_empty_stdin_is_refused(seeded: tuple[Db, int]) -> None:
    refused_and_unchanged(seeded[0], "submit", WORKFLOW, "--input", "-", stdin="")


def test_oversize_inline_input_is_refused(seeded: tuple[Db, int], tmp_path: Path) -> None:
    # Linux caps one command-line argument at 128 KiB (MAX_ARG_STRLEN), so an inline argument over 1 MiB
    # cannot reach the console script through exec; call the same entry point (stepwarden.cli:main, what
    # the console script runs with sys.argv[1:]) with the argument built inside the child.
    db, _ = seeded
    big = tmp_path / "inline.json"
    big.write_text(json.dumps(order("x" * (2 * MiB))))
    code = (
        "import sys; from stepwarden.cli import main; "
        "main(['--db', sys.argv[1], 'submit', 'process-order', '--input', open(sys.argv[2]).read()])"
    )
    before = db.snapshot()
    p = subprocess.run(
        [sys.executable, "-c", code, db.url, str(big)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=clean_env(),
    )
    r = Result(["(inline)"], p.returncode, p.stdout, p.stderr, 0.0)
    line = assert_one_error_line(r)
    assert len(line) < 400
    assert db.snapshot() == before


def test_big_inline_argument_is_accepted(db: Db) -> None:
    # The inline path itself works for big (but legal) inputs: 100 KiB.
    tid = db.submit(order("y" * (100 * 1024)))
    assert db.task(tid)["input"]["order_id"] == "y" * (100 * 1024)


def test_non_utf8_input_file_is_refused(seeded: tuple[Db, int], tmp_path: Path) -> None:
    f = tmp_path / "latin1.json"
    f.write_bytes(b'{"order_id": "caf\xe9"}')
    refused_and_unchanged(seeded[0], "submit", WORKFLOW, "--input", f"@{f}")


def test_deeply_nested_input_is_bad_input(seeded: tuple[Db, int], tmp_path: Path) -> None:
    f = tmp_path / "deep.json"
    f.write_text("[" * 100_000 + "]" * 100_000)
    refused_and_unchanged(seeded[0], "submit", WORKFLOW, "--input", f"@{f}")


def test_input_nested_past_the_depth_limit_is_bad_input(seeded: tuple[Db, int], tmp_path: Path) -> None:
    """150 levels: Python parses it, but the scheduler decoding it in its own stack failed every
    round (RecursionError at ~960 levels), holding up every other task; 100 is the limit."""
    f = tmp_path / "deep.json"
    f.write_text("[" * 150 + "]" * 150)
    refused_and_unchanged(seeded[0], "submit", WORKFLOW, "--input", f"@{f}")


def test_non_utf8_stdin_is_bad_input(seeded: tuple[Db, int]) -> None:
    refused_and_unchanged(seeded[0], "submit", WORKFLOW, "--input", "-", stdin=b'{"order_id": "caf\xe9"}')


def test_input_from_a_closed_standard_input_is_bad_input(seeded: tuple[Db, int]) -> None:
    """``submit --input - <&-``: Python then has no sys.stdin, and this was exit 1 with an
    AttributeError; it is bad input, named."""
    import subprocess

    from .helpers import SW, Result, clean_env

    db = seeded[0]
    before = db.snapshot()
    p = subprocess.run(
        [str(SW), "--db", db.url, "submit", WORKFLOW, "--input", "-"],
        cwd=db.cwd,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        preexec_fn=lambda: os.close(0),
    )
    r = Result(["submit"], p.returncode, p.stdout.decode(), p.stderr.decode(), 0.0)
    assert "standard input is closed" in assert_one_error_line(r)
    assert db.snapshot() == before


def test_lone_surrogate_in_json_is_bad_input(seeded: tuple[Db, int]) -> None:
    refused_and_unchanged(seeded[0], "submit", WORKFLOW, "--input", '{"order_id": "\\ud800"}')


def test_non_utf8_inline_argument_is_bad_input(seeded: tuple[Db, int]) -> None:
    refused_and_unchanged(seeded[0], "submit", WORKFLOW, "--input", b'{"order_id": "caf\xe9"}')


def test_input_from_an_endless_file_is_refused(seeded: tuple[Db, int], tmp_path: Path) -> None:
    # Under the bug the command reads /dev/zero until memory runs out; cap its address space at 768 MiB
    # so that ends in a second instead of taking the machine with it.
    import resource

    def cap_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (768 * MiB, 768 * MiB))

    db, _ = seeded
    before = db.snapshot()
    p = subprocess.run(
        [str(SW), "--db", db.url, "submit", WORKFLOW, "--input", "@/dev/zero"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=clean_env(),
        preexec_fn=cap_memory,
    )
    assert_one_error_line(Result(["@/dev/zero"], p.returncode, p.stdout, p.stderr, 0.0))
    assert db.snapshot() == before


@pytest.mark.parametrize(
    "args",
    [("worker", "--app", ".foo:app"), ("submit", WORKFLOW, "--input", GOOD, "--app", ".foo:app")],
    ids=["worker", "submit"],
)
def test_relative_app_module_is_bad_input(seeded: tuple[Db, int], args: tuple[str, ...]) -> None:
    refused_and_unchanged(seeded[0], *args)


def test_watch_timeout_that_ends_before_the_first_look_is_one_line(seeded: tuple[Db, int]) -> None:
    """A positive timeout shorter than the first look at the task is not bad input: the task is not
    final in time, so its events so far, then exit 1 with the one line that says so (not
    ``error: UnboundLocalError: ...``)."""
    db, tid = seeded
    before = db.snapshot()
    r = db.sw("watch", str(tid), "--timeout", "1e-9", timeout=30)
    assert r.returncode == 1 and "Traceback" not in r.stderr, str(r)
    assert len(r.stderr_lines) == 1, str(r)
    assert r.stderr_lines[0].startswith(f"error: task {tid} is still pending"), str(r)
    assert db.snapshot() == before


@pytest.mark.parametrize("value", ["", "c" * 256, "seed-1\n"], ids=["empty", "too-long", "control"])
def test_bad_correlation_id_filter_is_refused_by_name(seeded: tuple[Db, int], value: str) -> None:
    db, _ = seeded
    line = refused_and_unchanged(db, "tasks", "--correlation-id", value)
    assert "invalid correlation id" in line, line


def test_superscript_task_id_is_bad_input(seeded: tuple[Db, int]) -> None:
    refused_and_unchanged(seeded[0], "task", "show", "²")


def test_reply_queue_with_trailing_newline_is_refused(seeded: tuple[Db, int]) -> None:
    refused_and_unchanged(seeded[0], *SUBMIT, "--reply-to", "q\n")


@pytest.mark.parametrize("args", [(), ("task",)], ids=["no-arguments", "task-without-subcommand"])
def test_missing_command_is_help_or_one_line(tmp_path: Path, args: tuple[str, ...]) -> None:
    r = sw(*args, cwd=tmp_path)
    if r.returncode == 0:
        assert "Usage" in r.stdout and r.stderr.strip() == "", str(r)
    else:
        assert_one_error_line(r)


# Bad input that is refused before the store is opened, whatever the store holds.
NO_STORE_NEEDED = [
    ("submit", WORKFLOW, "--input", "{not json"),
    ("submit", "bad name", "--input", GOOD),
    (*SUBMIT, "--priority", "99999999999999999999"),
    (*SUBMIT, "--correlation-id", "c" * 256),
    ("tasks", "--state", "bogus"),
    ("watch",),
    ("worker", "--roles", "bogus"),
    ("worker", "--app", "os:path"),
    ("worker", "--app", DEMO_APP, "--agents", "bogus"),
    ("submit", "nosuch", "--input", GOOD, "--app", DEMO_APP),  # --app creates the store: not for this
]
NO_STORE_IDS = ["-".join(x[:12] for x in a[:3]) for a in NO_STORE_NEEDED]


@pytest.mark.parametrize("args", NO_STORE_NEEDED, ids=NO_STORE_IDS)
def test_bad_input_creates_no_store_file(tmp_path: Path, args: tuple[str, ...]) -> None:
    refused_without_store(tmp_path, *args)


@pytest.mark.parametrize("args", NO_STORE_NEEDED, ids=NO_STORE_IDS)
def test_bad_input_creates_no_table_in_an_empty_postgres_database(
    make_pg_db: Callable[..., str], tmp_path: Path, args: tuple[str, ...]
) -> None:
    """PostgreSQL's counterpart of the test above: the database exists, but a refused command must
    not migrate it (nor write anything else)."""
    db = Db(tmp_path / "unused.db", tmp_path, make_pg_db(empty=True))
    before = db.snapshot(require_schema=False)
    assert before["tables"] == [], before
    assert_one_error_line(db.sw(*args))
    assert db.snapshot(require_schema=False) == before, "a refused command wrote to an empty database"


@pytest.mark.parametrize("url", ["sqlite:///:memory:", "sqlite:///file::memory:?cache=shared"])
def test_an_in_memory_sqlite_store_is_refused(tmp_path: Path, url: str) -> None:
    """Each connection would see its own empty database: a submission would print an id and the
    task would be gone."""
    line = assert_one_error_line(sw("--db", url, "init", cwd=tmp_path))
    assert "must name a file" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "says"), [("d", "it is a directory"), ("a" * 300 + ".db", "longer than file systems allow")]
)
def test_a_sqlite_store_that_cannot_be_opened_is_named_with_the_reason(
    tmp_path: Path, name: str, says: str
) -> None:
    (tmp_path / "d").mkdir()
    line = assert_one_error_line(sw("--db", f"sqlite:///{tmp_path / name}", "init", cwd=tmp_path), code=1)
    assert "cannot open the SQLite store" in line and says in line, line
    assert len(line) < 400, line


def test_a_sqlite_store_locked_past_the_busy_timeout_at_open_says_how_long_it_waited(tmp_path: Path) -> None:
    """docs/cli.md said such a file was waited for up to 10 s, as an unreachable server; it is
    the busy timeout, and the line now says so, as a write's does (found by review)."""
    import sqlite3

    db = make_db(tmp_path, "locked.db")
    holder = sqlite3.connect(tmp_path / "locked.db", isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        r = sw("--db", f"{db.url}?busy_timeout=0.5", "init", cwd=tmp_path)
    finally:
        holder.close()
    line = assert_one_error_line(r, code=1)
    assert "cannot open the SQLite store" in line and "database is locked" in line, line
    assert "(another process kept it locked for 0." in line and "busy_timeout=SECONDS sets it)" in line, line


def test_a_limit_beyond_any_store_is_bad_input(tmp_path: Path) -> None:
    db = make_db(tmp_path)
    line = assert_one_error_line(db.sw("tasks", "--limit", "9223372036854775808"))
    assert "--limit" in line, line


def test_unsupported_store_url_is_bad_input(tmp_path: Path) -> None:
    r = sw("--db", "mysql://localhost/x", "tasks", cwd=tmp_path)
    assert_one_error_line(r)
    assert list(tmp_path.iterdir()) == []


# -- REL4: nothing a user sends is executed as SQL ------------------------------------------------


def test_sql_in_correlation_id_is_stored_literally(db: Db) -> None:
    before = db.snapshot()
    evil = "x'); DROP TABLE tasks; --"
    tid = db.submit(order("evil-1"), "--correlation-id", evil)
    after = db.snapshot()
    assert after["tables"] == before["tables"], "a table disappeared"
    assert after["counts"]["tasks"] == before["counts"]["tasks"] + 1
    rows = db.json("tasks", "--json")
    assert [t["correlation_id"] for t in rows if t["id"] == tid] == [evil]
    shown = db.task(tid)
    assert shown["correlation_id"] == evil
    assert shown["events"][0]["detail"].get("correlation_id") == evil
    assert "DROP" in db.ok("tasks").stdout, "the human listing shows the correlation id as text"
    # the filter takes it as a value too: exactly that task, and a tautology matches nothing
    assert [t["id"] for t in db.json("tasks", "--correlation-id", evil, "--json")] == [tid]
    assert db.json("tasks", "--correlation-id", "x' OR '1'='1", "--json") == []
    assert db.snapshot()["tables"] == before["tables"]


def test_sql_in_idempotency_key_matches_nothing_else(db: Db) -> None:
    seed_id = db.submit(order("seed-1"), "--idempotency-key", "seed-key")
    evil = "seed-key' OR '1'='1"
    first = db.submit(order("evil-2"), "--idempotency-key", evil)
    again = db.submit(order("evil-2"), "--idempotency-key", evil)
    assert first != seed_id, "the injected key matched the seed task's key"
    assert again == first
    assert db.task(first)["idempotency_key"] == evil


def test_sql_in_the_input_is_stored_literally(db: Db) -> None:
    data = order("'; DELETE FROM steps; --", sku='"); DROP TABLE events; --')
    before = db.snapshot()
    tid = db.submit(data)
    assert db.task(tid)["input"] == data
    after = db.snapshot()
    assert after["tables"] == before["tables"]
    assert after["counts"]["steps"] == before["counts"]["steps"] + 3


@pytest.mark.parametrize("correlation_id", ["[/]", "[bold]loud[/bold]"], ids=["closing-tag", "style"])
def test_markup_in_a_correlation_id_is_shown_literally(db: Db, correlation_id: str) -> None:
    tid = db.submit(order("markup"), "--correlation-id", correlation_id)
    for args in (("tasks",), ("task", "show", str(tid))):
        r = db.sw(*args)
        assert r.returncode == 0, str(r)
        assert correlation_id in r.stdout, f"the correlation id is not shown as sent\n{r}"


def test_sql_in_watched_reply_queue_reads_nothing_else(seeded: tuple[Db, int]) -> None:
    db, _ = seeded
    before = db.snapshot()
    r = db.sw("watch", "--reply-to", "q1' OR '1'='1", "--timeout", "0.5")
    if r.returncode == 0:
        assert r.stdout.strip() == "", f"the injected queue name read another queue's messages\n{r}"
    else:
        assert_one_error_line(r)
    assert db.snapshot() == before


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("stepwarden.demo.app:no_such_attr", "module 'stepwarden.demo.app' has no attribute 'no_such_attr'"),
        ("os:path", "'os:path' is not a stepwarden App (its type is module)"),
        (
            "stepwarden.demo.app:inventory",
            "'stepwarden.demo.app:inventory' is not a stepwarden App (its type is Agent)",
        ),
    ],
)
def test_an_app_reference_that_names_no_app_says_what_it_found(tmp_path: Path, ref: str, says: str) -> None:
    line = assert_one_error_line(sw("worker", "--app", ref, cwd=tmp_path))
    assert says in line, line


@pytest.mark.parametrize("code", ["", "0", "3", "'usage: shop.py [-h]'"])
def test_an_app_module_that_exits_at_import_says_so_in_one_line(tmp_path: Path, code: str) -> None:
    """A module that runs its script code at import (no ``if __name__ == "__main__"``) used to
    end the worker silently, with its exit code, even 0."""
    (tmp_path / "shopscript.py").write_text(f"import sys\nsys.exit({code})\n")
    line = refused_without_store(tmp_path, "worker", "--app", "shopscript:app")
    assert f"importing 'shopscript' for --app called sys.exit({code});" in line, line
    assert "__main__" in line, line


def test_a_busy_metrics_port_is_one_line_naming_it_and_creates_no_store(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = refused_without_store(
            tmp_path, "worker", "--app", DEMO_APP, "--metrics-port", str(port), code=1
        )
    assert f"127.0.0.1:{port}" in line and "--metrics-port" in line, line


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("prometheus_client", ("worker", "--app", DEMO_APP, "--metrics-port", "0")),
        ("uvicorn", ("dashboard", "--port", "0")),
    ],
)
def test_a_missing_extra_is_one_line_exit_1_naming_it_and_creates_no_store(
    tmp_path: Path, module: str, args: tuple[str, ...]
) -> None:
    """Without the ``dashboard`` extra both commands that need it say which install is missing,
    exit 1 (the machine lacks a package; the command line was right) and create no store."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    message = f"No module named {module!r}"
    (shadow / f"{module}.py").write_text(f"raise ModuleNotFoundError({message!r}, name={module!r})\n")
    missing = tmp_path / "never.db"
    env = clean_env(PYTHONPATH=str(shadow))
    r = sw("--db", f"sqlite:///{missing}", *args, cwd=tmp_path, env=env)
    line = assert_one_error_line(r, code=1)
    assert "pip install 'stepwarden[dashboard]'" in line and f"missing {module}" in line, line
    assert not missing.exists(), f"a refused command created the store file\n{r}"


def test_ctrl_c_during_a_command_exits_130_with_one_line(tmp_path: Path) -> None:
    """An interrupted command says so on one line and exits 130, the shell's code for SIGINT."""
    import signal
    import subprocess

    db = make_db(tmp_path)
    tid = db.submit(order("never-done"))
    p = subprocess.Popen(
        [str(SW), "--db", db.url, "watch", str(tid), "--timeout", "60"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a test run started in the background of a shell ignores SIGINT, the
        # child inherits that, and Python installs no KeyboardInterrupt handler over an ignored one.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        # watch prints the task's events first: once a line is out, the command is running
        assert p.stdout is not None and p.stdout.readline(), "watch printed nothing"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 130, (p.returncode, err)
    assert lines == ["error: interrupted"], err


def test_an_empty_db_option_is_bad_input_not_the_default_store(tmp_path: Path) -> None:
    line = assert_one_error_line(sw("--db", "", "init", cwd=tmp_path))
    assert "--db is empty" in line, line
    assert list(tmp_path.iterdir()) == [], "the default store was created"
    r = sw("init", cwd=tmp_path, env=clean_env(STEPWARDEN_DB=""))  # an empty variable is unset
    assert r.returncode == 0 and (tmp_path / "stepwarden.db").exists(), str(r)


def test_the_demo_with_a_store_it_cannot_open_leaves_nothing_behind(tmp_path: Path) -> None:
    r = sw("demo", "--db", "mysql://x", cwd=tmp_path, env=clean_env(TMPDIR=str(tmp_path)))
    assert_one_error_line(r)
    assert list(tmp_path.iterdir()) == [], "a work folder was left"


def test_a_dashboard_host_that_cannot_work_is_one_line(tmp_path: Path) -> None:
    db = make_db(tmp_path)
    # bad input, exit 2, as for worker --metrics-host (see tests/dashboard/test_command.py)
    line = assert_one_error_line(db.sw("dashboard", "--host", "bad host!", "--port", "0"))
    assert "bad host!" in line, line


# -- the input limit of the app named by --app (SUB4) -----------------------------------------------

LIMIT_APP = """
from stepwarden import App, Step

app = App(max_input_bytes={limit})
svc = app.agent("svc")


@svc.operation
def do(req):
    return None


app.workflow("big", [Step("do", "svc.do", complete_by=5)])
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_submit_with_app_takes_that_apps_larger_input_limit(tmp_path: Path, how: str) -> None:
    """An app configured for 4 MiB inputs accepts, through ``submit --app``, the 1.5 MiB input
    that ``app.submit`` accepts: the command line used to refuse it at the default 1 MiB."""
    (tmp_path / "bigapp.py").write_text(LIMIT_APP.format(limit=4 * MiB))
    db = make_db(tmp_path, demo=False)
    text = json.dumps({"blob": "x" * (3 * MiB // 2)})
    (tmp_path / "big.json").write_text(text)
    where = ("@big.json", None) if how == "file" else ("-", text)
    r = db.sw("submit", "big", "--app", "bigapp:app", "--input", where[0], stdin=where[1])
    assert r.returncode == 0, str(r)
    task_id = int(r.stdout.strip())
    shown = db.json("task", "show", str(task_id), "--json")
    assert shown["workflow"] == "big"


def test_submit_with_app_takes_that_apps_smaller_input_limit(tmp_path: Path) -> None:
    """And an app that allows only 1,000 bytes refuses 2,000 inline, with one line, writing nothing."""
    (tmp_path / "smallapp.py").write_text(LIMIT_APP.format(limit=1000))
    db = make_db(tmp_path, demo=False)
    before = db.json("tasks", "--json")
    r = db.sw("submit", "big", "--app", "smallapp:app", "--input", json.dumps({"blob": "x" * 2000}))
    line = assert_one_error_line(r)
    assert "over the limit of 1000 bytes" in line, line
    assert db.json("tasks", "--json") == before


def test_submit_with_an_app_whose_workflow_names_an_operation_its_agent_lacks_is_refused(
    tmp_path: Path,
) -> None:
    """SUB4, found by review: ``submit --app`` printed a task id for a workflow whose step names
    ``pay.chrage`` on an app whose agent ``pay`` has only ``charge``; the worker then refused to
    start on that app, and the task waited with no worker able to run it."""
    (tmp_path / "typo_app.py").write_text(
        "from stepwarden import App, Step\n"
        "app = App()\n"
        "pay = app.agent('pay')\n"
        "@pay.operation\n"
        "async def charge(req):\n"
        "    return None\n"
        "app.workflow('order', [Step('charge', 'pay.chrage')])\n"
    )
    line = refused_without_store(tmp_path, "submit", "order", "--input", "{}", "--app", "typo_app:app")
    assert "agent 'pay' has no operation 'chrage' (it has: charge)" in line, line
