"""The fake services must misbehave exactly as seeded and keep an honest ledger of real effects."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypedDict

import httpx
import pytest

from stepwarden.demo.ledger import OrderOutcome, check_ledger, fetch_ledger
from stepwarden.demo.services import FakeServices, main, serve_in_thread

Start = Callable[..., str]


class Rates(TypedDict, total=False):
    """FakeServices' failure rates, passed as keywords."""

    transient_rate: float
    hang_rate: float
    permanent_rate: float


# One shared client: building a fresh one per request costs tens of milliseconds of TLS setup.
CLIENT = httpx.Client(timeout=5)


@pytest.fixture(scope="module", autouse=True)
def _close_client() -> Iterator[None]:
    yield
    CLIENT.close()


@pytest.fixture
def start() -> Iterator[Start]:
    stops: list[Callable[[], None]] = []

    def _start(**kwargs: Any) -> str:
        url, stop = serve_in_thread(**kwargs)
        stops.append(stop)
        return url

    yield _start
    for stop in stops:
        stop()


def post(url: str, path: str, key: str | None, order_id: str = "o1", timeout: float = 5.0) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return CLIENT.post(url + path, json={"order_id": order_id, "sku": "x"}, headers=headers, timeout=timeout)


def ledger(url: str) -> dict[str, dict[str, Any]]:
    effects: dict[str, dict[str, Any]] = CLIENT.get(url + "/ledger").json()["effects"]
    return effects


def find_key(seed: int, want: list[tuple[str, int, bool, str]], rates: Rates) -> str:
    """A key whose seeded decisions are exactly ``want`` (op, call number, forward, decision)."""
    services = FakeServices(seed=seed, **rates)
    for i in range(10_000):
        key = f"k{i}:step"
        if all(services.decide(op, key, n, fwd) == d for op, n, fwd, d in want):
            return key
    raise AssertionError("no key with the wanted decisions")


def test_health(start: Start) -> None:
    url = start()
    assert CLIENT.get(url + "/health").json() == {"ok": True}


def test_ok_applies_once_and_repeat_is_idempotent(start: Start) -> None:
    url = start()
    first = post(url, "/payments/charge", "1:charge")
    second = post(url, "/payments/charge", "1:charge")
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json()
    assert first.json()["ref"].startswith("payments-")
    entry = ledger(url)["1:charge"]
    assert entry["applied"] == 1 and entry["undone"] == 0 and entry["calls"] == 2
    assert (entry["service"], entry["op"], entry["order_id"]) == ("payments", "charge", "o1")


def test_transient_returns_503_without_effect(start: Start) -> None:
    url = start(transient_rate=1.0)
    resp = post(url, "/inventory/reserve", "1:reserve")
    assert resp.status_code == 503 and resp.json() == {"error": "transient"}
    entry = ledger(url)["1:reserve"]
    assert entry["applied"] == 0 and entry["calls"] == 1


def test_permanent_refusal_is_sticky(start: Start) -> None:
    rates: Rates = {"permanent_rate": 0.5}
    key = find_key(3, [("charge", 1, True, "permanent"), ("charge", 2, True, "ok")], rates)
    url = start(seed=3, **rates)
    for _ in range(2):
        resp = post(url, "/payments/charge", key)
        assert resp.status_code == 422 and resp.json() == {"error": "permanent: charge refused"}
    entry = ledger(url)[key]
    assert entry["applied"] == 0 and entry["rejected"] is True


def test_hang_applies_then_withholds_reply(start: Start) -> None:
    url = start(hang_rate=1.0, hang_seconds=0.5)
    with pytest.raises(httpx.TimeoutException):
        post(url, "/shipping/create", "1:ship", timeout=0.2)
    assert ledger(url)["1:ship"]["applied"] == 1


def test_stop_releases_hung_handlers_early() -> None:
    url, stop = serve_in_thread(hang_rate=1.0, hang_seconds=30)
    with pytest.raises(httpx.TimeoutException):
        post(url, "/shipping/create", "1:ship", timeout=0.2)
    began = time.monotonic()
    stop()
    deadline = began + 3
    while any("process_request" in t.name for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a hung handler outlived the server"
        time.sleep(0.02)


def test_undo_after_apply_and_twice(start: Start) -> None:
    url = start()
    assert post(url, "/inventory/reserve", "1:reserve").status_code == 200
    for _ in range(2):
        resp = post(url, "/inventory/release", "1:reserve")
        assert resp.status_code == 200 and resp.json() == {"undone": True}
    # A stale forward retry after the undo must not re-apply the effect.
    assert post(url, "/inventory/reserve", "1:reserve").status_code == 200
    entry = ledger(url)["1:reserve"]
    assert (entry["applied"], entry["undone"], entry["tombstoned"]) == (1, 1, False)


def test_undo_before_apply_tombstones_the_key(start: Start) -> None:
    url = start()
    resp = post(url, "/payments/refund", "1:charge")
    assert resp.status_code == 200
    assert resp.json() == {"undone": False, "reason": "nothing applied"}
    late = post(url, "/payments/charge", "1:charge")
    assert late.status_code == 409 and late.json() == {"error": "cancelled before applied"}
    entry = ledger(url)["1:charge"]
    assert (entry["applied"], entry["undone"], entry["tombstoned"], entry["op"]) == (0, 0, True, "charge")


def test_hung_undo_still_undoes(start: Start) -> None:
    rates: Rates = {"hang_rate": 0.5}
    key = find_key(5, [("reserve", 1, True, "ok"), ("release", 1, False, "hang")], rates)
    url = start(seed=5, hang_seconds=0.5, **rates)
    assert post(url, "/inventory/reserve", key).status_code == 200
    with pytest.raises(httpx.TimeoutException):
        post(url, "/inventory/release", key, timeout=0.2)
    assert ledger(url)[key]["undone"] == 1


def test_decisions_do_not_depend_on_interleaving(start: Start) -> None:
    a, b = start(seed=11, transient_rate=0.5), start(seed=11, transient_rate=0.5)
    keys = [f"{i}:reserve" for i in range(8)]
    seen_a: dict[str, list[int]] = {k: [] for k in keys}
    seen_b: dict[str, list[int]] = {k: [] for k in keys}
    for _ in range(3):
        for k in keys:
            seen_a[k].append(post(a, "/inventory/reserve", k).status_code)
    for k in reversed(keys):
        for _ in range(3):
            seen_b[k].append(post(b, "/inventory/reserve", k).status_code)
    assert seen_a == seen_b
    statuses = {s for seq in seen_a.values() for s in seq}
    assert statuses == {200, 503}


def test_unsafe_mode_duplicates_and_ledger_check_catches_it(start: Start) -> None:
    url = start(unsafe=True)
    for step, path in (("reserve", "/inventory/reserve"), ("charge", "/payments/charge")):
        assert post(url, path, f"1:{step}").status_code == 200
    assert post(url, "/payments/charge", "1:charge").status_code == 200
    assert post(url, "/shipping/create", "1:ship").status_code == 200
    effects = fetch_ledger(url)
    assert effects["1:charge"]["applied"] == 2
    report = check_ledger(effects, [OrderOutcome("o1", "1", "processed")])
    assert not report.ok and report.duplicate_effects == 1 and report.lost == 0


def test_fetch_ledger_matches_http_view(start: Start) -> None:
    url = start()
    post(url, "/inventory/reserve", "1:reserve")
    assert fetch_ledger(url + "/") == ledger(url)


@pytest.mark.parametrize(
    ("headers", "content"),
    [
        ({}, b'{"order_id": "o1"}'),
        ({"Idempotency-Key": "1:reserve"}, b"{not json"),
        ({"Idempotency-Key": "1:reserve"}, b'{"sku": "x"}'),
        ({"Idempotency-Key": "1:reserve"}, b'["order_id"]'),
    ],
)
def test_bad_requests_are_400_without_effect(start: Start, headers: dict[str, str], content: bytes) -> None:
    url = start()
    resp = CLIENT.post(url + "/inventory/reserve", content=content, headers=headers)
    assert resp.status_code == 400
    assert ledger(url) == {}


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/warehouse/reserve"), ("POST", "/inventory/charge"), ("POST", "/inventory"), ("GET", "/x")],
)
def test_unknown_paths_are_404(start: Start, method: str, path: str) -> None:
    url = start()
    headers = {"Idempotency-Key": "1:reserve"}
    resp = CLIENT.request(method, url + path, json={"order_id": "o1"}, headers=headers)
    assert resp.status_code == 404
    assert ledger(url) == {}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--hang-rate", "1.5"], "argument --hang-rate: rate must be within [0, 1], got 1.5"),
        (["--hang-rate", "often"], "argument --hang-rate: expected a number from 0 to 1, got 'often'"),
        (["--port", "-1"], "argument --port: a port is within [0, 65535], got -1"),
        (["--port", "70000"], "argument --port: a port is within [0, 65535], got 70000"),
        (["--hang-seconds", "-5"], "argument --hang-seconds: seconds must be within [0, 86400], got -5"),
        (["--hang-seconds", "nan"], "argument --hang-seconds: seconds must be within [0, 86400], got nan"),
        (["--colour", "red"], "unrecognized arguments: --colour red"),
    ],
)
def test_cli_refuses_bad_input_in_one_line_with_exit_2(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port out of range printed a traceback (OverflowError from the socket), a negative hang
    was taken, and every refusal came after argparse's usage block."""
    argv = args if "--port" in args else ["--port", "0", *args]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: {says}\n"


def test_cli_announces_url_and_exits_cleanly_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "stepwarden.demo.services", "--port", "0", "--seed", "7"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.put(proc.stdout.readline() if proc.stdout else ""))
    reader.start()
    try:
        line = lines.get(timeout=10)
        match = re.fullmatch(r"listening on (http://127\.0\.0\.1:(\d+))\n", line)
        assert match, line
        assert int(match.group(2)) > 0
        assert CLIENT.get(match.group(1) + "/health").json() == {"ok": True}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        out, err = proc.communicate(timeout=5)
        assert out == "" and err == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        reader.join(timeout=5)
