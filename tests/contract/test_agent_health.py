"""Shared circuit breakers and instance health in the store (AGT3, AGT6), on every store.

The store's clock is the test's FakeClock, so cool-offs and trial leases are crossed with
``clock.advance`` and never slept through. Each transition is a conditional statement; the tests
check that exactly one reporter makes it (one ``breaker_opened`` alert, one trial holder), also
with reporters racing on threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from stepwarden.clock import FakeClock
from stepwarden.liveness import SILENT_AFTER
from stepwarden.store import Store
from stepwarden.store import agents as sa

A, B, C = "agent-a:1:aaa", "agent-b:2:bbb", "agent-c:3:ccc"
THRESHOLD, COOL_OFF = 3, 10.0
OPS = sa.ops_json(["do_s"])  # the operation of dispatch_requests' steps
Dispatch = Callable[..., list[int]]  # the dispatch_requests fixture (tests/conftest.py)
RULES = sa.HealthRules(unhealthy_after=3, probe_after=COOL_OFF, stale_after=30.0, trial_ttl=20.0)


def register(store: Store, *workers: str) -> None:
    for w in workers:
        store.transact_sync(sa.register, w, [sa.InstanceSpec("svc", 4, THRESHOLD, COOL_OFF)])


def report(store: Store, me: str, ok: bool, *, trial: bool = False, error: str = "down") -> sa.Verdict:
    r = sa.Report("svc", ok, None if ok else error, trial)
    return store.transact_sync(sa.report, me, r, THRESHOLD, COOL_OFF, RULES)


def pull(store: Store, me: str, room: int = 4, may_trial: bool = True) -> sa.PullResult:
    return store.transact_sync(sa.pull, me, {"svc": sa.Want(room, OPS, may_trial)}, RULES)


def rows(store: Store, sql: str) -> list[dict[str, Any]]:
    return store.transact_sync(lambda tx: tx.sql(sql))


def breaker(store: Store) -> dict[str, Any]:
    [b] = store.transact_sync(sa.list_agents)["breakers"]
    return b


def alerts(store: Store) -> list[dict[str, Any]]:
    return rows(store, "SELECT kind, message FROM alerts ORDER BY id")


def kinds(store: Store) -> list[str]:
    return [r["kind"] for r in rows(store, "SELECT kind FROM events WHERE task_id IS NULL ORDER BY id")]


def test_failures_across_instances_open_the_breaker_once_and_a_trial_closes_it(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    register(store, A, B, C)
    dispatch_requests(store, 4, budget=600.0)
    # consecutive failures from three instances: the third reaches the threshold
    verdicts = [report(store, w, False) for w in (A, B, C)]
    assert [v.opened for v in verdicts] == [False, False, True]
    assert verdicts[-1].breaker is not None and verdicts[-1].breaker.state == "open"
    # failures after it opened change nothing: no second alert
    assert not report(store, A, False).opened
    b = breaker(store)
    assert (b["state"], b["opened_by"], b["opens"]) == ("open", C, 1)
    assert [a["kind"] for a in alerts(store)] == ["breaker_opened"]
    assert "svc" in alerts(store)[0]["message"]
    # open for every instance: nobody pulls, nobody may try before the cool-off
    for w in (A, B, C):
        got = pull(store, w)
        assert got.requests == [] and got.breakers["svc"].state == "open"
    clock.advance(COOL_OFF - 0.5)
    assert pull(store, A).requests == []
    # after the cool-off exactly one instance wins the half-open trial, with one request
    clock.advance(0.5)
    first, second = pull(store, A), pull(store, B)
    assert first.trials == {"svc"} and len(first.requests) == 1
    assert second.trials == set() and second.requests == []
    # the trial fails: open again for a new cool-off, still one alert
    v = report(store, A, False, trial=True)
    assert v.breaker is not None and v.breaker.state == "open" and not v.opened
    assert v.breaker.retry_in == COOL_OFF
    assert pull(store, B).requests == []
    clock.advance(COOL_OFF)
    trial = pull(store, B)
    assert trial.trials == {"svc"} and len(trial.requests) == 1
    v = report(store, B, True, trial=True)
    assert v.closed and v.breaker is not None and v.breaker.state == "closed"
    # closed for all: the others pull again
    assert len(pull(store, C).requests) == 2
    assert [a["kind"] for a in alerts(store)] == ["breaker_opened"]
    assert [k for k in kinds(store) if k.startswith("breaker")] == [
        "breaker_opened",
        "breaker_trial",
        "breaker_reopened",
        "breaker_trial",
        "breaker_closed",
    ]


def test_a_success_resets_the_consecutive_count(store: Store) -> None:
    register(store, A, B)
    report(store, A, False)
    report(store, B, False)
    report(store, B, True)
    assert breaker(store)["failures"] == 0
    assert not report(store, A, False).opened and not report(store, B, False).opened
    assert breaker(store)["state"] == "closed"


def test_one_instance_alone_cannot_open_the_breaker_while_others_are_live(
    store: Store, clock: FakeClock
) -> None:
    register(store, A, B)
    report(store, B, True)  # B calls the service too (before A's failures: no witness against A)
    clock.advance(1)
    verdicts = [report(store, A, False) for _ in range(THRESHOLD + 2)]
    assert not any(v.opened or v.own_fault for v in verdicts) and breaker(store)["state"] == "closed"
    assert report(store, B, False).opened  # a second instance failing too: the service is down


@pytest.mark.parametrize("peer", ["never called", "called long ago"])
def test_a_live_instance_that_makes_no_calls_cannot_keep_the_breaker_closed(
    store: Store, clock: FakeClock, peer: str
) -> None:
    """B is live (it beats) but calls nothing: idle, or a version without the operation. It was
    counted as an instance that could speak for the service, so A's failures never opened the
    breaker and the down service was called forever (12 calls, failures 12, opens 0, with a
    threshold of 3). An instance speaks only if it called within ``stale_after``."""
    register(store, A, B)
    if peer == "called long ago":
        report(store, B, True)
        clock.advance(RULES.stale_after + 1)
    store.transact_sync(sa.beat, B, {"svc": (4, 0)})  # live
    verdicts = [report(store, A, False) for _ in range(THRESHOLD)]
    assert [v.opened for v in verdicts] == [False] * (THRESHOLD - 1) + [True]
    assert breaker(store)["state"] == "open"


def test_racing_reporters_open_the_breaker_exactly_once(store: Store) -> None:
    workers = [f"agent-{i}:{i}:race" for i in range(8)]
    register(store, *workers)
    opened: list[bool] = []
    lock = threading.Lock()
    go = threading.Barrier(len(workers))

    def fail(w: str) -> None:
        go.wait()
        for _ in range(2):
            v = report(store, w, False)
            with lock:
                opened.append(v.opened)

    threads = [threading.Thread(target=fail, args=(w,)) for w in workers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert len(opened) == 16 and opened.count(True) == 1
    assert [a["kind"] for a in alerts(store)] == ["breaker_opened"]
    assert breaker(store)["opens"] == 1


def test_racing_instances_claim_one_trial(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    workers = [f"agent-{i}:{i}:trial" for i in range(6)]
    register(store, *workers)
    dispatch_requests(store, 6, budget=600.0)
    for w in workers[:THRESHOLD]:
        report(store, w, False)
    clock.advance(COOL_OFF)
    results: list[sa.PullResult] = []
    lock = threading.Lock()
    go = threading.Barrier(len(workers))

    def try_pull(w: str) -> None:
        go.wait()
        got = pull(store, w)
        with lock:
            results.append(got)

    threads = [threading.Thread(target=try_pull, args=(w,)) for w in workers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert sum(len(r.trials) for r in results) == 1
    assert sum(len(r.requests) for r in results) == 1


def test_a_trial_whose_holder_vanished_is_claimed_again_after_its_lease(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    register(store, A, B)
    dispatch_requests(store, 3, budget=600.0)
    for w in (A, B, A):
        report(store, w, False)
    clock.advance(COOL_OFF)
    assert pull(store, A).trials == {"svc"}  # ... and A dies without reporting
    clock.advance(RULES.trial_ttl - 1)
    assert pull(store, B).trials == set()
    clock.advance(1)
    assert pull(store, B).trials == {"svc"}


def test_a_trial_with_no_request_to_try_is_given_back(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    register(store, A, B)
    for w in (A, B, A):
        report(store, w, False)
    clock.advance(COOL_OFF)
    assert pull(store, A).trials == set()  # nothing queued: no trial held
    dispatch_requests(store, 1, budget=600.0)
    assert pull(store, B).trials == {"svc"}


def test_an_instance_failing_while_another_succeeds_goes_unhealthy_not_the_breaker(store: Store) -> None:
    register(store, A, B)
    report(store, A, False)  # A's streak starts
    assert report(store, B, True).healthy  # B succeeds after it: the service is up
    v1 = report(store, A, False)
    assert v1.own_fault and v1.healthy
    v2 = report(store, A, False)  # A's third failure in a row, all while B succeeds
    assert v2.own_fault and not v2.healthy and v2.probe_in == COOL_OFF
    b = breaker(store)
    assert b["state"] == "closed" and b["failures"] == 0  # B's success reset A's first failure
    instances = {i["worker"]: i for i in store.transact_sync(sa.list_agents)["instances"]}
    assert not instances[A]["healthy"] and instances[A]["failures"] == 3
    assert instances[A]["probe_in"] == COOL_OFF and instances[A]["last_error"] == "down"
    assert instances[B]["healthy"] and instances[B]["last_success_at"] is not None
    # a failed probe: still unhealthy, not counted toward the breaker either
    v3 = report(store, A, False)
    assert v3.own_fault and not v3.healthy and breaker(store)["failures"] == 0
    assert alerts(store) == []
    # the probe succeeds: healthy again
    assert report(store, A, True).healthy
    assert [k for k in kinds(store) if k.startswith("instance")] == ["instance_unhealthy", "instance_healthy"]


def test_an_unhealthy_instance_whose_witness_is_gone_is_healthy_again_and_its_failure_counts(
    store: Store, clock: FakeClock
) -> None:
    """Unhealthy means: others succeed where this instance fails. Once no other live instance
    does (B stopped), an unhealthy instance's failure is the service's: it used to stay
    unhealthy and own nothing, so its attempts were handed back uncounted forever and a task
    whose service stayed down never escalated (REL1)."""
    register(store, A, B)
    report(store, A, False)
    clock.advance(0.1)
    report(store, B, True)
    for _ in range(RULES.unhealthy_after - 1):
        v = report(store, A, False)
    assert v.own_fault and not v.healthy
    store.transact_sync(sa.stop, B)
    v = report(store, A, False)  # the probe fails, and no one succeeds where A fails
    assert not v.own_fault and v.healthy
    assert breaker(store)["failures"] == 1  # counted toward the breaker like anyone's failure
    [inst] = [i for i in store.transact_sync(sa.list_agents)["instances"] if i["worker"] == A]
    assert inst["healthy"] and inst["probe_in"] is None
    assert [k for k in kinds(store) if k.startswith("instance")] == ["instance_unhealthy", "instance_healthy"]
    # alone and failing, it opens the breaker at the threshold, as a lone instance does
    opened = [report(store, A, False).opened for _ in range(THRESHOLD - 1)]
    assert opened == [False] * (THRESHOLD - 2) + [True]


def test_a_stopped_or_silent_instance_is_no_evidence_that_the_service_is_up(
    store: Store, clock: FakeClock
) -> None:
    register(store, A, B, C)
    report(store, A, False)
    report(store, B, True)
    store.transact_sync(sa.stop, B)  # B's success does not count once B stopped
    clock.advance(1)
    report(store, C, True)
    clock.advance(RULES.stale_after + 1)  # ... nor C's once its heartbeat is stale
    verdicts = [report(store, A, False) for _ in range(THRESHOLD)]
    assert not any(v.own_fault for v in verdicts)
    assert verdicts[-1].opened


def test_heartbeat_records_capacity_and_load(store: Store) -> None:
    register(store, A)
    store.transact_sync(sa.beat, A, {"svc": (8, 3)})
    [i] = store.transact_sync(sa.list_agents)["instances"]
    assert (i["worker"], i["agent"], i["capacity"], i["inflight"], i["healthy"]) == (A, "svc", 8, 3, True)
    store.transact_sync(sa.stop, A)
    assert store.transact_sync(sa.list_agents)["instances"] == []
    assert len(store.transact_sync(sa.list_agents, True)["instances"]) == 1


def test_an_instance_killed_without_a_word_leaves_the_listing(store: Store, clock: FakeClock) -> None:
    register(store, A, B)
    clock.advance(SILENT_AFTER / 2)
    store.transact_sync(sa.beat, B, {"svc": (4, 0)})
    clock.advance(SILENT_AFTER / 2 + 1)  # A never beat again (SIGKILL)
    assert [i["worker"] for i in store.transact_sync(sa.list_agents)["instances"]] == [B]
    assert len(store.transact_sync(sa.list_agents, True)["instances"]) == 2


def test_a_pull_takes_only_the_operations_the_instance_has(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """A rolling deploy: a worker without an operation leaves its requests queued, for the
    workers that have it (the trial too: a trial on an operation never called says nothing)."""
    register(store, A)
    dispatch_requests(store, 2, budget=600.0)  # two requests for svc.do_s
    old_ops, new_ops = sa.ops_json(["do_other"]), sa.ops_json(["do_other", "do_s"])
    older = store.transact_sync(sa.pull, A, {"svc": sa.Want(4, old_ops, True)}, RULES)
    assert older.requests == []
    newer = store.transact_sync(sa.pull, A, {"svc": sa.Want(1, new_ops, True)}, RULES)
    assert [m.operation for m in newer.requests] == ["do_s"]
    for w in (A, A, A):
        report(store, w, False)
    clock.advance(COOL_OFF)
    assert (
        store.transact_sync(sa.pull, A, {"svc": sa.Want(4, sa.ops_json(["x"]), True)}, RULES).trials == set()
    )
    assert breaker(store)["trial_by"] is None
    assert [m.operation for m in pull(store, A).requests] == ["do_s"]


def _unhealthy_b_and_an_open_breaker(store: Store, clock: FakeClock) -> None:
    """B fails while A succeeds (B's own path: unhealthy), then A fails too: the breaker opens."""
    register(store, A, B)
    report(store, B, False)
    report(store, A, True)
    for _ in range(RULES.unhealthy_after - 1):
        report(store, B, False)
    instances = {i["worker"]: i for i in store.transact_sync(sa.list_agents)["instances"]}
    assert not instances[B]["healthy"] and instances[A]["healthy"]
    assert [report(store, A, False).opened for _ in range(THRESHOLD)][-1]
    clock.advance(COOL_OFF)


def probe(store: Store, me: str, unclaimed: float = 0.0) -> sa.PullResult:
    """An unhealthy instance's probe: one request, the trial only if no healthy instance could
    (or, with ``unclaimed``, if none took it for that long after it fell due)."""
    want = sa.Want(1, OPS, may_trial=True, trial_if_alone=True, trial_unclaimed=unclaimed)
    return store.transact_sync(sa.pull, me, {"svc": want}, RULES)


@pytest.mark.parametrize("gone", ["stopped", "silent"])
def test_an_unhealthy_instance_runs_the_trial_only_when_no_healthy_one_is_left(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch, gone: str
) -> None:
    """While a healthy instance is live, the trial is its to run (an unhealthy one failing on its
    own path would only keep the breaker open). With none left, the unhealthy one's probe is
    the trial: it used to get nothing while the breaker was open, and with nothing else making
    calls the breaker stayed open for good."""
    _unhealthy_b_and_an_open_breaker(store, clock)
    dispatch_requests(store, 2, budget=600.0)
    assert probe(store, B).trials == set() and breaker(store)["state"] == "open"
    if gone == "stopped":
        store.transact_sync(sa.stop, A)
    else:  # killed: its heartbeat stops (its last was its last report, a cool-off ago)
        clock.advance(RULES.stale_after - COOL_OFF - 1)
        assert probe(store, B).trials == set()
        clock.advance(2)
    got = probe(store, B)
    assert got.trials == {"svc"} and len(got.requests) == 1
    assert breaker(store)["trial_by"] == B
    verdict = report(store, B, True, trial=True)  # the service answers B again
    assert verdict.closed and verdict.healthy
    assert breaker(store)["state"] == "closed"


def test_an_unhealthy_instance_takes_a_trial_left_untaken_past_its_bound_beside_a_live_healthy_one(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """A live, healthy instance that pulls takes the trial when it falls due; one that cannot run
    it (its slots all held, or a version without the operation, which takes the trial and gives
    it back at once for want of a request) for ``trial_unclaimed`` seconds leaves it to the
    unhealthy probe. Measured from when the trial first fell due, on the database's clock."""
    _unhealthy_b_and_an_open_breaker(store, clock)  # the trial falls due now
    dispatch_requests(store, 2, budget=600.0)
    beat = {"svc": (4, 4)}
    lacking = {"svc": sa.Want(4, sa.ops_json(["another_op"]), may_trial=True)}

    def a_cannot_run_it() -> None:
        store.transact_sync(sa.beat, A, beat)  # A is live and healthy
        got = store.transact_sync(sa.pull, A, lacking, RULES)
        assert got.trials == set() and got.requests == []  # taken and given back, or left

    a_cannot_run_it()
    assert probe(store, B, unclaimed=5.0).trials == set()
    for _ in range(7):
        clock.advance(0.7)
        a_cannot_run_it()
    assert probe(store, B, unclaimed=5.0).trials == set() and breaker(store)["state"] == "open"
    clock.advance(0.2)
    a_cannot_run_it()
    got = probe(store, B, unclaimed=5.0)
    assert got.trials == {"svc"} and len(got.requests) == 1 and breaker(store)["trial_by"] == B
    assert probe(store, A).trials == set(), "the trial is B's now: A's pull does not take it too"


def test_a_request_that_has_just_come_is_the_healthy_instances_trial_however_long_the_breaker_was_due(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """With nothing queued, a healthy instance takes the due trial and gives it back at every pull
    (nothing to try), and the time since the trial fell due kept growing: the first request to
    come then found the bound long passed, and an unhealthy probe could take it before the
    healthy instances (whose trial it is). The bound also asks that a request of the probe's
    operations has waited that long."""
    _unhealthy_b_and_an_open_breaker(store, clock)  # the trial falls due now; nothing queued
    for _ in range(30):  # a minute of A's pulls, each taking the trial and giving it back
        clock.advance(2.0)
        store.transact_sync(sa.beat, A, {"svc": (4, 0)})
        assert pull(store, A).trials == set()
    dispatch_requests(store, 1, budget=600.0)  # a request comes
    assert probe(store, B, unclaimed=5.0).trials == set(), "the healthy instance's trial, not B's"
    clock.advance(5.1)  # ... and A, live and healthy, leaves it untaken for the bound
    store.transact_sync(sa.beat, A, {"svc": (4, 4)})
    assert probe(store, B, unclaimed=5.0).trials == {"svc"}


def test_a_trial_a_healthy_instance_ran_and_failed_starts_the_count_again(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """The bound counts from when the trial fell due after the breaker last (re)opened: a healthy
    instance that runs its trials (and they fail) keeps them, however long the breaker is open."""
    _unhealthy_b_and_an_open_breaker(store, clock)
    dispatch_requests(store, 3, budget=600.0)
    for _ in range(3):
        got = pull(store, A)
        assert got.trials == {"svc"}
        clock.advance(1.0)
        report(store, A, False, trial=True)  # the trial failed: another cool-off
        clock.advance(COOL_OFF)
        assert probe(store, B, unclaimed=5.0).trials == set()


def test_a_trial_whose_holder_renews_its_claim_is_not_taken_by_another(
    store: Store, clock: FakeClock, dispatch_requests: Dispatch
) -> None:
    """A trial call slower than trial_ttl keeps its claim while its holder renews it; once the
    renewals stop (the holder died or stalled), the trial opens to others at trial_ttl."""
    register(store, A, B)
    dispatch_requests(store, 3, budget=600.0)
    for w in (A, B, A):
        report(store, w, False)
    clock.advance(COOL_OFF)
    assert pull(store, A).trials == {"svc"}
    for _ in range(3):  # a minute and a half of a slow trial call, renewed every 20 s
        clock.advance(RULES.trial_ttl / 3)
        assert store.transact_sync(sa.renew_trial, A, "svc", RULES.trial_ttl)
        assert pull(store, B).trials == set()
    clock.advance(RULES.trial_ttl)  # A stopped renewing
    assert pull(store, B).trials == {"svc"}
    assert not store.transact_sync(sa.renew_trial, A, "svc", RULES.trial_ttl)  # no longer A's
    report(store, A, True, trial=True)  # A's late verdict changes nothing
    assert (breaker(store)["state"], breaker(store)["trial_by"]) == ("half_open", B)
