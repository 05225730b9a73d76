"""Property-based fuzzing of every input surface (SUB4, REL4, SPEC section 3).

Whatever a user sends -- to ``App.submit`` / ``submit_async`` / ``transaction().submit``, to the
``Step`` / ``Workflow`` / ``Agent`` constructors, or on the command line -- the outcome is either
success or one clear error:

* from the API, an :class:`~stepwarden.errors.InputError` (a :class:`StepwardenError`), never
  another exception, and a refused call leaves every table of the store exactly as many rows as it
  had; an accepted one stores every value literally (REL4: SQL meta-characters are data);
* from the CLI, exit 0, or exit 2 (1 for operational failures) with exactly one ``error:`` line on
  stderr, nothing on stdout and no traceback, and the store unchanged: every row of every table (and
  on PostgreSQL the identity sequences) exactly as before.

Everything that touches a store runs on both, SQLite and PostgreSQL (the ``store_url`` and
``cli_db`` fixtures); the name fuzz below builds objects only and opens no store.

An oracle written from SPEC (names: 1-128 of ``[A-Za-z0-9_.:-]`` starting with a letter or digit;
keys: 1-255 printable characters; priorities: 32-bit integers; inputs: JSON of at most the size
limit, valid Unicode) says which of the two each generated call must be.

The CLI runs in-process through ``stepwarden.cli.main(argv)``, the console script's own entry
point, with ``STEPWARDEN_DEBUG=1`` so that an exception the CLI did not foresee propagates here
instead of being flattened into its catch-all ``error: TypeName: ...`` line. (``click.testing``'s
``CliRunner`` would run ``cli`` in standalone mode, where our ``InputError`` exits 1, not 2 as the
real ``main()`` does; ``test_in_process_cli_matches_the_console_script`` checks the in-process
runner against the real console script.)
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import decimal
import io
import json
import os
import random
import re
import string
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from stepwarden import App
from stepwarden.agent import Agent
from stepwarden.cli import main
from stepwarden.clock import FakeClock
from stepwarden.errors import InputError
from stepwarden.store import Store, open_store
from stepwarden.store import transitions as t
from stepwarden.store.core import _register
from stepwarden.workflow import Step, Workflow

from .helpers import WORKFLOW, Db, Result, assert_one_error_line, make_db, order, sw

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
)
MiB = 1024 * 1024
MAX_PRIORITY = 2**31 - 1
API_LIMIT = 600  # the App's max_input_bytes in the API fuzz, so that the size limit is reached
APP_WORKFLOW, STORED_WORKFLOW = "wf-app", "wf.stored:v2"  # defined in the App / only registered in the store

# -- the oracle (SPEC SUB4 and section 3) --------------------------------------------------------------

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


def good_name(v: object) -> bool:
    return isinstance(v, str) and NAME.fullmatch(v) is not None


def good_ident(v: object) -> bool:
    return isinstance(v, str) and IDENT.fullmatch(v) is not None


def good_ref(v: object) -> bool:
    if not isinstance(v, str):
        return False
    agent, sep, op = v.partition(".")
    return bool(sep) and good_ident(agent) and good_ident(op)


def good_key(v: object) -> bool:
    return isinstance(v, str) and 1 <= len(v) <= 255 and v.isprintable()


def good_priority(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) <= MAX_PRIORITY


def as_json(value: Any, limit: int) -> str | None:
    """The JSON text a task input must be stored as, or None when it must be refused."""
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
        size = len(text.encode())
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError):
        return None
    return text if size <= limit and _keys_are_text(value) else None


def _keys_are_text(value: Any) -> bool:
    """Every dict key in ``value`` is text: one json.dumps would turn into text (``1`` -> ``"1"``)
    is refused, not stored under another key."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                return False
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return True


# -- strategies -------------------------------------------------------------------------------------------

SQL_BITS = (
    "'",
    '"',
    ";",
    "--",
    "/*",
    "*/",
    "%",
    "%s",
    "%(x)s",
    "?",
    "?1",
    ":name",
    "$1",
    "\\",
    "`",
    "[",
    "]",
    "(",
    ")",
    ",",
    " ",
    "' OR '1'='1",
    "'); DROP TABLE tasks; --",
    "; DELETE FROM steps",
    " UNION SELECT * FROM leases --",
    "NULL",
    "\n",
)
EDGE_TEXT = (
    "",
    " ",
    "a",
    "A" * 128,
    "A" * 129,
    "k" * 255,
    "k" * 256,
    "x\n",
    "\n",
    "\t",
    "é",
    "日本",
    "\u2028",
    "\u00a0",
    "\u200b",
    "\x1b[31m",
    "\udc80",
    "\ud800",
    "١٢٣",
    "²",
    "-1",
    "0",
    "+5",
    "1_000",
    " 7 ",
    "9" * 19,
    "[/]",
    "${HOME}",
    "$(id)",
    "`id`",
    "{{7*7}}",
    "../etc/passwd",
)
sql_text = st.lists(
    st.one_of(st.sampled_from(SQL_BITS), st.text(string.ascii_letters + string.digits, max_size=3)),
    min_size=1,
    max_size=6,
).map("".join)
any_text = st.one_of(st.text(max_size=24), sql_text, st.sampled_from(EDGE_TEXT))
cli_text = any_text.filter(lambda s: "\x00" not in s)  # an argv string cannot hold NUL
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines() breaks on
valid_name = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,20}", fullmatch=True)
valid_ident = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,12}", fullmatch=True)
non_str = st.one_of(
    st.none(),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.builds(object),
)


def _deep(n: int) -> Any:
    v: Any = []
    for _ in range(n):
        v = [v]
    return v


def _circular() -> Any:
    v: list[Any] = [1]
    v.append(v)
    return v


# Inputs that are not JSON, or are JSON in a way that must be refused, built fresh for each use.
ODD_VALUES: tuple[Callable[[], Any], ...] = (
    lambda: b"bytes",
    lambda: {1, 2},
    lambda: object(),
    lambda: 1 + 2j,
    lambda: decimal.Decimal("1.5"),
    lambda: datetime.date(2024, 1, 1),
    lambda: float("nan"),
    lambda: float("inf"),
    lambda: {(1, 2): "tuple key"},
    lambda: {float("nan"): 1},
    lambda: 10**5000,
    lambda: _deep(100_000),
    lambda: _circular(),
    lambda: "\ud800",
    lambda: {"\udc80": 1},
    lambda: "x" * API_LIMIT,
    lambda: ["é" * (API_LIMIT // 2)],
)
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=16),
    sql_text,
)
json_values = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=6), sql_text), inner, max_size=4),
    ),
    max_leaves=12,
)
api_inputs = st.one_of(
    json_values,
    st.sampled_from(ODD_VALUES).map(lambda make: make()),
    st.recursive(
        st.one_of(json_leaf, st.sampled_from(ODD_VALUES[:9]).map(lambda make: make())),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.tuples(inner, inner),
            st.dictionaries(
                st.one_of(st.text(max_size=4), st.integers(), st.none(), st.booleans()), inner, max_size=3
            ),
        ),
        max_leaves=6,
    ),
)


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(st.none(), strategy)


# Half of the examples draw every argument from its valid strategy, so that acceptance is exercised
# as much as refusal; the other half mix valid and fuzzed arguments freely.
ALL_VALID = st.shared(st.booleans(), key="all arguments valid")


def mix(valid: st.SearchStrategy[Any], fuzz: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return ALL_VALID.flatmap(lambda clean: valid if clean else st.one_of(valid, fuzz))


printable_keys = st.one_of(
    st.text(st.one_of(st.characters(exclude_categories=("C", "Z")), st.just(" ")), min_size=1, max_size=30),
    sql_text.filter(good_key),
)
finite_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        printable_keys,
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(printable_keys, inner, max_size=4)),
    max_leaves=10,
)

# JSON strings whose encoding is a few bytes either side of the App's limit (ASCII, or two-byte
# characters: the limit is in bytes).
near_the_limit = st.one_of(
    st.integers(API_LIMIT - 4, API_LIMIT + 4).map(lambda n: "x" * (n - 2)),
    st.integers(API_LIMIT // 2 - 3, API_LIMIT // 2 + 2).map(lambda n: "é" * (n - 1)),
)


# -- helpers ---------------------------------------------------------------------------------------------


def _tables(tx: Any, dialect: str) -> list[str]:
    if dialect == "sqlite":
        rows = tx.sql("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
    else:
        rows = tx.sql("SELECT tablename AS name FROM pg_tables WHERE schemaname = current_schema()")
    return sorted(str(r["name"]) for r in rows)


def table_counts(store: Store) -> dict[str, int]:
    """The row count of every table of the store (whatever migrations added)."""

    def run(tx: Any) -> dict[str, int]:
        return {
            name: int(tx.sql(f"SELECT COUNT(*) AS n FROM {name}")[0]["n"])
            for name in _tables(tx, store.dialect)
        }

    return store.transact_sync(run)


SEQUENCES = "(sequences)"


def store_snapshot(store: Store) -> dict[str, Any]:
    """Everything a write could change: every row of every table (sorted), and where the counters of
    new ids stand (PostgreSQL's identity sequences, SQLite's sqlite_sequence): a refused call must not
    even have started an INSERT."""

    def run(tx: Any) -> dict[str, Any]:
        out: dict[str, Any] = {
            name: sorted(repr(tuple(dict(r).items())) for r in tx.sql(f"SELECT * FROM {name}"))
            for name in _tables(tx, store.dialect)
        }
        if store.dialect == "sqlite":
            seqs = "SELECT name, seq FROM sqlite_sequence"
        else:
            seqs = "SELECT sequencename, last_value FROM pg_sequences WHERE schemaname = current_schema()"
        out[SEQUENCES] = sorted(repr(tuple(dict(r).items())) for r in tx.sql(seqs))
        return out

    return store.transact_sync(run)


def rows_of(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A snapshot without the id counters: an idempotent submission that returns the existing task
    (SUB3) writes no row, but PostgreSQL's INSERT ... ON CONFLICT may still have drawn an id."""
    return {k: v for k, v in snapshot.items() if k != SEQUENCES}


def task_row(store: Store, task_id: int) -> dict[str, Any]:
    rows = store.transact_sync(
        lambda tx: tx.sql(
            "SELECT workflow, correlation_id, idempotency_key, reply_to, priority, input "
            "FROM tasks WHERE id = ?",
            (task_id,),
        )
    )
    assert len(rows) == 1, f"no task {task_id}"
    return dict(rows[0])


def task_with_key(store: Store, key: str, workflow: str | None = None) -> int | None:
    """The task that holds ``key``; with ``workflow``, -1 if a task of another workflow holds it
    (SUB3: such a submission is refused, the key being reused by mistake)."""
    if not good_key(key):
        return None
    rows = store.transact_sync(
        lambda tx: tx.sql("SELECT id, workflow FROM tasks WHERE idempotency_key = ?", (key,))
    )
    if not rows:
        return None
    return -1 if workflow is not None and rows[0]["workflow"] != workflow else int(rows[0]["id"])


# -- the API ---------------------------------------------------------------------------------------------


@pytest.fixture
def fuzz_app(store_url: str) -> Iterator[App]:
    """An App on a fresh store of each kind, with one workflow of its own and one known only to the store."""
    app = App(store_url, max_input_bytes=API_LIMIT)
    app.workflow(APP_WORKFLOW, [Step("a", "svc.do_a", compensate="svc.undo_a"), Step("b", "svc.do_b")])
    stored = Workflow.of(STORED_WORKFLOW, [Step("only", "svc.do_only")])
    app.store.transact_sync(_register, [stored], "fuzz")
    yield app
    app.close()


def _submit(app: App, surface: str, workflow: Any, value: Any, **kw: Any) -> int:
    if surface == "submit":
        return app.submit(workflow, value, **kw)
    if surface == "submit_async":
        return asyncio.run(app.submit_async(workflow, value, **kw))
    with app.transaction() as tx:
        return tx.submit(workflow, value, **kw)


def test_api_submission_succeeds_or_refuses_clearly_and_writes_nothing_when_refused(fuzz_app: App) -> None:
    app = fuzz_app
    steps_of = {APP_WORKFLOW: 2, STORED_WORKFLOW: 1}

    @settings(FUZZ, max_examples=60)
    @given(
        surface=st.sampled_from(["submit", "submit_async", "transaction"]),
        workflow=mix(
            st.sampled_from([APP_WORKFLOW, STORED_WORKFLOW]),
            st.one_of(st.just("wf-unknown"), any_text, non_str),
        ),
        value=mix(st.one_of(finite_json, near_the_limit), api_inputs),
        correlation_id=optional(mix(printable_keys, st.one_of(any_text, non_str))),
        idempotency_key=optional(
            mix(st.one_of(st.sampled_from(["key-1", "key-2"]), printable_keys), st.one_of(any_text, non_str))
        ),
        priority=mix(
            st.integers(-MAX_PRIORITY, MAX_PRIORITY),
            st.one_of(
                st.integers(-(2**40), 2**40),
                st.sampled_from([MAX_PRIORITY + 1, -MAX_PRIORITY - 1, 2**63, 2**64]),
                non_str,
            ),
        ),
        reply_to=optional(mix(valid_name, st.one_of(any_text, non_str))),
    )
    def check(
        surface: str,
        workflow: Any,
        value: Any,
        correlation_id: Any,
        idempotency_key: Any,
        priority: Any,
        reply_to: Any,
    ) -> None:
        text = as_json(value, API_LIMIT)
        valid = (
            good_name(workflow)
            and text is not None
            and (correlation_id is None or good_key(correlation_id))
            and (idempotency_key is None or good_key(idempotency_key))
            and good_priority(priority)
            and (reply_to is None or good_name(reply_to))
        )
        ok = valid and workflow in steps_of
        existing = (
            task_with_key(app.store, idempotency_key, workflow)
            if ok and idempotency_key is not None
            else None
        )
        ok = ok and existing != -1  # the key is another workflow's task: refused
        before, snap = table_counts(app.store), store_snapshot(app.store)
        kw = {
            "correlation_id": correlation_id,
            "idempotency_key": idempotency_key,
            "priority": priority,
            "reply_to": reply_to,
        }
        try:
            task_id = _submit(app, surface, workflow, value, **kw)
        except InputError as e:
            note(f"refused: {e}")
            event(f"refused: {type(e).__name__}")
            assert not ok, f"{surface} refused a valid submission: {e}"
            assert str(e) and "\n" not in str(e)
            assert store_snapshot(app.store) == snap, "a refused submission wrote to the store"
            return
        assert ok, f"{surface} accepted what SUB4 refuses: task {task_id}"
        event(f"accepted by {surface}")
        after = table_counts(app.store)
        if existing is not None:  # SUB3: the existing task, nothing written
            assert task_id == existing and rows_of(store_snapshot(app.store)) == rows_of(snap)
            return
        assert (after["tasks"], after["steps"]) == (before["tasks"] + 1, before["steps"] + steps_of[workflow])
        row = task_row(app.store, task_id)
        assert row == {
            "workflow": workflow,
            "correlation_id": correlation_id,
            "idempotency_key": idempotency_key,
            "reply_to": reply_to,
            "priority": priority,
            "input": text,
        }, "the task was not stored literally (REL4)"

    check()


# kind -> (build it from a name, complete_by and on_error; which names SPEC allows; do the Step's
# complete_by and on_error matter). on_error is any str on purpose ("", "ERROR"), hence the ignores.
MAKERS: dict[str, tuple[Callable[[str, float, str], object], Callable[[object], bool], bool]] = {
    "Step name": (lambda n, cb, oe: Step(n, "svc.op", complete_by=cb, on_error=oe), good_ident, True),  # type: ignore[arg-type]
    "Step operation": (lambda n, cb, oe: Step("s", n, complete_by=cb, on_error=oe), good_ref, True),  # type: ignore[arg-type]
    "Step compensate": (
        lambda n, cb, oe: Step("s", "svc.op", complete_by=cb, compensate=n, on_error=oe),  # type: ignore[arg-type]
        good_ref,
        True,
    ),
    "Workflow name": (lambda n, cb, oe: Workflow.of(n, [Step("s", "svc.op")]), good_name, False),
    "App.workflow name": (
        lambda n, cb, oe: App("sqlite:///never-opened.db").workflow(n, [Step("s", "svc.op")]),
        good_name,
        False,
    ),
    "Agent name": (lambda n, cb, oe: Agent(n), good_ident, False),
    "App.agent name": (lambda n, cb, oe: App("sqlite:///never-opened.db").agent(n), good_ident, False),
}


@settings(FUZZ, max_examples=200)
@given(
    kind=st.sampled_from(sorted(MAKERS)),
    name=st.one_of(
        valid_ident,
        valid_name,
        any_text,
        st.from_regex(r"[A-Za-z_]\w{0,8}\.[A-Za-z_]\w{0,8}", fullmatch=True),
    ),
    complete_by=st.one_of(st.floats(), st.integers(-10, 10**7)),
    on_error=st.sampled_from(["error", "compensate", "wait", "", "ERROR"]),
)
def test_names_are_valid_or_refused_with_input_error(
    kind: str, name: str, complete_by: float, on_error: str
) -> None:
    """Step, Workflow and Agent names (SUB4 "malformed names"): constructed, or InputError."""
    make, allowed, is_step = MAKERS[kind]
    ok = allowed(name) and (
        not is_step or (0.1 <= complete_by <= 7 * 86400 and on_error in ("error", "compensate"))
    )
    try:
        made = make(name, complete_by, on_error)
    except InputError as e:
        assert not ok, f"{kind} {name!r} refused: {e}"
        return
    assert ok, f"{kind} {name!r} accepted: {made!r}"


@settings(FUZZ, max_examples=20)
@given(ref=non_str.filter(lambda v: v is not None), where=st.sampled_from(["operation", "compensate"]))
def test_a_non_str_operation_reference_is_refused_with_input_error(ref: Any, where: str) -> None:
    """Found by this fuzz: split_operation called ``ref.partition`` on whatever it was given, so
    ``Step("s", 1)`` raised AttributeError (bytes: TypeError) instead of InputError."""
    try:
        if where == "operation":
            Step("s", ref)
        else:
            Step("s", "svc.op", compensate=ref)
    except InputError:
        return
    except Exception as e:  # the old bug: a bare AttributeError / TypeError from str methods
        raise AssertionError(f"Step({where}={ref!r}) raised {type(e).__name__}: {e}") from e
    raise AssertionError(f"Step({where}={ref!r}) was accepted")


# -- the CLI ---------------------------------------------------------------------------------------------


def run_cli(cwd: Path, *args: str, stdin: bytes = b"", debug: bool = True) -> Result:
    """``stepwarden ARGS`` in-process: the console script's ``main(argv)``, its exit code, stdout and
    stderr; an exception the CLI did not foresee propagates (``STEPWARDEN_DEBUG``)."""
    out, err = io.StringIO(), io.StringIO()
    saved_stdin, saved_path = sys.stdin, sys.path[:]  # `--app` puts the working directory on sys.path
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWARDEN_")}
    if debug:
        env["STEPWARDEN_DEBUG"] = "1"
    code = 0
    try:
        with (
            mock.patch.dict(os.environ, env, clear=True),
            contextlib.chdir(cwd),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdin, sys.path[:] = saved_stdin, saved_path
    return Result(list(args), code, out.getvalue(), err.getvalue(), 0.0)


def refused(r: Result, codes: tuple[int, ...] = (2,)) -> str:
    """A refusal as the CLI contract says: one short ``error:`` line, nothing else."""
    assert r.returncode in codes, str(r)
    line = assert_one_error_line(r, r.returncode)
    assert len(line) < 400, f"an error line must be short, not echo the input: {line[:200]}..."
    return line


@contextlib.contextmanager
def unchanged(db: Db) -> Iterator[None]:
    """The block (refused commands) leaves every row of the store as it was."""
    store = open_store(db.url)
    try:
        before = store_snapshot(store)
        yield
        assert store_snapshot(store) == before, "a refused command wrote to the store"
    finally:
        store.close()


def _drive(store: Store, outcome: str) -> None:
    """Claim, take and answer every pending step once, as a worker would (for seeding)."""
    store.transact_sync(t.claim_and_dispatch, "seed-scheduler", 10)
    msgs = asyncio.run(store.claim_requests("seed-agent", ["inventory", "payments", "shipping"], 10))
    for m in msgs:
        asyncio.run(store.send_reply("seed-agent", m.id, outcome, {"ok": True}, "declined"))
    store.transact_sync(t.apply_replies, "seed-scheduler", 10, random.Random(0))


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def cli_db(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Db, dict[str, int]]:
    """One store of each kind for the CLI fuzz, knowing the demo workflow, with tasks in several states."""
    pg = request.getfixturevalue("make_pg_db")() if request.param == "postgres" else None
    db = make_db(tmp_path_factory.mktemp("fuzz-cli"), pg=pg)
    app = App(db.url)
    store = open_store(db.url, clock=FakeClock())  # no deadline can pass while seeding
    app.use_store(store)
    try:
        ids = {"error": app.submit(WORKFLOW, order("seed-error"), correlation_id="seed-error")}
        _drive(store, "error")
        ids["processed"] = app.submit(WORKFLOW, order("seed-done"), idempotency_key="seed-key", reply_to="q1")
        for _ in range(3):
            _drive(store, "ok")
        ids["pending"] = app.submit(WORKFLOW, order("seed-pending"), correlation_id="seed-pending")
        states = {k: _state(store, i) for k, i in ids.items()}
        assert states == {"error": "error", "processed": "processed", "pending": "pending"}, states
    finally:
        app.close()
    return db, ids


def _state(store: Store, task_id: int) -> str:
    return str(
        store.transact_sync(lambda tx: tx.sql("SELECT state FROM tasks WHERE id = ?", (task_id,)))[0]["state"]
    )


def json_texts(values: st.SearchStrategy[Any]) -> st.SearchStrategy[str]:
    return st.builds(lambda v, ascii_only: json.dumps(v, ensure_ascii=ascii_only), values, st.booleans())


def json_sources(values: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[str, str | bytes]]:
    return st.one_of(
        json_texts(values).map(lambda s: ("inline", s)),
        json_texts(values).map(lambda s: ("stdin", s.encode("utf-8", "surrogatepass"))),
        json_texts(values).map(lambda s: ("file", s.encode("utf-8", "surrogatepass"))),
    )


input_sources = st.one_of(
    json_sources(json_values),
    cli_text.map(lambda s: ("inline", s)),
    st.binary(max_size=24).map(lambda b: ("stdin", b)),
    st.binary(max_size=24).map(lambda b: ("file", b)),
    st.sampled_from(
        ["@", "@missing.json", "@.", "@/", "@" + "x" * 300, "-", "NaN", "[1e999]", '"\\ud800"', "[" * 5000]
    ).map(lambda s: ("inline", s)),
)


def expected_cli_input(kind: str, data: str | bytes) -> str | None:
    """What the CLI must store for ``--input`` (its JSON text re-encoded), or None if it is bad input."""
    if isinstance(data, bytes):
        if len(data) > MiB:
            return None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return None
    else:
        text = data
        if kind == "inline" and (text == "-" or text.startswith("@")):
            return None  # our inline values never name an existing file, nor stdin
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return as_json(value, MiB)


@settings(FUZZ, max_examples=120)
@given(
    workflow=mix(st.just(WORKFLOW), st.one_of(valid_name, cli_text)),
    source=mix(json_sources(finite_json), input_sources),
    correlation_id=optional(mix(printable_keys, cli_text)),
    idempotency_key=optional(
        mix(st.one_of(st.sampled_from(["seed-key", "cli-key"]), printable_keys), cli_text)
    ),
    reply_to=optional(mix(valid_name, cli_text)),
    priority=optional(
        mix(
            st.integers(-MAX_PRIORITY, MAX_PRIORITY).map(str),
            st.one_of(st.integers(-(2**33), 2**33).map(str), cli_text),
        )
    ),
)
def test_cli_submit_succeeds_or_exits_2_with_one_line_and_writes_nothing(
    cli_db: tuple[Db, dict[str, int]],
    workflow: str,
    source: tuple[str, str | bytes],
    correlation_id: str | None,
    idempotency_key: str | None,
    reply_to: str | None,
    priority: str | None,
) -> None:
    db, _ = cli_db
    kind, data = source
    stdin = b""
    if kind == "inline":
        assert isinstance(data, str)
        arg = data
    elif kind == "stdin":
        assert isinstance(data, bytes)
        arg, stdin = "-", data
    else:
        assert isinstance(data, bytes)
        (db.cwd / "input.json").write_bytes(data)
        arg = "@input.json"
    args = ["submit", "--input", arg]
    for opt, v in (
        ("--correlation-id", correlation_id),
        ("--idempotency-key", idempotency_key),
        ("--reply-to", reply_to),
        ("--priority", priority),
    ):
        if v is not None:
            args += [opt, v]
    args += ["--", workflow]  # the workflow is taken literally, even when it looks like an option
    text = expected_cli_input(kind, data)
    prio: int | None = 0
    if priority is not None:
        try:
            prio = int(priority)
        except ValueError:
            prio = None
    ok = (
        workflow == WORKFLOW
        and text is not None
        and (correlation_id is None or good_key(correlation_id))
        and (idempotency_key is None or good_key(idempotency_key))
        and (reply_to is None or good_name(reply_to))
        and prio is not None
        and good_priority(prio)
    )
    store = open_store(db.url)
    try:
        existing = task_with_key(store, idempotency_key) if ok and idempotency_key is not None else None
        before = store_snapshot(store)
        r = run_cli(db.cwd, "--db", db.url, *args, stdin=stdin)
        event(f"submit from {kind}: exit {r.returncode}")
        if not ok:
            refused(r)
            assert store_snapshot(store) == before, f"a refused submit wrote to the store\n{r}"
            return
        assert r.returncode == 0 and r.stderr == "", str(r)
        out = r.stdout.strip()
        assert out.isdigit(), str(r)
        task_id = int(out)
        if existing is not None:
            assert task_id == existing and rows_of(store_snapshot(store)) == rows_of(before)
            return
        row = task_row(store, task_id)
        assert row == {
            "workflow": WORKFLOW,
            "correlation_id": correlation_id,
            "idempotency_key": idempotency_key,
            "reply_to": reply_to,
            "priority": prio,
            "input": text,
        }, "the task was not stored literally (REL4)"
    finally:
        store.close()


task_ids = mix(
    st.sampled_from(["error", "processed", "pending"]),  # a seeded task, by its state
    st.one_of(st.integers(-3, 10**20).map(str), cli_text),
)


@settings(FUZZ, max_examples=120)
@given(
    command=st.sampled_from(
        ["show", "show --json", "retry", "retry --step", "cancel", "watch", "alerts ack"]
    ),
    task_id=task_ids,
    extra=cli_text,
    timeout=st.sampled_from(["0", "0.05", "-1", "nan", "soon", "", "1e-9"]),
)
def test_cli_task_commands_succeed_or_fail_with_one_line_and_write_nothing_when_they_fail(
    cli_db: tuple[Db, dict[str, int]], command: str, task_id: str, extra: str, timeout: str
) -> None:
    db, ids = cli_db
    tid = str(ids[task_id]) if task_id in ids else task_id
    args = {
        "show": ["task", "show", "--", tid],
        "show --json": ["task", "show", "--json", "--", tid],
        "retry": ["task", "retry", "--", tid],
        "retry --step": ["task", "retry", "--step", extra, "--", tid],
        "cancel": ["task", "cancel", "--", tid],
        "watch": ["watch", "--timeout", timeout, "--", tid],
        "alerts ack": ["alerts", "ack", "--by", extra, "--", tid],
    }[command]
    good_id = tid.isascii() and tid.isdigit() and len(tid) <= 18 and int(tid) >= 1
    store = open_store(db.url)
    try:
        before = store_snapshot(store)
        r = run_cli(db.cwd, "--db", db.url, *args)
        event(f"{command}: exit {r.returncode}")
        if command == "watch" and r.returncode == 1 and good_id and " is still " in r.stderr:
            # Not a refusal: the task was not final in time. Its events so far are printed, and
            # the one error line says so.
            assert r.stderr_lines == [r.stderr_lines[0]] and r.stderr.startswith("error: task "), str(r)
            assert store_snapshot(store) == before, f"a read-only command wrote to the store\n{r}"
            return
        if r.returncode != 0:
            refused(r, (1, 2))
            if not good_id:
                assert r.returncode == 2, str(r)
            assert store_snapshot(store) == before, f"a refused command wrote to the store\n{r}"
            return
        assert good_id, f"an invalid id was accepted\n{r}"
        assert r.stderr == "", str(r)
        if command == "show --json":
            assert json.loads(r.stdout)["id"] == int(tid)
        if command in ("show", "show --json", "watch"):
            assert store_snapshot(store) == before, f"a read-only command wrote to the store\n{r}"
    finally:
        store.close()


@settings(FUZZ, max_examples=60)
@given(
    command=st.sampled_from(["tasks", "alerts", "leases", "workers"]),
    state=optional(st.one_of(st.sampled_from(["pending", "error", "processed", "cancelled"]), cli_text)),
    limit=optional(st.one_of(st.integers(-2, 5).map(str), cli_text)),
    as_json=st.booleans(),
    log_level=optional(st.one_of(st.sampled_from(["DEBUG", "info", "WARNING", "ERROR"]), cli_text)),
)
def test_cli_listings_print_or_exit_2_and_never_write(
    cli_db: tuple[Db, dict[str, int]],
    command: str,
    state: str | None,
    limit: str | None,
    as_json: bool,
    log_level: str | None,
) -> None:
    db, _ = cli_db
    args: list[str] = ["--db", db.url]
    if log_level is not None:
        args += ["--log-level", log_level]
    args.append(command)
    if command == "tasks" and state is not None:
        args += ["--state", state]
    if command == "tasks" and limit is not None:
        args += ["--limit", limit]
    if as_json:
        args.append("--json")
    store = open_store(db.url)
    try:
        before = store_snapshot(store)
        r = run_cli(db.cwd, *args)
        assert store_snapshot(store) == before, f"a listing wrote to the store\n{r}"
    finally:
        store.close()
    good = (
        (log_level is None or log_level.casefold() in ("debug", "info", "warning", "error"))
        and (
            command != "tasks"
            or state is None
            or state
            in ("pending", "processing", "processed", "error", "compensating", "compensated", "cancelled")
        )
        and (command != "tasks" or limit is None or _positive_int(limit))
    )
    if not good:
        refused(r)
        return
    assert r.returncode == 0 and r.stderr == "", str(r)
    if as_json:
        rows = json.loads(r.stdout)
        assert isinstance(rows, list)
        if command == "tasks" and state is not None:
            assert {row["state"] for row in rows} <= {state}


def _positive_int(text: str) -> bool:
    try:
        return int(text) >= 1
    except ValueError:
        return False


@settings(FUZZ, max_examples=60)
@given(
    roles=optional(
        st.one_of(st.sampled_from(["scheduler", "agent,supervisor", "", ",", "scheduler,,agent"]), cli_text)
    ),
    agents=optional(st.one_of(st.sampled_from(["inventory", "", "nope"]), cli_text)),
    concurrency=optional(st.one_of(st.integers(-1, 20_000).map(str), cli_text)),
    name=optional(st.one_of(valid_ident, cli_text)),
    app_ref=st.one_of(
        st.sampled_from(
            [".foo:app", "os:path", ":", "a:", ":b", "stepwarden.demo.app", "stepwarden:__version__"]
        ),
        cli_text.map(lambda s: f"sw_fuzz_no_such_module_{s}:app"),
        cli_text.map(lambda s: f"os:{s}"),  # a module that imports, without such an App
    ),
)
def test_cli_worker_arguments_are_refused_before_anything_runs(
    cli_db: tuple[Db, dict[str, int]],
    roles: str | None,
    agents: str | None,
    concurrency: str | None,
    name: str | None,
    app_ref: str,
) -> None:
    """Every generated --app is unusable, so a worker never starts: each call must be exit 2, one line."""
    db, _ = cli_db
    args = ["--db", db.url, "worker", "--app", app_ref]
    for opt, v in (
        ("--roles", roles),
        ("--agents", agents),
        ("--concurrency", concurrency),
        ("--name", name),
    ):
        if v is not None:
            args += [opt, v]
    store = open_store(db.url)
    try:
        before = store_snapshot(store)
        r = run_cli(db.cwd, *args)
        refused(r)
        assert store_snapshot(store) == before, f"a refused worker wrote to the store\n{r}"
    finally:
        store.close()


@settings(FUZZ, max_examples=40)
@given(
    url=st.one_of(
        cli_text.filter(lambda s: not s.startswith(("sqlite:", "postgres"))),
        cli_text.filter(lambda s: not s.startswith("/")).map(lambda s: "sqlite:///" + s),
        st.sampled_from(
            [
                "sqlite:///",
                "sqlite://",
                "sqlite:",
                "sqlite:///.",
                "sqlite:///no/such/dir/x.db",
                "mysql://h/db",
                "postgresql",
            ]
        ),
    )
)
def test_cli_store_urls_are_refused_with_one_line_and_create_nothing(
    tmp_path_factory: pytest.TempPathFactory, url: str
) -> None:
    cwd = tmp_path_factory.mktemp("fuzz-db")
    r = run_cli(cwd, "--db", url, "tasks", debug=False)  # an unusable file is an operational error (exit 1)
    refused(r, (1, 2))
    assert list(cwd.iterdir()) == [], f"a refused command created files\n{r}"


@settings(FUZZ, max_examples=30)
@given(
    correlation_id=sql_text.filter(good_key),
    idempotency_key=sql_text.filter(good_key),
    value=sql_text,
    step=sql_text,
)
def test_sql_metacharacters_are_stored_and_echoed_literally(
    cli_db: tuple[Db, dict[str, int]], correlation_id: str, idempotency_key: str, value: str, step: str
) -> None:
    """REL4: text full of SQL is data -- stored and shown as sent, matching nothing else."""
    db, ids = cli_db
    store = open_store(db.url)
    try:
        before = table_counts(store)
        existing = task_with_key(store, idempotency_key)
        data = order(value, sku=value)
        r = run_cli(
            db.cwd,
            "--db",
            db.url,
            "submit",
            "--input",
            json.dumps(data),
            "--correlation-id",
            correlation_id,
            "--idempotency-key",
            idempotency_key,
            "--",
            WORKFLOW,
        )
        assert r.returncode == 0, str(r)
        task_id = int(r.stdout)
        after = table_counts(store)
        assert set(after) == set(before), "a table appeared or disappeared"
        if existing is not None:
            assert task_id == existing and after == before
            return
        assert after["tasks"] == before["tasks"] + 1 and after["steps"] == before["steps"] + 3
        shown = json.loads(run_cli(db.cwd, "--db", db.url, "task", "show", "--json", str(task_id)).stdout)
        assert (shown["correlation_id"], shown["idempotency_key"], shown["input"]) == (
            correlation_id,
            idempotency_key,
            data,
        )
        listed = json.loads(run_cli(db.cwd, "--db", db.url, "tasks", "--json").stdout)
        assert [x["correlation_id"] for x in listed if x["id"] == task_id] == [correlation_id]
        assert table_counts(store) == after
        # a step name full of SQL is refused by name, matching no step, and changes nothing
        before_retry = store_snapshot(store)
        line = refused(run_cli(db.cwd, "--db", db.url, "task", "retry", "--step", step, str(ids["error"])))
        assert "has no step" not in line or repr(step) in line, line
        assert store_snapshot(store) == before_retry, "a refused retry wrote to the store"
    finally:
        store.close()


@settings(FUZZ, max_examples=5)
@given(digits=st.integers(4301, 20_000), wrap=st.sampled_from(["{}", "[{}]", '{{"n": {}}}']))
def test_cli_submit_of_an_overlong_json_number_is_bad_input(
    cli_db: tuple[Db, dict[str, int]], digits: int, wrap: str
) -> None:
    """Found by this fuzz: json.loads raises a plain ValueError for an integer of more than 4300
    digits, which parse_input let through, so `submit --input 999...` exited 1 with
    ``error: ValueError: ...`` instead of 2."""
    db, _ = cli_db
    with unchanged(db):
        r = run_cli(
            db.cwd, "--db", db.url, "submit", "--input", wrap.format("9" * digits), WORKFLOW, debug=False
        )
        refused(r)


@settings(FUZZ, max_examples=12)
@given(
    where=st.sampled_from(["--db", "--app", "--roles", "--db (long)"]),
    text=st.tuples(cli_text, st.sampled_from(LINE_BREAKS), cli_text).map("".join),
)
def test_cli_errors_echo_user_text_on_one_line(
    cli_db: tuple[Db, dict[str, int]], tmp_path_factory: pytest.TempPathFactory, where: str, text: str
) -> None:
    """Found by this fuzz: three errors put the user's text in raw (cli._open's 'no stepwarden store
    at PATH', twice and untruncated; cli._load_app's 'REF is not a stepwarden App'; WorkerSettings'
    'unknown role(s) ROLES'), so a newline in --db, --app or --roles split the error line in two."""
    db, _ = cli_db
    if where.startswith("--db"):
        cwd = tmp_path_factory.mktemp("fuzz-db-line")
        path = "k" * 300 if where == "--db (long)" else "x" + text
        r = run_cli(cwd, "--db", "sqlite:///" + path, "tasks", debug=False)
        refused(r, (1, 2))
        return
    with unchanged(db):
        if where == "--app":
            r = run_cli(db.cwd, "--db", db.url, "worker", "--app", "os:x" + text)
        else:
            r = run_cli(db.cwd, "--db", db.url, "worker", "--roles", "x" + text, "--app", "os:path")
        refused(r)


@settings(FUZZ, max_examples=5)
@given(length=st.integers(150, 250))
def test_cli_error_for_a_long_app_module_name_is_short(
    cli_db: tuple[Db, dict[str, int]], length: int
) -> None:
    """Found by this fuzz: 'cannot import NAME for --app: ModuleNotFoundError: No module named NAME'
    echoed a long module name twice, untruncated (a line of ~600 characters)."""
    db, _ = cli_db
    with unchanged(db):
        refused(run_cli(db.cwd, "--db", db.url, "worker", "--app", "sw_fuzz_" + "m" * length + ":app"))


@pytest.mark.parametrize(
    "args",
    [
        ("submit", WORKFLOW, "--input", "{not json"),
        ("submit", WORKFLOW, "--input", "{}", "--priority", "2147483648"),
        ("task", "show", "999999"),
        ("worker", "--app", "os:path"),
    ],
    ids=lambda a: "-".join(x[:10] for x in a[:3]),
)
def test_in_process_cli_matches_the_console_script(
    cli_db: tuple[Db, dict[str, int]], args: tuple[str, ...]
) -> None:
    """The in-process runner above gives the exit code and error line of the real ``stepwarden``."""
    db, _ = cli_db
    with unchanged(db):
        real = sw("--db", db.url, *args, cwd=db.cwd)
        mine = run_cli(db.cwd, "--db", db.url, *args)
    assert (mine.returncode, mine.stdout, mine.stderr_lines) == (
        real.returncode,
        real.stdout,
        real.stderr_lines,
    )
