"""The store in domain verbs, written once over a dialect's transactions.

A dialect subclass supplies ``transact_sync(fn, *args)``: run ``fn(tx, *args)`` in ONE transaction
on a connection of its own, committing on return and rolling back on an exception. Every verb
here is then available both blocking (``store.transact_sync``, for the CLI and plain code) and
async (``await store.transact``, for the roles) without writing any method twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from .. import liveness
from ..clock import SYSTEM_CLOCK, Clock
from ..errors import StoreError, UnknownWorkflow
from ..policies import stored_policy
from ..workflow import Workflow, encode_result
from . import transitions as t
from .base import ApplyResult, RequestMsg, Row, SweepResult, Tx, hot, timed

log = logging.getLogger("stepwarden.store")

P = ParamSpec("P")
R = TypeVar("R")


class Store:
    """Domain verbs over one database; see the module docstring for the sync/async split."""

    dialect = "abstract"
    url = ""
    threads = 1  # transactions in flight at once from one process (SQLite has one writer anyway)
    clock: Clock = SYSTEM_CLOCK  # the dialects set their own

    def __init__(self) -> None:
        self._executors: dict[str, ThreadPoolExecutor] = {}
        self.rng = random.Random()
        self.known_identity: str | None = None  # see identity(): read once, never changes

    # -- the dialect's part ---------------------------------------------------------------
    def transact_sync(self, fn: Callable[Concatenate[Tx, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        raise NotImplementedError

    def connect(self) -> Any:
        """A new connection of this dialect's driver, for a caller's own transaction (SUB2)."""
        raise NotImplementedError

    def in_transaction(self, conn: Any) -> bool:
        """Whether a caller's connection (SUB2) is inside a transaction now."""
        raise NotImplementedError

    def aborted(self, conn: Any) -> bool:
        """Whether a caller's transaction was aborted by a failed statement (COMMIT would roll it
        back): PostgreSQL's; SQLite has no such state."""
        return False

    def migrate(self, target: int | None = None) -> int:
        """Apply the schema's missing migrations (up to ``target``); returns the version reached."""
        raise NotImplementedError

    @contextmanager
    def lend(self) -> Iterator[Any]:
        """A connection for one caller's transaction (``app.transaction()``), given back after it.
        Here a new one, closed after; the dialects keep theirs, because opening a connection costs
        more than the transaction (see each dialect's ``lend``)."""
        conn = self.connect()
        try:
            yield conn
        finally:
            conn.close()

    def tx_on(self, conn: Any) -> Tx:
        """Our named queries on the caller's connection, inside the caller's transaction."""
        raise NotImplementedError

    def begin(self, conn: Any) -> None:
        raise NotImplementedError

    def commit(self, conn: Any, tx: Any) -> None:
        raise NotImplementedError

    def rollback(self, conn: Any) -> None:
        raise NotImplementedError

    def block_error(self, e: BaseException) -> StoreError | None:
        """What ended an ``app.transaction()`` block, said in the store's words, when the driver's
        own error would not tell the caller what happened (PostgreSQL ending a session left idle
        in its transaction); None to let ``e`` go on as it came."""
        return None

    def limit_lock_waits(self, seconds: float) -> None:
        """From now on, a transaction gives up waiting for a lock after ``seconds``, the waits in
        progress included (a stopping worker: another process holding SQLite's write lock must
        not keep it alive for a busy_timeout per transaction still queued). PostgreSQL's waits
        are bounded by its ``lock_timeout`` already."""

    def close(self) -> None:
        for executor in self._executors.values():
            executor.shutdown(wait=True)
        self._executors.clear()

    # -- async bridge ----------------------------------------------------------------------
    async def transact(self, fn: Callable[Concatenate[Tx, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run a transaction off the event loop, on this store's own thread (one connection).

        Lease transactions (functions marked ``stepwarden_lane = "lease"``) have a thread and a
        connection of their own: a renewal must never queue behind a burst of the roles' work,
        or a busy leader would lose its lease for no reason but its own backlog."""
        executor = self.lane(getattr(fn, "stepwarden_lane", "main"))
        loop = asyncio.get_running_loop()
        run = timed(fn, self.clock.monotonic(), self.clock)
        return await loop.run_in_executor(executor, lambda: self.transact_sync(run, *args, **kwargs))

    def lane(self, name: str) -> ThreadPoolExecutor:
        """The threads (and so the connections) that run one lane's transactions."""
        executor = self._executors.get(name)
        if executor is None:
            executor = self._executors[name] = ThreadPoolExecutor(
                max_workers=self.threads if name == "main" else 1,
                thread_name_prefix=f"stepwarden-{self.dialect}-{name}",
            )
        return executor

    async def listen(
        self, wake: Callable[[str], None], stop: asyncio.Event, channels: Sequence[str] | None = None
    ) -> None:
        """Wake-up hints from the database (PostgreSQL LISTEN on ``channels``, default all); stores
        without them just wait."""
        await stop.wait()

    # -- verbs -------------------------------------------------------------------------------
    async def register_workflows(self, workflows: Sequence[Workflow], by: str) -> None:
        self.known_identity = await self.transact(_register, list(workflows), by)

    async def identity(self) -> str:
        """This store's id: random, made with its schema (migration 8), the same for every
        process that uses it. Task ids start at 1 in every store; this id is what tells one
        store's task 1 from another's, in ``Request.global_idempotency_key`` and trace ids."""
        if self.known_identity is None:
            self.known_identity = await self.transact(read_identity)
        return self.known_identity

    def identity_sync(self) -> str:
        """:meth:`identity`, from plain code."""
        if self.known_identity is None:
            self.known_identity = self.transact_sync(read_identity)
        return self.known_identity

    def workflow_sync(self, name: str) -> Workflow:
        row = self.transact_sync(lambda tx: tx.one("get_workflow", name=name))
        if row is None:
            raise UnknownWorkflow(f"unknown workflow {name!r}: no worker has registered it in this store")
        return Workflow.from_dict(json.loads(row["definition"]))

    async def claim_and_dispatch(self, me: str, limit: int) -> int:
        return await self.transact(t.claim_and_dispatch, me, limit)

    async def apply_replies(self, me: str, limit: int) -> ApplyResult:
        return await self.transact(t.apply_replies, me, limit, self.rng)

    async def sweep_expired(self, me: str, lease: str, term: int, limit: int) -> SweepResult:
        return await self.transact(t.sweep_expired, me, lease, term, limit, self.rng)

    async def claim_requests(self, me: str, agents: Sequence[str], limit: int) -> list[RequestMsg]:
        return await self.transact(_claim_requests, me, list(agents), limit)

    async def send_reply(
        self, me: str, request_id: int, outcome: str, result: Any, error: str | None
    ) -> None:
        await self.transact(_send_reply, me, request_id, outcome, result, error)

    async def send_replies(
        self, me: str, replies: Sequence[tuple[int, str, Any, str | None]], apply: bool = False
    ) -> ApplyResult | None:
        """Several replies ``(request_id, outcome, result, error)`` in one transaction. With
        ``apply`` (a worker that is also a scheduler), the scheduler's rules are applied to them in
        the same transaction: the step completes and the next one is dispatched without another
        commit or another process having to notice the reply."""

        return await self.transact(_record_replies, me, replies, apply, self.rng)

    async def requests_taken_by(self, me: str) -> list[int]:
        """The requests ``me`` holds (taken, not answered) whose complete-by has not passed."""
        return await self.transact(_taken_by, me)

    async def schedule(self, me: str, limit: int) -> tuple[ApplyResult, int]:
        return await self.transact(t.schedule, me, limit, self.rng)

    async def send_replies_and_take(
        self,
        me: str,
        replies: Sequence[tuple[int, str, Any, str | None]],
        take: Mapping[str, Want],
        apply: bool = True,
    ) -> tuple[ApplyResult | None, list[RequestMsg]]:
        """:meth:`send_replies`, then, in the same transaction, take up to ``take[agent].room``
        queued requests for this worker's own agents, for its operations: the slots these
        replies free are refilled (often with the very steps the replies just dispatched)
        without a transaction of their own."""

        @hot
        def send_all(tx: Tx) -> tuple[ApplyResult | None, Callable[[], list[RequestMsg]]]:
            return _record_replies(tx, me, replies, apply, self.rng), _take(tx, me, take)

        applied, taken = await self.transact(send_all)
        return applied, taken()

    async def schedule_and_take(
        self, me: str, limit: int, take: Mapping[str, Want]
    ) -> tuple[ApplyResult, int, list[RequestMsg]]:
        """A scheduler round whose worker also runs agents: the requests it dispatches are taken
        for those agents (up to ``take[agent].room``, for their operations) in the same
        transaction, no second round trip."""

        @hot
        def round_(tx: Tx) -> tuple[ApplyResult, int, Callable[[], list[RequestMsg]]]:
            applied, claimed = t.schedule(tx, me, limit, self.rng)
            return applied, claimed, _take(tx, me, take)

        applied, claimed, taken = await self.transact(round_)
        return applied, claimed, taken()

    async def acquire_lease(self, name: str, holder: str, ttl: float) -> tuple[int, float] | None:
        return await self.transact(_acquire, name, holder, ttl)

    async def renew_lease(self, name: str, holder: str, term: int, ttl: float) -> bool:
        return await self.transact(_renew, name, holder, term, ttl)

    async def resign_lease(self, name: str, holder: str, term: int) -> None:
        await self.transact(_resign, name, holder, term)

    async def worker_beat(
        self,
        worker_id: str,
        roles: Sequence[str],
        agents: Sequence[str],
        stopped: bool = False,
        breakers: dict[str, str] | None = None,
        load: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """Record that a worker is alive, with its agents' breaker states, for operators, and its
        agent instances' ``{agent: (capacity, in flight)}`` (AGT6) in the same transaction."""
        from . import agents as agent_rows  # it builds on this module

        def beat(tx: Tx) -> None:
            if stopped:
                tx.run("worker_stop", id=worker_id)
                return
            text = json.dumps(breakers or {})
            if tx.run("worker_beat", id=worker_id, breakers=text) == 0:
                tx.run(
                    "worker_upsert",
                    id=worker_id,
                    roles=",".join(roles),
                    agents=",".join(agents),
                    **liveness.me(),
                )
                tx.run("worker_beat", id=worker_id, breakers=text)
            if load:
                agent_rows.beat(tx, worker_id, dict(load))

        # On the lease lane: a heartbeat queued behind a burst of work would make a busy worker
        # look dead to the supervisor (see liveness).
        beat.stepwarden_lane = "lease"  # type: ignore[attr-defined]
        await self.transact(beat)


def _register(tx: Tx, workflows: list[Workflow], by: str) -> str:
    """Record the workflows; returns the store's identity, which a worker needs next.

    The store keeps one definition per workflow, the highest version registered (a rolling
    deploy's old workers starting again do not undo the new definition), and ``submit`` without
    ``--app`` builds tasks from it. Two cases are said in a warning, which otherwise went
    unnoticed: this app's version is lower (a rollback that kept the old number: tasks
    submitted that way get steps this app's workers may not run), and the same version with
    other steps (a change made without a new number: the last worker to start wins)."""
    for wf in workflows:
        definition = json.dumps(wf.to_dict())
        stored = tx.one("get_workflow", name=wf.name)
        if stored is not None and int(stored["version"]) > wf.version:
            log.warning(
                "workflow %r: this app's version %d is older than version %d in the store (registered"
                " by %s), which `submit` without --app keeps using; to roll back a definition, give"
                " it a higher version",
                wf.name,
                wf.version,
                int(stored["version"]),
                stored["registered_by"],
            )
        elif (
            stored is not None
            and int(stored["version"]) == wf.version
            and json.loads(stored["definition"]) != wf.to_dict()
        ):
            log.warning(
                "workflow %r version %d differs from the definition in the store (registered by"
                " %s) and replaces it; give a changed definition a new version, or workers of"
                " each kind will replace each other's as they start",
                wf.name,
                wf.version,
                stored["registered_by"],
            )
        tx.run("upsert_workflow", name=wf.name, version=wf.version, definition=definition, by=by)
    return read_identity(tx)


def read_identity(tx: Tx) -> str:
    rows = tx.sql("SELECT id FROM store_identity")
    if not rows:  # its one row deleted by hand: nothing would tell this store's tasks from another's
        raise StoreError(
            "this store has no identity (its store_identity row was deleted): give it one as"
            " docs/guarantees.md says for a copied store, with INSERT instead of UPDATE"
        )
    return str(rows[0]["id"])


def _claim_requests(tx: Tx, me: str, agents: list[str], limit: int) -> list[RequestMsg]:
    """Any queued request of ``agents``, whatever its operation: for a tool or a test acting as
    an agent that knows no operations (the agent role takes only its own: ``claim_agent_requests``
    with its operations, see :class:`Want`)."""
    rows: list[Row] = []
    for agent in agents:  # one indexed range per agent, already in claim order
        if len(rows) < limit:
            queued = tx.sql(
                "SELECT DISTINCT operation FROM requests WHERE state = 'queued' AND agent = ?", (agent,)
            )
            ops = ops_json(r["operation"] for r in queued)
            rows += tx.all("claim_agent_requests", me=me, agent=agent, ops=ops, limit=limit - len(rows))
    return _requests(rows, tx.waited)


def _requests(rows: list[Row], waited: float) -> list[RequestMsg]:
    """The requests of ``rows``; ``waited``: the taking transaction's wait before it began, added
    to each one's time left (see :attr:`RequestMsg.remaining`)."""
    return [
        RequestMsg(
            id=r["id"],
            task_id=r["task_id"],
            step_idx=r["step_idx"],
            attempt=r["attempt"],
            kind=r["kind"],
            agent=r["agent"],
            operation=r["operation"],
            payload=json.loads(r["payload"]),
            policy=stored_policy(r["policy"]),
            idempotency_key=r["idempotency_key"],
            complete_by=r["complete_by"],
            remaining=float(r["remaining"]) + waited,
        )
        for r in sorted(rows, key=lambda r: r["id"])
    ]


@dataclass(frozen=True)
class Want:
    """What a worker takes for one of its agents, in a pull or a reservation's take: up to
    ``room`` requests, only for the operations it has (``ops``, a JSON array: see
    :func:`ops_json`); a request for another one is left queued for an instance that has it (a
    worker of another version, in a rolling deploy). ``may_trial`` (pulls only): this instance
    may run the half-open trial if the breaker's cool-off is over; ``trial_if_alone`` (an
    unhealthy instance's probe): only if no other live, healthy instance of the agent could, or
    if the trial has been due for ``trial_unclaimed`` seconds and none took it (a live, healthy
    instance may be unable to: its slots held by calls that never end, or its version lacking
    the operation of every queued request)."""

    room: int
    ops: str
    may_trial: bool = False
    trial_if_alone: bool = False
    trial_unclaimed: float = 0.0


def ops_json(operations: Iterable[str]) -> str:
    """An agent's operations as :attr:`Want.ops`: built once per agent, not for every take."""
    return json.dumps(sorted(operations))


def _take(tx: Tx, me: str, take: Mapping[str, Want]) -> Callable[[], list[RequestMsg]]:
    """Take up to ``take[agent].room`` queued requests (of its operations) for this worker's own
    slots, after everything else the transaction does (the requests it dispatches included);
    the rows come with the commit. Other workers get the new-requests hint only if some are
    left for them."""
    reads = [
        tx.at_commit("claim_agent_requests", me=me, agent=agent, ops=want.ops, limit=want.room)
        for agent, want in take.items()
        if want.room > 0
    ]
    if reads and tx.dispatched:
        tx.notify_if_queued(sorted(set(tx.dispatched)))
    return lambda: _requests([row for read in reads for row in read()], tx.waited)


def _send_reply(tx: Tx, me: str, request_id: int, outcome: str, result: Any, error: str | None) -> None:
    """Record a reply, new: a scheduler applies it.

    The request is marked replied first, and only then is the reply stamped with its arrival
    (``received_at``, which decides whether it came by complete-by). Marking it locks the
    request row, which the supervisor's sweep checks before it expires an attempt: stamped
    first, a sweep that ran between the two statements found the request free, expired the
    attempt, and the reply, stamped in time, was then recorded stale with a failure counted.
    In this order a sweep either finds the request held and passes it by, or comes first, and
    the reply is stamped after it: late by its own stamp. (The deferred writes go out in the
    order of their first ``put``.)"""
    tx.put("request_replied", request_id=request_id)
    tx.put(
        "insert_reply",
        request_id=request_id,
        outcome=outcome,
        result=encode_result(result),
        error=error,
        me=me,
    )


def _taken_by(tx: Tx, me: str) -> list[int]:
    return [int(r["id"]) for r in tx.all("requests_taken_by", me=me)]


@hot
def _record_replies(
    tx: Tx, me: str, replies: Sequence[tuple[int, str, Any, str | None]], apply: bool, rng: random.Random
) -> ApplyResult | None:
    """Record replies; with ``apply``, apply them, with up to as many others waiting in the table,
    in the same transaction (they are written once, settled: see ``apply_replies``). An accepted
    reply's request is marked replied by ``finish_request``, in the write that records its
    outcome; the others' (stale, or for a request or task that is gone) here."""
    if not apply:
        for request_id, outcome, result, error in replies:
            _send_reply(tx, me, request_id, outcome, result, error)
        return None
    applied = t.apply_replies(tx, me, len(replies), rng, replies)
    for request_id, *_ in replies:
        if request_id not in applied.requests:
            tx.put("request_replied", request_id=request_id)
    return applied


def _acquire(tx: Tx, name: str, holder: str, ttl: float) -> tuple[int, float] | None:
    row = tx.one("lease_acquire", name=name, holder=holder, ttl=ttl)
    if row is None:
        return None
    term = int(row["term"])
    tx.run("term_end", name=name, term=term - 1)
    tx.run("term_begin", name=name, term=term, holder=holder)
    t.event(tx, "lease_acquired", None, holder, lease=name, term=term)
    return term, float(row["expires_at"])


def _renew(tx: Tx, name: str, holder: str, term: int, ttl: float) -> bool:
    return tx.one("lease_renew", name=name, holder=holder, term=term, ttl=ttl) is not None


def _resign(tx: Tx, name: str, holder: str, term: int) -> None:
    if tx.run("lease_resign", name=name, holder=holder, term=term):
        tx.run("term_end", name=name, term=term)
        t.event(tx, "lease_resigned", None, holder, lease=name, term=term)


for _fn in (_acquire, _renew, _resign):
    setattr(_fn, "stepwarden_lane", "lease")  # noqa: B010 - a marker read by Store.transact
