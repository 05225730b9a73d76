"""The store's shapes: the transaction interface transitions run on, and the row views.

Transitions (``transitions.py``) are written once against :class:`Tx`, a tiny interface over a
connection inside ONE transaction that runs named queries; each dialect supplies the SQL text and
the transaction discipline (``BEGIN IMMEDIATE`` on SQLite).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from ..policies import Retry

F = TypeVar("F", bound=Callable[..., Any])


def read_only(fn: F) -> F:
    """Marks a transaction function that only reads. On SQLite it runs in a deferred transaction,
    which under WAL reads a snapshot without waiting for the write lock: an operator's command or
    a dashboard page is neither held up by a long write nor holds up the workers' writes. It must
    not write (a deferred transaction that tries may fail at once with SQLITE_BUSY)."""
    fn.stepwarden_read_only = True  # type: ignore[attr-defined]
    return fn


def hot(fn: F) -> F:
    """Marks a transaction function of the roles' hot path (a scheduler round, a reply batch, an
    agent's pull): short, bounded by a batch size, run many times a second under load. A SQLite
    store runs it on the event loop's own thread (``SQLiteStore.transact``): on the store's
    thread, every statement gave the interpreter lock back and waited to take it again from the
    loop, so the file's write lock was held longer than its statements took (W2 about +10 %, W1
    unchanged: docs/performance.md, round s39). Other stores ignore it."""
    fn.stepwarden_hot = True  # type: ignore[attr-defined]
    return fn


def shorten(text: str, limit: int = 120) -> str:
    """``text`` cut to ``limit`` characters for an error line (a path, a URL), marked with "..."."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def timed(fn: F, asked: float, clock: Any) -> F:
    """``fn``, setting ``tx.waited`` as it starts: the seconds since ``asked`` on ``clock``'s
    monotonic time. Its transaction has begun by then (its lock or connection held). Why: an agent
    counts a request's time from just before it asks for the transaction that takes it, and the
    time the store says is left is read inside that transaction; a wait before it began (another
    process holding SQLite's write lock, an exhausted pool) came off the call's time, so a call
    taken after a 15 s wait was cut short at once and counted as failed. The request's
    ``remaining`` now includes that wait (:class:`RequestMsg`)."""

    @functools.wraps(fn)  # its markers (hot, lane, read-only...) too: they live in its __dict__
    def run(tx: Tx, *args: Any, **kwargs: Any) -> Any:
        tx.waited = max(0.0, clock.monotonic() - asked)
        return fn(tx, *args, **kwargs)

    return run  # type: ignore[return-value]


def redact_url(url: str) -> str:
    """A store URL fit for an error line, a log or a terminal: a password in it is masked, in the
    user part (``user:secret@``) and as a libpq parameter (``?password=secret``)."""
    url = re.sub(r"://([^:@/]*):[^@/]*@", r"://\1:***@", url)
    return re.sub(r"((?:^|[?&\s])password=)[^&#\s]*", r"\1***", url, flags=re.IGNORECASE)


# The hot path's writes a transaction defers, by query, with the parameters that name the row
# each one changes (none: an insert). A deferred write waits until the next read, commit or other
# write, and goes out with the others of its query together: on PostgreSQL as ONE statement
# (``<query>__many`` in ``batches.sql``), so that a round of fifty tasks costs about as many
# statements as a round of one; on SQLite through one prepared statement stepped once per row
# (``executemany``: no call from Python per row; 11 % less CPU per reply batch of 8). Deferring
# reorders these writes only among themselves, and within one window between reads they touch
# disjoint rows (a task advances once per window), except an update of the same row twice: then
# that group goes in order (one by one on PostgreSQL; ``executemany`` keeps it on SQLite).
DEFERRED: dict[str, tuple[str, ...]] = {
    "start_attempt": ("task_id", "idx"),
    "complete_step": ("task_id", "idx"),
    "task_in_flight": ("task_id",),
    "finish_task": ("task_id",),
    "mark_reply": ("id",),
    "finish_request": ("task_id", "idx", "attempt"),
    "request_replied": ("request_id",),
    "insert_request": (),
    "insert_reply": (),
}

Row = dict[str, Any]

# The wake-up channels of a worker's roles (new tasks, requests, replies); PostgreSQL also has
# `stepwarden_done`, for the reply queues' readers, which no worker role needs.
WORK_CHANNELS = ("stepwarden_tasks", "stepwarden_requests", "stepwarden_replies")

TASK_STATES = ("pending", "processing", "processed", "error", "compensating", "compensated", "cancelled")
FINAL_TASK_STATES = frozenset({"processed", "error", "compensated", "cancelled"})
STEP_STATES = ("pending", "running", "completed", "failed", "compensating", "compensated", "skipped")


class AtCommit:
    """The rows of a statement run last in its transaction (:meth:`Tx.at_commit`), handed to the
    caller once the transaction has committed (PostgreSQL reads them once COMMIT has come back,
    in pipeline mode the only time they are there; SQLite just before its COMMIT)."""

    def __init__(self) -> None:
        self._rows: list[Row] | None = None

    def set(self, rows: list[Row]) -> None:
        self._rows = rows

    def __call__(self) -> list[Row]:
        if self._rows is None:
            raise RuntimeError("the rows of a read sent with the COMMIT, asked for before the commit")
        return self._rows


class Tx(Protocol):
    """Named queries inside one transaction."""

    dialect: str  # "sqlite" or "postgres": for the few transitions one dialect does in one statement
    dispatched: list[str]  # the agents this transaction sent requests to, in order
    # Seconds between the transaction being asked for (Store.transact) and its function starting:
    # the waits for a thread, a pooled connection or SQLite's write lock (see :func:`timed`).
    waited: float
    # Inside a caller's transaction (App.transaction): its statements run long before its commit,
    # so nothing may be decided then on what will still be true at commit.
    caller_managed: bool

    def quiet(self, channel: str) -> None:
        """Send no wake-up hint on ``channel`` for this transaction: its work is already taken."""
        ...

    def one(self, query: str, /, **params: Any) -> Row | None: ...

    def all(self, query: str, /, **params: Any) -> list[Row]: ...

    def both(
        self, first: tuple[str, dict[str, Any]], second: tuple[str, dict[str, Any]]
    ) -> tuple[list[Row], list[Row]]:
        """Two reads, the second executed after the first (it sees what the first locked), whose
        parameters do not depend on each other: on PostgreSQL they share one round trip."""
        ...

    def run(self, query: str, /, **params: Any) -> int:
        """Execute and return the number of rows changed."""
        ...

    def put(self, query: str, /, **params: Any) -> None:
        """Execute a write whose result nobody reads; on PostgreSQL it is pipelined (no round trip
        of its own), and an error surfaces at the next read or at commit, failing the transaction."""
        ...

    def sql(self, text: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> list[Row]:
        """Raw SQL in this dialect, for read-only views that filter dynamically."""
        ...

    def later(self, query: str, /, **params: Any) -> None:
        """A write nothing in this transaction reads back (events, status messages): kept until
        the transaction ends and then sent with the others of its query as one batch, in order."""
        ...

    def flush(self) -> None:
        """Send the writes kept by :meth:`later`, then the :meth:`at_commit` statements; the store
        calls it before every commit."""
        ...

    def at_commit(self, query: str, /, **params: Any) -> AtCommit:
        """A statement whose rows are needed only once the transaction has committed (requests
        taken for this worker's own slots): it runs after every other statement of the
        transaction, on PostgreSQL in the COMMIT's round trip instead of one of its own."""
        ...

    def notify_if_queued(self, agents: list[str]) -> None:
        """Send the new-requests hint only if requests for one of ``agents`` are still queued
        after the :meth:`at_commit` statements took theirs (PostgreSQL; SQLite sends no hints)."""
        ...


@dataclass(frozen=True)
class RequestMsg:
    """A request to an agent, as taken by an agent instance (one attempt of one step)."""

    id: int
    task_id: int
    step_idx: int
    attempt: int
    kind: str
    agent: str
    operation: str
    payload: dict[str, Any]
    policy: Retry  # the step's, read once per distinct stored text (policies.stored_policy)
    idempotency_key: str
    complete_by: float
    # Seconds of complete-by left, counted from when the taking transaction was asked for: the
    # database's ``complete_by - now`` plus the wait before that transaction began (``Tx.waited``).
    remaining: float


@dataclass
class ApplyResult:
    accepted: int = 0
    stale: int = 0
    finished: list[tuple[int, str]] = field(default_factory=list)
    alerts: list[Row] = field(default_factory=list)
    requests: set[int] = field(default_factory=set)  # requests whose reply was accepted


@dataclass
class SweepResult:
    rescued: int = 0
    escalated: int = 0
    alerts: list[Row] = field(default_factory=list)
    # Candidates the batch read, those it skipped (held by another transaction) too: a batch that
    # read its limit may have left more behind, however few it rescued (SUP6).
    examined: int = 0
    # Tasks the sweep ended (an attempt past complete-by that used up the step's retries), with
    # their final state: as ApplyResult.finished, for the metrics and task spans of the process.
    finished: list[tuple[int, str]] = field(default_factory=list)

    def add(self, batch: SweepResult) -> None:
        """Count one batch's result in a sweep's."""
        self.rescued += batch.rescued
        self.escalated += batch.escalated
        self.examined += batch.examined
        self.alerts.extend(batch.alerts)
        self.finished.extend(batch.finished)
