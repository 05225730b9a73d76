"""PostgreSQL behind a real PgBouncer in transaction pool mode (issue #3).

Each test starts its own ``pgbouncer`` (the distribution's binary) on 127.0.0.1 in front of the
suite's PostgreSQL server, with a tiny server pool so that clients really do share server
sessions, and ends it by pid when the test ends. Without pgbouncer installed the tests skip, which
fails the run in CI (STEPWARDEN_NO_SKIPS=1; .ci/run installs pgbouncer).

What a transaction-mode pooler breaks, and what ``?pooler=transaction`` does about it:

- LISTEN: a notification goes to whichever server session the pooler picked; workers poll.
- server-side prepared statements (psycopg's ``prepare=True``): psycopg names them per client
  connection (``_pg3_0``, ...), so two clients sharing a server session collide; PgBouncer older
  than 1.21 does not track them at all. The store then prepares nothing.
- session settings (``SET lock_timeout``...): they would stay on whichever server session ran
  them and never reach the others; the store sets its limits per transaction instead.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from harness import Cluster, wait_until

from stepwarden.errors import StoreMisconfigured
from stepwarden.store import open_store
from stepwarden.store.postgres import PostgresStore
from stepwarden.testing.pgbouncer import LocalPgBouncer, find_pgbouncer

pytestmark = pytest.mark.timeout(240)

SERVER_POOL = 2  # server sessions per database behind the bouncer, shared by every client


def _db_name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


@pytest.fixture
def start_bouncer(tmp_path: Path, pg_admin_url: str) -> Iterator[Callable[..., LocalPgBouncer]]:
    """Start a PgBouncer in front of the test server (transaction mode unless told); every one
    started is ended by pid when the test ends."""
    if find_pgbouncer() is None:
        pytest.skip("pgbouncer is not installed (Debian: apt-get install pgbouncer; .ci/run installs it)")
    started: list[LocalPgBouncer] = []

    def start(pool_size: int = SERVER_POOL, **settings: Any) -> LocalPgBouncer:
        b = LocalPgBouncer(
            tmp_path / f"pgbouncer-{len(started)}", pg_admin_url, pool_size=pool_size, settings=settings
        )
        started.append(b)
        return b.start()

    try:
        yield start
    finally:
        for b in started:
            b.stop()


@pytest.fixture
def cluster(tmp_path: Path, pg_url: str, start_bouncer: Callable[..., LocalPgBouncer]) -> Iterator[Cluster]:
    """Worker processes, the test's submissions and its reads, all through one PgBouncer in
    transaction mode (named ``cluster`` so that a failure's report carries the workers' logs)."""
    bouncer = start_bouncer()
    c = Cluster(tmp_path, bouncer.url(_db_name(pg_url), "pooler=transaction"))
    c.bouncer = bouncer  # type: ignore[attr-defined]
    c.direct_url = pg_url  # type: ignore[attr-defined]
    workers_and_store = c.report

    def report() -> str:  # a failure's report: the bouncer's log too
        tail = bouncer.log_text().splitlines()[-60:]
        return "\n".join([workers_and_store(), "===== pgbouncer log, last 60 lines =====", *tail])

    c.report = report  # type: ignore[method-assign]
    try:
        yield c
    finally:
        c.close()


DIRECT_APP = "stepwarden-test-direct"  # the test's own sessions, not the bouncer's


def _direct(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """``sql`` on a session of the server's own, past the bouncer. Named, so that counts of the
    bouncer's sessions can leave it out: a closed session's backend is still listed in
    pg_stat_activity for a moment while it exits (one CI run counted the previous poll's)."""
    with psycopg.connect(url, autocommit=True, application_name=DIRECT_APP) as conn:
        return list(conn.execute(sql, params or None).fetchall())


def test_workers_through_pgbouncer_transaction_mode_process_every_task(cluster: Cluster) -> None:
    bouncer: LocalPgBouncer = cluster.bouncer  # type: ignore[attr-defined]
    direct: str = cluster.direct_url  # type: ignore[attr-defined]
    db = _db_name(direct)
    assert bouncer.settings["pool_mode"] == "transaction"
    workers = [cluster.start("pb1"), cluster.start("pb2")]
    ids = [cluster.submit("one", {"n": i}) for i in range(20)]
    with cluster.app.transaction() as tx:  # a caller's transaction, through the bouncer as well
        ids += [tx.submit("one", {"n": 100 + i}) for i in range(40)]
    ids.append(cluster.cli("submit", "one", "--input", '{"n": 999}'))

    # Every client (two workers, each with its pool, the test's store and app, the CLI) shares at
    # most SERVER_POOL server sessions; sample while the work runs.
    most_servers = 0
    most_clients = 0

    def all_processed() -> bool:
        nonlocal most_servers, most_clients
        pools = [p for p in bouncer.admin("SHOW POOLS") if p["database"] == db]
        assert len(pools) == 1, pools
        servers = sum(pools[0][k] for k in ("sv_active", "sv_idle", "sv_used", "sv_tested", "sv_login"))
        most_servers = max(most_servers, servers)
        most_clients = max(most_clients, pools[0]["cl_active"] + pools[0]["cl_waiting"])
        rows = _direct(direct, "SELECT state, COUNT(*) FROM tasks GROUP BY state")
        return dict(rows) == {"processed": len(ids)}

    cluster.wait(all_processed, 90, f"{len(ids)} tasks to be processed through PgBouncer")
    backends = _direct(
        direct,
        "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = %s AND application_name <> %s",
        db,
        DIRECT_APP,
    )[0][0]
    assert backends <= SERVER_POOL, "the server saw no more sessions than the bouncer's pool"
    assert most_servers <= SERVER_POOL
    assert most_clients > SERVER_POOL, f"clients really shared the pool ({most_clients} for {SERVER_POOL})"
    assert _direct(direct, "SELECT COUNT(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN%'") == [(0,)]

    # The store's own records, read through the bouncer: one claim and one attempt per task.
    claims = Counter(r["task_id"] for r in cluster.sql("SELECT task_id FROM events WHERE kind = 'claimed'"))
    assert claims == Counter({t: 1 for t in ids})
    runs = Counter(e["task_id"] for e in cluster.executions("kind = 'do'"))
    assert runs == Counter({t: 1 for t in ids}), "each task's operation ran exactly once"
    reqs = cluster.sql("SELECT taken_by, outcome FROM requests")
    assert len(reqs) == len(ids) and {r["outcome"] for r in reqs} == {"ok"}
    assert {r["taken_by"] for r in reqs} <= {w.identity for w in workers}

    # The CLI through the bouncer.
    listed = cluster.cli("tasks", "--json")
    assert sorted(t["id"] for t in listed) == sorted(ids)
    assert {t["state"] for t in listed} == {"processed"}
    shown = cluster.cli("task", "show", str(ids[-1]), "--json")
    assert shown["id"] == ids[-1] and shown["state"] == "processed"
    for w in workers:  # nothing failed and was retried quietly either
        log = w.log_text()
        assert not any(word in log for word in (" WARNING ", " ERROR ", "Traceback")), log


def test_pooled_store_leaves_nothing_in_the_server_session(
    pg_url: str, start_bouncer: Callable[..., LocalPgBouncer]
) -> None:
    """With ONE server session behind the bouncer, whatever our store left in a session would be
    seen by the next client: its limits hold inside our transactions and nowhere else, it
    prepared no statement, and a failed transaction does not keep the session."""
    bouncer = start_bouncer(pool_size=1)
    url = bouncer.url(_db_name(pg_url))
    store = open_store(url + "?pooler=transaction")
    try:
        assert isinstance(store, PostgresStore)
        assert (store.listen_enabled, store.prepare) == (False, False)

        def inside(tx: Any) -> dict[str, Any]:
            tx.one("task_by_key", key="k")  # a query of the store's own, as the hot path runs them
            row: dict[str, Any] = tx.sql(
                "SELECT pg_backend_pid() AS pid, current_setting('lock_timeout') AS lock,"
                " current_setting('idle_in_transaction_session_timeout') AS idle,"
                " (SELECT COUNT(*) FROM pg_prepared_statements) AS prepared"
            )[0]
            return row

        # A statement that fails inside a transaction: rolled back, and the one
        # server session goes back to the pool rather than staying "idle in transaction (aborted)".
        with pytest.raises(psycopg.errors.DivisionByZero):
            store.transact_sync(lambda tx: tx.sql("SELECT 1 / 0"))
        for _ in range(6):  # more than psycopg's threshold (5 runs) for preparing on its own
            seen = store.transact_sync(inside)
        assert (seen["lock"], seen["idle"], seen["prepared"]) == ("10s", "5s", 0)
        # The store has returned every connection: the bouncer must hold its one server session
        # for no client now. Read from the bouncer's own console (a failure says who holds it)
        # before a second client asks for the session.
        db = _db_name(pg_url)

        def held() -> list[dict[str, Any]]:
            servers = [s for s in bouncer.admin("SHOW SERVERS") if s["database"] == db]
            return [s for s in servers if s["state"] not in ("idle", "used")]

        try:
            wait_until(lambda: not held(), 20, "the one server session to be free")
        except pytest.fail.Exception:
            clients = [c for c in bouncer.admin("SHOW CLIENTS") if c["database"] == db]
            pytest.fail(
                f"a server session is still held after the store's transactions ended:\n"
                f"servers={held()}\nclients={clients}\n"
                f"pool={[c.info.backend_pid for c in store.pool._pool]}\n"
                + "\n".join(bouncer.log_text().splitlines()[-40:])
            )
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as other:
            after = other.execute(
                "SELECT pg_backend_pid(), current_setting('lock_timeout'),"
                " current_setting('idle_in_transaction_session_timeout'),"
                " (SELECT COUNT(*) FROM pg_prepared_statements)"
            ).fetchone()
        assert after == (seen["pid"], "0", "0", 0), "the same server session, left as it was found"
    finally:
        store.close()


def test_an_idle_pooled_store_holds_no_server_session(
    pg_url: str, start_bouncer: Callable[..., LocalPgBouncer]
) -> None:
    """After each of many transactions, failed or committed, the bouncer's one server session is
    free again: a store idle between transactions must not keep it from every other client.
    (In pipeline mode psycopg ends each transaction with a Sync and then, often in a packet of
    its own, a Flush; a Flush arriving after the bouncer released the session took it again and
    held it, since a Flush has no reply: about one round in a few hundred here.)"""
    bouncer = start_bouncer(pool_size=1)
    db = _db_name(pg_url)
    store = open_store(bouncer.url(db) + "?pooler=transaction")

    def free() -> bool:
        servers = [s for s in bouncer.admin("SHOW SERVERS") if s["database"] == db]
        return bool(servers) and all(s["state"] in ("idle", "used") for s in servers)

    # The race is lost by a few rounds in a thousand: run many cheap rounds, bounded in time.
    deadline = time.monotonic() + 10
    rounds = 0
    try:
        while rounds < 3000 and time.monotonic() < deadline:
            if rounds % 3 == 0:
                with pytest.raises(psycopg.errors.DivisionByZero):
                    store.transact_sync(lambda tx: tx.sql("SELECT 1 / 0"))
            else:
                assert store.transact_sync(lambda tx: tx.one("task_by_key", key="k")) is None
            wait_until(free, 5, f"the server session to be free after transaction {rounds}")
            rounds += 1
    finally:
        store.close()
    assert rounds >= 500, f"only {rounds} rounds in the time allowed: too few to show anything"


def test_server_side_prepared_statements_collide_behind_pgbouncer_without_tracking(
    pg_url: str, start_bouncer: Callable[..., LocalPgBouncer]
) -> None:
    """Why ``pooler=transaction`` turns prepared statements off: two stores that prepare (the
    default, fine on a direct connection) sharing one server session through PgBouncer in
    transaction mode without prepared-statement tracking (as on PgBouncer < 1.21, or
    ``max_prepared_statements = 0``)."""
    bouncer = start_bouncer(pool_size=1)
    if bouncer.version >= (1, 21, 0):  # tracking exists there: turn it off to show the failure
        bouncer.stop()
        bouncer = start_bouncer(pool_size=1, max_prepared_statements=0)
    url = bouncer.url(_db_name(pg_url), "listen=off")
    # The first client prepares its first statement (psycopg names it _pg3_0) on the one server
    # session, outside a pipeline: a pipelined client can keep that session linked to itself while
    # idle (PgBouncer and the pipeline's lone Flush), and the store would then wait for it instead.
    with psycopg.connect(bouncer.url(_db_name(pg_url)), autocommit=True, prepare_threshold=0) as a:
        a.execute("SELECT 1 WHERE %s::text IS NOT NULL", ("k",), prepare=True)
        b = open_store(url, migrate=False)
        try:
            # Said as what it is, with what to change, the driver's error kept as the cause ...
            said = r"transaction-mode pooler.*\?pooler=transaction"
            with pytest.raises(StoreMisconfigured, match=said) as met:
                b.transact_sync(lambda tx: tx.one("task_by_key", key="k"))
            assert isinstance(met.value.__cause__, psycopg.errors.DuplicatePreparedStatement)
            assert '"_pg3_0" already exists' in str(met.value)
            # ... and every transaction after it is refused at once, without a round trip: some
            # would go through and some not, for as long as the process runs.
            a.close()  # the server session is free now, and its statement with it
            with pytest.raises(StoreMisconfigured) as again:
                b.transact_sync(lambda tx: tx.one("task_by_key", key="k"))
            assert again.value.__cause__ is None
        finally:
            b.close()


def test_a_worker_behind_a_transaction_pooler_without_the_option_exits_with_one_line(
    tmp_path: Path, pg_url: str, start_bouncer: Callable[..., LocalPgBouncer]
) -> None:
    """A worker whose URL reaches the server through PgBouncer in transaction mode but lacks
    ``?pooler=transaction`` exits 1 with one line that names the option, instead of taking the
    collisions of its prepared statements for an outage that begins and ends every few rounds and
    warning about it for as long as it runs (found by review)."""
    bouncer = start_bouncer(pool_size=1)
    if bouncer.version >= (1, 21, 0):  # tracking exists there: turn it off, as on 1.18
        bouncer.stop()
        bouncer = start_bouncer(pool_size=1, max_prepared_statements=0)
    c = Cluster(tmp_path, bouncer.url(_db_name(pg_url), "pooler=transaction"))  # migrates
    try:
        w = c.start("nopool", db=bouncer.url(_db_name(pg_url)), wait=False)
        for i in range(5):  # work for its roles, so that they use the store
            c.submit("one", {"n": i})
        code = wait_until(lambda: w.popen.poll(), 60, "the worker to exit")
        w.expect_alive = False
        log = w.log_text()
        assert code == 1, log
        errors = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "?pooler=transaction" in errors[0], log
        assert "Traceback" not in log, log
        # Not waited out as an outage first: no "trying again" warning loop before the exit.
        assert log.count("trying again") <= 1, log
    finally:
        c.close()


def test_prepare_off_on_a_direct_connection_prepares_nothing(pg_url: str) -> None:
    """``?prepare=off`` alone, without a pooler: the store's session holds no prepared statement;
    by default (the fast path for direct connections) its queries are prepared on first use."""

    def prepared(tx: Any) -> int:
        tx.one("task_by_key", key="k")
        return int(tx.sql("SELECT COUNT(*) AS n FROM pg_prepared_statements")[0]["n"])

    for query, expect_prepared in (("prepare=off&pool_size=1", False), ("pool_size=1", True)):
        store = open_store(f"{pg_url}?{query}")
        try:
            counts = [store.transact_sync(prepared) for _ in range(6)]
        finally:
            store.close()
        assert (counts[-1] > 0) is expect_prepared, (query, counts)


def test_cli_reaches_the_store_through_pgbouncer(
    tmp_path: Path, pg_url: str, start_bouncer: Callable[..., LocalPgBouncer]
) -> None:
    """``stepwarden init`` and the read commands through the bouncer, the URL's options included."""
    bouncer = start_bouncer()
    url = bouncer.url(_db_name(pg_url), "pooler=transaction")

    def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "stepwarden", "--db", url, *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )

    init = cli(url, "init")
    assert init.returncode == 0, init.stderr
    listed = cli(url, "tasks", "--json")
    assert listed.returncode == 0 and listed.stdout.strip() == "[]", listed.stderr
    bad = cli(url.replace("pooler=transaction", "pooler=statement"), "tasks")
    assert bad.returncode == 2 and "pooler=statement" in bad.stderr, bad.stderr
