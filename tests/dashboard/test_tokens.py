"""The operator token: one whitespace rule for the configured token, the Bearer header and the
sign-in form; a global limit on how many wrong tokens are checked (parallel guesses included),
which never holds the right token behind wrong ones; no timing that tells the token's length;
the auth cookie deleted with the flags it was set with.

The limiter's clock is a :class:`FakeClock` that never moves unless told to: the counts per
interval are exact, and a request that waited on it would never finish (each gather is bounded by
``asyncio.wait_for``)."""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

from stepwarden.clock import FakeClock
from stepwarden.dashboard.security import Guard
from stepwarden.dashboard.tokens import GuessLimiter, Throttled, bearer_credentials, configured_token
from stepwarden.dashboard.web import create_app
from stepwarden.store import Store

from .command_harness import invoke_dashboard, record_serving

with warnings.catch_warnings():  # Starlette would rather use httpx2; httpx is what we have
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")

TOKEN = "tok-0123456789"
ORIGIN = "http://testserver"
MISSING = "/tasks/424242/retry"  # a task that does not exist: 404 once authorised, 401 before
ATTACKER = "203.0.113.66"
OPERATOR = "198.51.100.7"


def client(store: Store, token: str | None = TOKEN, **kw: Any) -> TestClient:
    return TestClient(create_app(store, token, **kw), follow_redirects=False)


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert m, "the page carries no CSRF token"
    return m.group(1)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# -- one rule for surrounding whitespace -----------------------------------------------------------


@pytest.mark.parametrize("configured", [TOKEN, f"  {TOKEN}\n", f"\t{TOKEN}\r\n"])
@pytest.mark.parametrize(
    "header",
    [
        f"Bearer {TOKEN}",
        f"Bearer   {TOKEN}  ",
        f"Bearer\t{TOKEN}\t",
        f"bearer {TOKEN}",
        f"  Bearer {TOKEN}",
    ],
)
def test_a_bearer_token_matches_whatever_whitespace_surrounds_either_side(
    store: Store, configured: str, header: str
) -> None:
    """The configured token kept its newline (read from a file) or spaces, and never matched the
    header's token, whose spaces were stripped; a tab after the scheme was not a Bearer header."""
    with client(store, configured) as c:
        r = c.post(MISSING, headers={"Authorization": header})
        assert r.status_code == 404, (configured, header, r.text)  # authorised: the task is missing


def test_whitespace_inside_a_presented_token_is_part_of_it(store: Store) -> None:
    with client(store) as c:
        for header in (f"Bearer {TOKEN[:4]} {TOKEN[4:]}", f"Bearer {TOKEN} extra", "Bearer", "Bearer  "):
            r = c.post(MISSING, headers={"Authorization": header})
            assert r.status_code == 401 and r.text == "refused: wrong bearer token\n", header


@pytest.mark.parametrize("configured", [TOKEN, f" {TOKEN}\n"])
@pytest.mark.parametrize("typed", [TOKEN, f" {TOKEN} ", f"{TOKEN}\n", f"\t{TOKEN}\r\n"])
def test_the_sign_in_form_takes_a_pasted_token_with_whitespace_around_it(
    store: Store, configured: str, typed: str
) -> None:
    with client(store, configured) as c:
        csrf = csrf_of(c.get("/").text)
        r = c.post("/login", data={"csrf": csrf, "token": typed, "next": "/"}, headers={"Origin": ORIGIN})
        assert r.status_code == 303, (configured, typed, r.text)
        assert "signed in as" in c.get("/").text


@pytest.mark.parametrize(
    "value", ["   ", "\n", " \t\r\n", "s3cret en", "s3cret\ten", "s3cret\x00en", "s3cret\x7fen", "s3crét"]
)
def test_a_configured_token_that_can_never_be_presented_is_refused(store: Store, value: str) -> None:
    """Blank (an empty file's newline) or with what no Bearer header carries intact inside."""
    with pytest.raises(ValueError, match="operator token") as e:
        create_app(store, value)
    assert "s3cr" not in str(e.value)  # the token itself is never in the message
    with pytest.raises(ValueError):
        Guard(value)


def test_an_empty_configured_token_is_read_only() -> None:
    assert configured_token("") is None and configured_token(None) is None
    assert configured_token(f" {TOKEN}\n") == TOKEN
    assert not Guard("").actions_enabled


def test_bearer_credentials() -> None:
    assert bearer_credentials(f"Bearer {TOKEN}") == TOKEN
    assert bearer_credentials(f" BEARER\t {TOKEN} \t") == TOKEN
    assert bearer_credentials("Bearer") == ""
    assert bearer_credentials("Basic dXNlcjpwYXNz") is None
    assert bearer_credentials("Bearertok") is None
    assert bearer_credentials("") is None


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return record_serving(monkeypatch)


@pytest.mark.parametrize(
    ("args", "env"),
    [
        ([], {"STEPWARDEN_DASHBOARD_TOKEN": f"{TOKEN}\n"}),  # STEPWARDEN_DASHBOARD_TOKEN="$(cat file)"...
        ([], {"STEPWARDEN_DASHBOARD_TOKEN": f"  {TOKEN}\r\n"}),  # ... or a file with CRLF
        (["--token", f" {TOKEN} "], {}),
    ],
)
def test_the_command_strips_the_configured_token(
    tmp_path: Path, served: list[dict[str, Any]], args: list[str], env: dict[str, str]
) -> None:
    r = invoke_dashboard(tmp_path, *args, env=env)
    assert r.exit_code == 0, r.output
    assert "operator actions enabled" in r.output
    app = served[0]["app"]
    assert app.state.dashboard.guard.token == TOKEN
    with TestClient(app, base_url="http://127.0.0.1", follow_redirects=False) as c:  # loopback Host
        assert c.post(MISSING, headers=bearer(TOKEN)).status_code == 404


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        ([], {"STEPWARDEN_DASHBOARD_TOKEN": " \n"}, "STEPWARDEN_DASHBOARD_TOKEN"),
        ([], {"STEPWARDEN_DASHBOARD_TOKEN": "s3cret value"}, "STEPWARDEN_DASHBOARD_TOKEN"),
        (["--token", "\t"], {}, "'--token'"),
        (["--token", "s3cret\x1bvalue"], {}, "'--token'"),
    ],
)
def test_the_command_refuses_a_blank_or_spaced_token_in_one_line(
    tmp_path: Path, served: list[dict[str, Any]], args: list[str], env: dict[str, str], named: str
) -> None:
    r = invoke_dashboard(tmp_path, *args, env=env)
    assert r.exit_code == 2 and not served, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and named in errors[0] and "operator token" in errors[0], r.output
    assert "s3cret" not in r.output  # the token itself is never printed


# -- no timing that tells the token's length -------------------------------------------------------


def test_comparing_tokens_takes_no_time_that_depends_on_their_lengths(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compare_digest of the raw values returns at once when the lengths differ: how long a wrong
    token took told the right token's length. Fixed-length digests are compared instead."""
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with client(store) as c:
        for guess in ("x", TOKEN[:-1], TOKEN + "x", "y" * 300):
            assert c.post(MISSING, headers=bearer(guess)).status_code == 401
        assert c.post(MISSING, headers=bearer(TOKEN)).status_code == 404
        csrf = csrf_of(c.get("/").text)  # a session from here: not a script any more
        r = c.post("/login", data={"csrf": csrf, "token": "z" * 77}, headers={"Origin": ORIGIN})
        assert r.status_code == 403
    token_checks = [pair for pair in compared if pair != (64, 64)]  # (64, 64): the CSRF token's HMAC
    assert token_checks, "no token was compared"
    assert len({n for pair in token_checks for n in pair}) == 1, token_checks


# -- cookies ---------------------------------------------------------------------------------------


def test_signing_out_behind_a_tls_proxy_deletes_the_auth_cookie_as_secure(store: Store) -> None:
    from http.cookies import SimpleCookie

    proxy = "https://ops.example.com"
    with client(store, public_origin=proxy) as c:
        first = c.get("/")
        jar: SimpleCookie = SimpleCookie()
        for header in first.headers.get_list("set-cookie"):
            jar.load(header)

        def sent() -> dict[str, str]:
            return {"Origin": proxy, "Cookie": "; ".join(f"{k}={m.value}" for k, m in jar.items())}

        r = c.post("/login", data={"csrf": csrf_of(first.text), "token": TOKEN}, headers=sent())
        assert r.status_code == 303, r.text
        for header in r.headers.get_list("set-cookie"):
            jar.load(header)
        page = c.get("/", headers={"Cookie": sent()["Cookie"]})
        r = c.post("/logout", data={"csrf": csrf_of(page.text)}, headers=sent())
        assert r.status_code == 303
        set_cookies = r.headers.get_list("set-cookie")
        deleted = [h for h in set_cookies if h.startswith("sw_auth=")]
        assert deleted and all(
            "secure" in h.lower() and "httponly" in h.lower() and "samesite=lax" in h.lower()
            for h in set_cookies
        ), set_cookies


# -- guessing: a global limit, the right token never behind wrong ones -----------------------------


def transport(app: Any, address: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=(address, 40000)),
        base_url=ORIGIN,
        follow_redirects=False,
    )


async def together(*requests: Any) -> list[httpx.Response]:
    """All at once; within 10 s of the real clock (the fake one never moves by itself)."""
    return list(await asyncio.wait_for(asyncio.gather(*requests), timeout=10))


def statuses(responses: list[httpx.Response]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in responses:
        out[r.status_code] = out.get(r.status_code, 0) + 1
    return out


def test_wrong_tokens_sent_in_parallel_are_checked_at_most_so_many_a_second(store: Store) -> None:
    """A quarter-second pause per wrong token, taken by each request at once, let 50 parallel
    guesses through in a quarter of a second (and 5,000 as fast). Now 10 wrong tokens are checked
    at once, then 4 a second, however many come: the rest are refused unchecked (429)."""
    clock = FakeClock()
    app = create_app(store, TOKEN, clock=clock)
    guesses = app.state.dashboard.guard.guesses

    async def main() -> None:
        async with transport(app, ATTACKER) as c:
            burst = await together(*(c.post(MISSING, headers=bearer(f"guess-{i}")) for i in range(50)))
            assert statuses(burst) == {401: 10, 429: 40}
            assert guesses.checked == 10
            refused = [r for r in burst if r.status_code == 429]
            assert all(r.headers["retry-after"] == "1" for r in refused)
            assert all(r.text.startswith("refused: too many wrong tokens") for r in refused)
            # (binary fractions of a second: the allowance's arithmetic is exact)
            for seconds, checked in ((1.0, 4), (0.25, 1), (0.125, 0), (0.125, 1), (100.0, 10)):
                clock.advance(seconds)
                wave = await together(*(c.post(MISSING, headers=bearer(f"more-{i}")) for i in range(30)))
                assert statuses(wave).get(401, 0) == checked, (seconds, statuses(wave))
            assert guesses.checked == 10 + 4 + 1 + 0 + 1 + 10

    asyncio.run(main())


def test_parallel_guesses_on_the_real_clock_stay_within_the_limit(store: Store) -> None:
    """The same through the default clock: however the 200 requests interleave, no more wrong
    tokens are checked (401) than the allowance plus what came back while they ran. The bound is
    measured, not hoped for: the old pause let all 200 be checked in about 0.3 s."""
    app = create_app(store, TOKEN)

    async def main() -> None:
        async with transport(app, ATTACKER) as c:
            t0 = time.monotonic()
            answers = await together(*(c.post(MISSING, headers=bearer(f"g{i}")) for i in range(200)))
            elapsed = time.monotonic() - t0
        counted = statuses(answers)
        assert set(counted) <= {401, 429}, counted
        assert 10 <= counted[401] <= 10 + 4.0 * elapsed + 1, (counted, elapsed)

    asyncio.run(main())


def test_the_sign_in_form_shares_the_limit(store: Store) -> None:
    clock = FakeClock()
    app = create_app(store, TOKEN, clock=clock)

    async def main() -> None:
        async with transport(app, ATTACKER) as c:
            csrf = csrf_of((await c.get("/")).text)
            form = {"csrf": csrf, "next": "/"}
            logins = await together(
                *(
                    c.post("/login", data={**form, "token": f"g{i}"}, headers={"Origin": ORIGIN})
                    for i in range(6)
                )
            )
            assert statuses(logins) == {403: 6}  # checked: wrong
            async with transport(app, ATTACKER) as script:  # no session: a script
                scripts = await together(*(script.post(MISSING, headers=bearer(f"s{i}")) for i in range(6)))
            assert statuses(scripts) == {401: 4, 429: 2}  # ten in all
            r = await c.post("/login", data={**form, "token": "again"}, headers={"Origin": ORIGIN})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "too many wrong tokens" in r.text and "<html" in r.text
            metrics = (await c.get("/metrics")).text
            assert 'stepwarden_dashboard_actions_total{action="login",result="throttled"} 1.0' in metrics
            assert 'stepwarden_dashboard_actions_total{action="login",result="refused"} 6.0' in metrics

    asyncio.run(main())


def test_a_session_cookie_and_a_csrf_field_do_not_get_round_the_limit(store: Store) -> None:
    """A request with a Bearer header and any session cookie and CSRF field is a browser's, whose
    form's refusal was the answer; its Bearer token was still checked, with no pause at all."""
    clock = FakeClock()
    app = create_app(store, TOKEN, clock=clock)
    guesses = app.state.dashboard.guard.guesses

    async def main() -> None:
        async with transport(app, ATTACKER) as c:
            disguised = {"Cookie": "sw_session=" + "0" * 32, "Origin": ORIGIN}
            answers = await together(
                *(
                    c.post(MISSING, data={"csrf": "x"}, headers={**disguised, **bearer(f"g{i}")})
                    for i in range(40)
                )
            )
            assert statuses(answers) == {403: 40}  # the form's refusal, checked or not
            assert guesses.checked == 10
            r = await c.post(MISSING, headers=bearer("one-more"))
            assert r.status_code == 429
            # the right token through the same disguise: let through once it may be checked
            clock.advance(0.25)
            r = await c.post(MISSING, data={"csrf": "x"}, headers={**disguised, **bearer(TOKEN)})
            assert r.status_code == 404

    asyncio.run(main())


def test_the_right_token_is_never_held_behind_wrong_ones(store: Store) -> None:
    """Among 40 wrong tokens sent together, the right one is checked at once (the clock never
    moves: nothing waits), uses no allowance, and its action runs."""
    clock = FakeClock()
    app = create_app(store, TOKEN, clock=clock)
    guesses = app.state.dashboard.guard.guesses

    async def main() -> None:
        async with transport(app, ATTACKER) as c:
            wrong = [c.post(MISSING, headers=bearer(f"g{i}")) for i in range(40)]
            right = [c.post(MISSING, headers=bearer(TOKEN)) for _ in range(3)]
            answers = await together(*right[:1], *wrong[:5], *right[1:2], *wrong[5:], *right[2:])
            assert [answers[0].status_code, answers[6].status_code] == [404, 404], statuses(answers)
            assert statuses(answers[1:6] + answers[7:-1]) == {401: 10, 429: 30}
            assert guesses.main.level == 0.0  # the ten allowances went to wrong tokens only
            # once they are used up, the right token is not queued either: refused at once, and
            # let through when told (Retry-After), however many wrong ones are still coming
            last = answers[-1]
            assert last.status_code == 429 and last.headers["retry-after"] == "1"
            clock.advance(1.0)
            again = await together(
                c.post(MISSING, headers=bearer(TOKEN)),
                *(c.post(MISSING, headers=bearer(f"h{i}")) for i in range(20)),
            )
            assert again[0].status_code == 404 and statuses(again[1:]) == {401: 4, 429: 16}

    asyncio.run(main())


def test_a_flood_from_one_address_does_not_lock_out_the_operator_at_another(store: Store) -> None:
    """While one address keeps the allowance used up, a client that sent no wrong token has a small
    reserve of its own: the operator's right token (script or sign-in) is let through at once.
    A client that guessed wrong has none, and neither has one behind the same address (a proxy):
    that one is let through as soon as an allowance comes back (Retry-After)."""
    clock = FakeClock()
    app = create_app(store, TOKEN, clock=clock)

    async def main() -> None:
        async with transport(app, ATTACKER) as attacker, transport(app, OPERATOR) as operator:
            flood = await together(*(attacker.post(MISSING, headers=bearer(f"g{i}")) for i in range(30)))
            assert statuses(flood) == {401: 10, 429: 20}
            assert (await attacker.post(MISSING, headers=bearer(TOKEN))).status_code == 429  # unchecked
            # the operator elsewhere: at once, by Bearer and by signing in
            assert (await operator.post(MISSING, headers=bearer(TOKEN))).status_code == 404
            csrf = csrf_of((await operator.get("/")).text)
            r = await operator.post(
                "/login", data={"csrf": csrf, "token": f" {TOKEN}\n", "next": "/"}, headers={"Origin": ORIGIN}
            )
            assert r.status_code == 303, r.text
            # the attacker cannot use the reserve, even with fresh requests
            more = await together(*(attacker.post(MISSING, headers=bearer(f"h{i}")) for i in range(10)))
            assert statuses(more) == {429: 10}
            # behind the attacker's address (a proxy), the right token waits for an allowance:
            # at most the Retry-After it was told, not behind the flood
            r = await attacker.post(MISSING, headers=bearer(TOKEN))
            assert r.status_code == 429
            clock.advance(float(r.headers["retry-after"]))
            assert (await attacker.post(MISSING, headers=bearer(TOKEN))).status_code == 404

    asyncio.run(main())


def test_on_a_loopback_bind_every_local_client_shares_the_limit(store: Store) -> None:
    """On the default bind every client is 127.0.0.1, so the reserve of an address that did not
    guess is no help: after a local process's ten wrong tokens the operator's right one is refused
    too (429), is told the limit is shared and when to come back, and is let through then.
    Checking it anyway would answer "right" (not 429) at any rate, which is what the limit stops."""
    clock = FakeClock()
    app = create_app(store, TOKEN, clock=clock)

    async def main() -> None:
        async with transport(app, "127.0.0.1") as guesser, transport(app, "127.0.0.1") as operator:
            wrong = await together(*(guesser.post(MISSING, headers=bearer(f"g{i}")) for i in range(10)))
            assert statuses(wrong) == {401: 10}
            r = await operator.post(MISSING, headers=bearer(TOKEN))
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.text == "refused: too many wrong tokens lately, from any client; try again in 1s\n"
            clock.advance(float(r.headers["retry-after"]))
            assert (await operator.post(MISSING, headers=bearer(TOKEN))).status_code == 404

    asyncio.run(main())


def test_a_signed_in_browser_behind_a_bearer_adding_proxy_uses_no_allowance(store: Store) -> None:
    """Its session decides; the proxy's own Bearer token is never checked, so acting many times
    neither uses the allowance nor marks the proxy's address as guessing."""
    clock = FakeClock()
    app = create_app(store, TOKEN, clock=clock)
    guesses = app.state.dashboard.guard.guesses

    async def main() -> None:
        async with transport(app, ATTACKER) as c:
            csrf = csrf_of((await c.get("/")).text)
            r = await c.post("/login", data={"csrf": csrf, "token": TOKEN}, headers={"Origin": ORIGIN})
            assert r.status_code == 303
            csrf = csrf_of((await c.get("/")).text)
            proxy = {"Origin": ORIGIN, **bearer("sso-token-not-ours")}
            for _ in range(25):
                assert (await c.post(MISSING, data={"csrf": csrf}, headers=proxy)).status_code == 404
            assert guesses.checked == 1 and guesses.throttled == 0  # the sign-in only

    asyncio.run(main())


# -- the limiter itself: exact counts, bounded memory ----------------------------------------------


def test_the_limiter_does_not_check_a_token_it_refuses() -> None:
    clock = FakeClock()
    limiter = GuessLimiter(clock, per_second=2.0, burst=3.0, spare_per_second=1.0, spare_burst=1.0)
    calls: list[str] = []

    def wrong() -> bool:
        calls.append("wrong")
        return False

    assert [limiter.check("a", wrong) for _ in range(3)] == [False] * 3
    with pytest.raises(Throttled) as e:
        limiter.check("a", wrong)
    assert e.value.retry_after == pytest.approx(0.5)
    assert limiter.check("b", wrong) is False  # b guessed nothing yet: the reserve
    with pytest.raises(Throttled) as e:
        limiter.check("c", lambda: True)  # the reserve is spent too: unchecked, even if right
    assert e.value.retry_after == pytest.approx(0.5)
    assert len(calls) == 4 and limiter.throttled == 2
    clock.advance(0.5)
    assert limiter.check("a", lambda: True) is True  # right: uses nothing, forgets a's guesses
    assert limiter.main.level == pytest.approx(1.0)
    assert "a" not in limiter._guessed


def test_the_limiter_remembers_a_bounded_number_of_addresses_for_a_bounded_time() -> None:
    clock = FakeClock()
    limiter = GuessLimiter(clock, per_second=1000.0, burst=1000.0, remember=60.0, max_addresses=100)
    for i in range(5000):
        clock.advance(0.001)
        assert limiter.check(f"10.0.{i // 256}.{i % 256}", lambda: False) is False
    assert len(limiter._guessed) == 100
    assert "10.0.19.135" in limiter._guessed and "10.0.0.1" not in limiter._guessed  # the newest kept
    clock.advance(61.0)
    limiter.check("other", lambda: True)
    assert len(limiter._guessed) == 0
