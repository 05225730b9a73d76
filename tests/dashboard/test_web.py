"""The dashboard's pages, filters, escaping and operator actions, on SQLite and PostgreSQL (OPS5)."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from stepwarden.dashboard.web import create_app

from .conftest import HOSTILE, Scene

with warnings.catch_warnings():  # Starlette would rather use httpx2; httpx is what we have
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")

TOKEN = "s3cret-operator-token"
ORIGIN = "http://testserver"


def make_client(scene: Scene, token: str | None = TOKEN, **kw: Any) -> TestClient:
    return TestClient(create_app(scene.store, token, **kw), follow_redirects=False)


@pytest.fixture
def client(scene: Scene) -> Iterator[TestClient]:
    with make_client(scene) as c:
        yield c


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert m, "the page carries no CSRF token"
    return m.group(1)


def sign_in(c: TestClient, token: str = TOKEN, name: str = "alice") -> str:
    """Sign in as an operator would; returns the CSRF token of the new session."""
    csrf = csrf_of(c.get("/").text)
    r = c.post(
        "/login",
        data={"csrf": csrf, "token": token, "name": name, "next": "/tasks"},
        headers={"Origin": ORIGIN},
    )
    assert r.status_code == 303, r.text
    assert r.headers["location"] == "/tasks"
    return csrf_of(c.get("/tasks").text)


# -- pages ------------------------------------------------------------------------------------------


def test_every_page_renders(scene: Scene, client: TestClient) -> None:
    tid = scene.errored("order-1")
    scene.submit("order-2")
    pages = {
        "/": "Overview",
        "/tasks": "order-2",
        f"/tasks/{tid}": "Timeline",
        "/alerts": "task_error",
        "/leases": "no lease yet",
        "/workers": "no live worker",
    }
    for path, text in pages.items():
        r = client.get(path)
        assert r.status_code == 200, (path, r.text[:500])
        assert text in r.text, path
        assert r.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert r.headers["x-frame-options"] == "DENY"
        # the live part polls a fragment of the same page
        assert 'hx-trigger="every 2.0s"' in r.text, path
        part = client.get(path + ("&" if "?" in path else "?") + "partial=1")
        assert part.status_code == 200 and "<html" not in part.text, path
    assert client.get("/static/htmx.min.js").status_code == 200
    assert '<script src="/static/htmx.min.js"' in client.get("/").text
    assert "https://" not in client.get("/").text  # nothing from a CDN


def test_task_timeline_shows_attempts_owners_and_errors(scene: Scene, client: TestClient) -> None:
    tid = scene.errored("order-1", error="inventory.reserve refused: SKU-1 is unknown")
    html = client.get(f"/tasks/{tid}").text
    assert 'data-state="error"' in html
    assert 'data-step="reserve"' in html
    assert "sched-1:1:aaaaaa" in html  # dispatched by
    assert "agent-1:2:bbbbbb" in html  # taken by and replied by
    assert "SKU-1 is unknown" in html
    assert "received" in html and "dispatched" in html  # events
    r = client.get("/tasks/999999")
    assert r.status_code == 404 and "no task 999999" in r.text
    assert client.get("/tasks/99999999999999999999999").status_code == 404


def test_task_timeline_shows_compensations(scene: Scene, client: TestClient) -> None:
    tid = scene.submit("order-c")
    scene.dispatch()
    scene.reply_all("inventory", "ok", result={"reserved": True})  # reserve completes, charge dispatched
    scene.reply_all("payments", "error", "payments.charge refused: card declined")  # on_error compensate
    html = client.get(f"/tasks/{tid}").text
    assert 'data-state="compensating"' in html
    assert "compensation" in html  # the undo attempt of reserve
    assert "card declined" in html


def test_filters_by_state_and_search(scene: Scene, client: TestClient) -> None:
    bad = scene.errored("order-bad")
    good = scene.submit("order-good")
    other = scene.submit("zzz-1")

    def ids(html: str) -> set[int]:
        return {int(x) for x in re.findall(r'data-task-id="(\d+)"', html)}

    assert ids(client.get("/tasks").text) == {bad, good, other}
    assert ids(client.get("/tasks?state=error").text) == {bad}
    assert ids(client.get("/tasks?state=pending").text) == {good, other}
    assert ids(client.get("/tasks", params={"q": "order-"}).text) == {bad, good}
    assert ids(client.get("/tasks", params={"q": "order-good"}).text) == {good}
    assert ids(client.get("/tasks", params={"q": str(other)}).text) == {other}
    assert ids(client.get("/tasks", params={"q": "order-", "state": "error"}).text) == {bad}
    assert ids(client.get("/tasks", params={"q": "nothing"}).text) == set()
    assert client.get("/tasks?state=bogus").status_code == 400
    assert client.get("/tasks", params={"q": "x" * 300}).status_code == 400
    assert client.get("/tasks", params={"before": "1; DROP TABLE tasks"}).status_code == 400
    # a search is a bound parameter, never SQL
    assert ids(client.get("/tasks", params={"q": "' OR 1=1 --"}).text) == set()
    assert scene.state(bad) == "error"


def test_paging_goes_to_older_tasks(scene: Scene, client: TestClient) -> None:
    made = [scene.submit(f"p-{i}") for i in range(55)]
    html = client.get("/tasks").text
    m = re.search(r'href="(/tasks\?before=\d+)"', html)
    assert m, "no link to older tasks"
    rest = client.get(m.group(1).replace("&amp;", "&")).text
    assert {int(x) for x in re.findall(r'data-task-id="(\d+)"', rest)} == set(made[:5])


def test_hostile_text_is_escaped_everywhere(scene: Scene, client: TestClient) -> None:
    tid = scene.errored(HOSTILE, error=f"refused {HOSTILE}")
    for path in ("/tasks", f"/tasks/{tid}", "/alerts", "/tasks?partial=1", f"/tasks/{tid}?partial=1"):
        html = client.get(path).text
        assert "<script>alert" not in html, path
        assert "<img src=x" not in html, path
        assert "&lt;script&gt;" in html or "&#34;" in html or "&lt;img" in html, path
    r = client.get("/tasks", params={"q": HOSTILE})
    assert r.status_code == 200 and "<img src=x" not in r.text and "&lt;img src=x" in r.text


# -- operator actions ------------------------------------------------------------------------------


def test_actions_disabled_without_a_configured_token(scene: Scene) -> None:
    tid = scene.errored("order-1")
    with make_client(scene, token=None) as c:
        page = c.get(f"/tasks/{tid}").text
        assert "read-only" in page and 'id="retry"' not in page
        r = c.post(f"/tasks/{tid}/retry", data={"csrf": "0" * 64}, headers={"Origin": ORIGIN})
        assert r.status_code == 403 and "disabled" in r.text
        r = c.post(f"/tasks/{tid}/retry", headers={"Authorization": "Bearer anything"})
        assert r.status_code == 403
    assert scene.state(tid) == "error"


def test_retry_refused_without_signing_in(scene: Scene, client: TestClient) -> None:
    tid = scene.errored("order-1")
    page = client.get(f"/tasks/{tid}").text
    assert 'id="retry"' in page
    r = client.post(f"/tasks/{tid}/retry", data={"csrf": csrf_of(page)}, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and "operator token is required" in r.text
    # this client has a dashboard session (it read the page): the form's checks decide, not a
    # Bearer header that is not ours (a proxy's); a script without a session hears 401 (below)
    r = client.post(f"/tasks/{tid}/retry", headers={"Authorization": "Bearer wrong-token", "Origin": ORIGIN})
    assert r.status_code == 403 and "CSRF" in r.text
    assert scene.state(tid) == "error"


def test_wrong_token_does_not_sign_in(scene: Scene, client: TestClient) -> None:
    csrf = csrf_of(client.get("/").text)
    r = client.post("/login", data={"csrf": csrf, "token": "guess", "next": "/"}, headers={"Origin": ORIGIN})
    assert r.status_code == 403 and "wrong token" in r.text
    assert "sw_auth" not in r.cookies
    r = client.post("/login", data={"token": TOKEN}, headers={"Origin": ORIGIN})  # no CSRF token
    assert r.status_code == 403
    r = client.post("/login", data={"csrf": csrf, "token": TOKEN}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403


def test_retry_refused_with_bad_csrf_or_origin(scene: Scene, client: TestClient) -> None:
    tid = scene.errored("order-1")
    csrf = sign_in(client)
    url = f"/tasks/{tid}/retry"
    cases = [
        ({"csrf": "0" * 64}, {"Origin": ORIGIN}, "CSRF"),
        ({}, {"Origin": ORIGIN}, "CSRF"),
        ({"csrf": csrf}, {"Origin": "http://evil.example"}, "cross-origin"),
        ({"csrf": csrf}, {"Origin": "null"}, "cross-origin"),
        ({"csrf": csrf}, {"Referer": "http://evil.example/page"}, "cross-origin"),
        ({"csrf": csrf}, {}, "no Origin"),
    ]
    for form, headers, why in cases:
        r = client.post(url, data=form, headers=headers)
        assert r.status_code == 403, (form, headers, r.text)
        assert why in r.text, (why, r.text)
    # a CSRF token of another session is worthless here
    with make_client(scene) as other:
        foreign = sign_in(other)
    r = client.post(url, data={"csrf": foreign}, headers={"Origin": ORIGIN})
    assert r.status_code == 403
    assert scene.state(tid) == "error"


def test_retry_accepted_with_token_csrf_and_origin(scene: Scene, client: TestClient) -> None:
    tid = scene.errored("order-1")
    csrf = sign_in(client, name="alice")
    assert "signed in as" in client.get("/").text
    r = client.post(f"/tasks/{tid}/retry", data={"csrf": csrf, "step": ""}, headers={"Origin": ORIGIN})
    assert r.status_code == 200, r.text
    assert f"task {tid} is pending again" in r.text
    assert scene.state(tid) == "pending"
    html = client.get(f"/tasks/{tid}").text
    assert "retried" in html and "dashboard:alice" in html
    # a Referer of our own origin does as well as an Origin
    r = client.post(f"/tasks/{tid}/retry", data={"csrf": csrf}, headers={"Referer": f"{ORIGIN}/tasks/{tid}"})
    assert r.status_code == 409 and "only error tasks can be retried" in r.text
    assert (
        client.post("/tasks/424242/retry", data={"csrf": csrf}, headers={"Origin": ORIGIN}).status_code == 404
    )


def test_htmx_actions_answer_with_a_fragment(scene: Scene, client: TestClient) -> None:
    tid = scene.errored("order-1")
    csrf = sign_in(client)
    r = client.post(
        f"/tasks/{tid}/retry", data={"csrf": csrf}, headers={"Origin": ORIGIN, "HX-Request": "true"}
    )
    assert r.status_code == 200 and "<html" not in r.text and 'class="flash ok"' in r.text
    r = client.post(
        f"/tasks/{tid}/retry", data={"csrf": "bad"}, headers={"Origin": ORIGIN, "HX-Request": "true"}
    )
    assert r.status_code == 403 and 'class="flash refused"' in r.text


def test_cancel_and_acknowledge(scene: Scene, client: TestClient) -> None:
    tid = scene.errored("order-1")
    pending = scene.submit("order-2")
    csrf = sign_in(client, name="bob")
    r = client.post(f"/tasks/{pending}/cancel", data={"csrf": csrf}, headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "cancel requested" in r.text
    assert scene.state(pending) == "compensating"
    alerts = client.get("/alerts").text
    m = re.search(r'data-alert-id="(\d+)"', alerts)
    assert m and "Acknowledge" in alerts
    aid = int(m.group(1))
    r = client.post(f"/alerts/{aid}/ack", data={"csrf": csrf}, headers={"Origin": ORIGIN})
    assert r.status_code == 200 and f"alert {aid} acknowledged" in r.text
    row = scene.store.transact_sync(
        lambda tx: tx.sql("SELECT acked_at, acked_by FROM alerts WHERE id = ?", (aid,))
    )[0]
    assert row["acked_at"] is not None and row["acked_by"] == "dashboard:bob"
    r = client.post(f"/alerts/{aid}/ack", data={"csrf": csrf}, headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "already acknowledged" in r.text
    # one alert_acked event on the task, as an acknowledgement from the CLI records (none was)
    acked = scene.store.transact_sync(
        lambda tx: tx.sql("SELECT task_id, actor FROM events WHERE kind = 'alert_acked'")
    )
    assert acked == [{"task_id": tid, "actor": "dashboard:bob"}]
    assert client.post("/alerts/777/ack", data={"csrf": csrf}, headers={"Origin": ORIGIN}).status_code == 404
    assert "by dashboard:bob" in client.get("/alerts").text
    assert str(aid) not in re.findall(r'data-alert-id="(\d+)"', client.get("/alerts?unacked=1").text)
    assert scene.state(tid) == "error"


def test_ack_refused_without_token(scene: Scene, client: TestClient) -> None:
    scene.errored("order-1")
    html = client.get("/alerts").text
    aid = re.findall(r'data-alert-id="(\d+)"', html)[0]
    r = client.post(f"/alerts/{aid}/ack", data={"csrf": csrf_of(html)}, headers={"Origin": ORIGIN})
    assert r.status_code == 401
    row = scene.store.transact_sync(
        lambda tx: tx.sql("SELECT acked_at FROM alerts WHERE id = ?", (int(aid),))
    )[0]
    assert row["acked_at"] is None


def test_bearer_token_acts_without_a_session(scene: Scene, client: TestClient) -> None:
    tid = scene.errored("order-1")
    r = client.post(f"/tasks/{tid}/retry", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain") and r.text == f"task {tid} is pending again\n"
    assert scene.state(tid) == "pending"
    r = client.post("/tasks/999999/cancel", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and r.text.count("\n") == 1 and "999999" in r.text, r.text


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/tasks/9999999999999999999/cancel", "no task 9999999999999999999"),
        ("/tasks/9999999999999999999/retry", "no task 9999999999999999999"),
        ("/alerts/9999999999999999999/ack", "no alert 9999999999999999999"),
    ],
)
def test_an_action_on_an_id_beyond_the_store_names_that_id(
    scene: Scene, client: TestClient, path: str, says: str
) -> None:
    """It said `no task 0`: the id the path gave was out of the store's range and became 0."""
    r = client.post(path, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and r.text == says + "\n", r.text
    assert client.post(path).status_code in (401, 403), "a refusal comes before the look-up"


def test_a_signed_in_browser_behind_a_proxy_that_adds_its_own_bearer_header_can_act(
    scene: Scene, client: TestClient
) -> None:
    """An SSO proxy (oauth2-proxy, say) may add `Authorization: Bearer <its token>` to every
    request: the operator's session and form decide, not that header."""
    tid = scene.errored("order-1")
    csrf = sign_in(client)
    proxy = {"Authorization": "Bearer sso-token-not-ours", "Origin": ORIGIN}
    r = client.post(f"/tasks/{tid}/retry", data={"csrf": csrf}, headers=proxy)
    assert r.status_code in (200, 303), r.text
    assert scene.state(tid) == "pending"


def test_a_script_with_a_wrong_bearer_token_hears_401_and_why(scene: Scene, client: TestClient) -> None:
    """Not "no Origin" or "no CSRF token", which a script cannot act on: the token is wrong."""
    tid = scene.errored("order-1")
    r = client.post(f"/tasks/{tid}/retry", headers={"Authorization": "Bearer typo"})
    assert r.status_code == 401, r.text
    assert r.text == "refused: wrong bearer token\n"
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert scene.state(tid) == "error"


def test_sign_out_ends_the_session(scene: Scene, client: TestClient) -> None:
    tid = scene.errored("order-1")
    csrf = sign_in(client)
    r = client.post("/logout", data={"csrf": csrf, "next": "/"}, headers={"Origin": ORIGIN})
    assert r.status_code == 303
    page = client.get(f"/tasks/{tid}").text
    assert "signed in as" not in page
    r = client.post(f"/tasks/{tid}/retry", data={"csrf": csrf_of(page)}, headers={"Origin": ORIGIN})
    assert r.status_code == 401


def test_a_copy_of_the_cookies_of_a_signed_out_session_acts_no_more(scene: Scene, client: TestClient) -> None:
    """Found by review: after sign-out, the session's cookies replayed (another tab, a copy in a
    proxy's log, a shared machine) still signed in, for the rest of the auth cookie's 12 hours."""
    tid = scene.errored("order-1")
    csrf = sign_in(client)
    copied = {k: v for k, v in client.cookies.items()}
    r = client.post("/logout", data={"csrf": csrf, "next": "/"}, headers={"Origin": ORIGIN})
    assert r.status_code == 303
    client.cookies.clear()
    for k, v in copied.items():
        client.cookies.set(k, v)
    page = client.get(f"/tasks/{tid}").text
    assert "signed in as" not in page
    r = client.post(f"/tasks/{tid}/retry", data={"csrf": csrf}, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and scene.state(tid) == "error"


def test_login_redirect_stays_on_this_site(scene: Scene, client: TestClient) -> None:
    csrf = csrf_of(client.get("/").text)
    for target in ("//evil.example/", "https://evil.example/", "/\\evil.example"):
        r = client.post(
            "/login", data={"csrf": csrf, "token": TOKEN, "next": target}, headers={"Origin": ORIGIN}
        )
        assert r.status_code == 303 and r.headers["location"] == "/", target
        csrf = csrf_of(client.get("/").text)


def test_loopback_dashboard_refuses_foreign_host_names(scene: Scene) -> None:
    from stepwarden.dashboard.hosts import LOOPBACK_NAMES

    with TestClient(
        create_app(scene.store, TOKEN, allowed_hosts=LOOPBACK_NAMES), base_url="http://127.0.0.1:8080"
    ) as c:
        assert c.get("/").status_code == 200
        assert c.get("/", headers={"Host": "localhost:8080"}).status_code == 200
        assert c.get("/", headers={"Host": "[::1]:8080"}).status_code == 200
        assert c.get("/", headers={"Host": "rebind.evil.example:8080"}).status_code == 400
        assert c.get("/", headers={"Host": "127.0.0.1.evil.example"}).status_code == 400


def test_hostile_cookies_and_csrf_values_are_refused_not_a_server_error(scene: Scene) -> None:
    """hmac.compare_digest raises TypeError on a str with non-ASCII characters: an auth cookie like
    that (which any page on this host can set) made every page a 500, and such a CSRF value a 503."""
    tid = scene.errored("order-1")
    app = create_app(scene.store, TOKEN)
    with TestClient(app, follow_redirects=False, raise_server_exceptions=False) as c:
        sign_in(c)
        sid = c.cookies.get("sw_session") or ""
        c.cookies.clear()  # sent by hand from here: a cookie jar refuses non-ASCII values
        poisoned = f"sw_session={sid}; sw_auth=alice!9999999999!".encode() + b"\xe9\xe9"
        page = c.get("/", headers={"Cookie": poisoned})
        assert page.status_code == 200 and "Sign in" in page.text  # signed out, not broken
        session = f"sw_session={sid}".encode()
        r = c.post(
            f"/tasks/{tid}/retry",
            content=b"csrf=" + b"%C3%A9" * 64,
            headers={
                "Cookie": session,
                "Origin": ORIGIN,
                "Content-Type": "application/x-www-form-urlencoded",
            },
        )
        assert r.status_code == 403 and "CSRF" in r.text
        r = c.post(
            "/login",
            content=b"csrf=%C3%A9&token=" + TOKEN.encode(),
            headers={
                "Cookie": session,
                "Origin": ORIGIN,
                "Content-Type": "application/x-www-form-urlencoded",
            },
        )
        assert r.status_code == 403


def test_an_id_too_long_for_any_row_is_not_found(scene: Scene, client: TestClient) -> None:
    """Starlette's int path convertor took any length, and int() of 4,300+ digits raised while
    routing: a 503 naming the store, with the whole path in the log."""
    long = "9" * 5000
    assert client.get(f"/tasks/{long}").status_code == 404
    assert client.post(f"/tasks/{long}/retry", headers={"Origin": ORIGIN}).status_code == 404
    assert client.get("/tasks/" + "9" * 19).status_code == 404  # the longest id the route takes


def test_signing_in_from_a_refused_action_goes_back_to_its_page(scene: Scene, client: TestClient) -> None:
    """The page a refused form post shows has the sign-in form; its ``next`` was the action's own
    path, which only answers POST: signing in landed on a 405."""
    tid = scene.errored("order-1")
    csrf = csrf_of(client.get("/").text)
    refused = client.post(f"/tasks/{tid}/retry", data={"csrf": csrf}, headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert f'name="next" value="/tasks/{tid}"' in refused.text
    r = client.post(
        "/login",
        data={"csrf": csrf_of(refused.text), "token": TOKEN, "next": f"/tasks/{tid}"},
        headers={"Origin": ORIGIN},
    )
    assert r.status_code == 303 and client.get(r.headers["location"]).status_code == 200


def test_behind_a_tls_proxy_the_public_origin_may_act(scene: Scene) -> None:
    """The proxy speaks https to the browser and http to the dashboard, so the pages' Origin is
    not the dashboard's own: without --public-origin every sign-in and action was refused. The
    cookies are Secure then, and a browser sends them only over https: here they are sent by hand,
    as the browser would through the proxy."""
    from http.cookies import SimpleCookie

    tid = scene.errored("order-1")
    proxy = "https://ops.example.com"

    def cookies_of(r: Any) -> dict[str, str]:
        jar: SimpleCookie = SimpleCookie()
        for header in r.headers.get_list("set-cookie"):
            assert "secure" in header.lower(), header
            jar.load(header)
        return {k: m.value for k, m in jar.items()}

    with make_client(scene, public_origin=proxy) as c:
        first = c.get("/")
        jar = cookies_of(first)
        sent = {"Origin": proxy, "Cookie": "; ".join(f"{k}={v}" for k, v in jar.items())}
        r = c.post("/login", data={"csrf": csrf_of(first.text), "token": TOKEN, "next": "/"}, headers=sent)
        assert r.status_code == 303, r.text
        jar.update(cookies_of(r))
        sent["Cookie"] = "; ".join(f"{k}={v}" for k, v in jar.items())
        csrf = csrf_of(c.get("/", headers={"Cookie": sent["Cookie"]}).text)
        assert c.post(f"/tasks/{tid}/retry", data={"csrf": csrf}, headers=sent).status_code == 200
        foreign = {**sent, "Origin": "https://evil.example"}
        assert c.post(f"/tasks/{tid}/cancel", data={"csrf": csrf}, headers=foreign).status_code == 403
    with make_client(scene) as c:  # without it, the proxy's origin is another site's
        csrf = csrf_of(c.get("/").text)
        r = c.post("/login", data={"csrf": csrf, "token": TOKEN}, headers={"Origin": proxy})
        assert r.status_code == 403


def test_operator_names_are_checked_and_recorded(scene: Scene, client: TestClient) -> None:
    tid = scene.errored("order-1")
    csrf = csrf_of(client.get("/").text)
    r = client.post(
        "/login", data={"csrf": csrf, "token": TOKEN, "name": "<b>x</b>"}, headers={"Origin": ORIGIN}
    )
    assert r.status_code == 400 and "<b>" not in r.text
    csrf = sign_in(client, name="ops.oncall@example")
    assert "dashboard:ops.oncall@example" in client.get("/").text
    r = client.post(f"/tasks/{tid}/cancel", data={"csrf": csrf}, headers={"Origin": ORIGIN})
    assert r.status_code == 200
    events = scene.store.transact_sync(
        lambda tx: tx.sql("SELECT actor FROM events WHERE task_id = ? AND kind = 'cancel_requested'", (tid,))
    )
    assert [e["actor"] for e in events] == ["dashboard:ops.oncall@example"]


def test_store_trouble_is_a_clear_503(scene: Scene, monkeypatch: pytest.MonkeyPatch) -> None:
    from stepwarden.dashboard import data

    def broken(tx: Any) -> Any:
        raise RuntimeError("connection refused")

    monkeypatch.setattr(data, "overview", broken)
    with TestClient(create_app(scene.store, TOKEN), raise_server_exceptions=False) as c:
        r = c.get("/")
        assert r.status_code == 503 and "could not be read" in r.text
        # Starlette runs the error handler outside the middleware: the headers are still there.
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
        assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
        assert c.get("/tasks").status_code == 200


def test_sqlite_pages_and_metrics_do_not_wait_for_a_writer(tmp_path: Path) -> None:
    """Reads run in a deferred transaction: while a worker holds SQLite's write lock (here, for
    as long as the test likes), every page still answers at once from the last committed state.
    (PostgreSQL's readers never wait for writers.)"""
    import sqlite3
    import time

    from stepwarden.store import open_store
    from stepwarden.store.core import _register

    from .conftest import WORKFLOW

    path = tmp_path / "pages.db"
    store = open_store(f"sqlite:///{path}")
    store.transact_sync(_register, [WORKFLOW], "dashboard-test")
    scene = Scene(store, f"sqlite:///{path}")
    tid = scene.submit("order-1")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("UPDATE tasks SET correlation_id = 'uncommitted' WHERE id = ?", (tid,))
    try:
        with make_client(scene) as client:
            for page in ("/", "/tasks", f"/tasks/{tid}", "/alerts", "/leases", "/workers", "/metrics"):
                t0 = time.monotonic()
                r = client.get(page)
                assert r.status_code == 200, (page, r.status_code)
                assert time.monotonic() - t0 < 5, f"{page} waited for the write lock"
            assert "order-1" in client.get(f"/tasks/{tid}").text
            assert "uncommitted" not in client.get("/tasks").text
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        store.close()


def test_a_store_that_fails_is_a_503_answered_in_full_and_no_traceback(
    scene: Scene, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review (OPS5, OPS6): the store's failure was answered by an exception handler in
    Starlette's outermost middleware, which re-raises: uvicorn logged a 64-line traceback per
    request (plain text among JSON lines), and here the test client re-raised it. A script
    (Bearer) got the HTML page, not its one line."""
    import logging

    from stepwarden.errors import StoreError

    tid = scene.errored("order-1")
    client = TestClient(create_app(scene.store, TOKEN), follow_redirects=False)  # re-raises what escapes

    async def down(*a: Any, **k: Any) -> Any:
        raise StoreError("the store is down")

    monkeypatch.setattr(scene.store, "transact", down)
    with caplog.at_level(logging.WARNING, logger="stepwarden.dashboard"):
        page = client.get("/tasks")
        script = TestClient(create_app(scene.store, TOKEN)).post(  # no session cookie: a script
            f"/tasks/{tid}/retry", headers={"Authorization": f"Bearer {TOKEN}"}
        )
    assert page.status_code == 503 and "the store could not be read or written" in page.text
    assert page.headers["x-frame-options"] == "DENY"  # through the other middleware
    assert script.status_code == 503 and script.headers["content-type"].startswith("text/plain")
    assert script.text.count("\n") == 1 and "StoreError" in script.text, script.text
    assert [r.getMessage().split(" failed")[0] for r in caplog.records] == [
        "dashboard: GET /tasks",
        f"dashboard: POST /tasks/{tid}/retry",
    ]


def test_a_task_with_a_long_history_shows_its_newest_events_and_says_what_is_left_out(
    scene: Scene, client: TestClient
) -> None:
    """Found by review (OPS5): a task's page had no bound and is polled whole: a step retried every
    minute for days (30,000 events) made it 13 MB, re-sent every 2 s per open tab."""
    from stepwarden.dashboard.data import TASK_ROWS

    tid = scene.errored("order-1")
    scene.store.transact_sync(
        lambda tx: tx.sql(
            "INSERT INTO events (task_id, kind, detail, at) SELECT ?, 'retry_scheduled', NULL, at FROM events"
            " WHERE task_id = ?",
            (tid, tid),
        )
    )
    for _ in range(8):  # doubling: a few hundred events
        scene.store.transact_sync(
            lambda tx: tx.sql(
                "INSERT INTO events (task_id, kind, detail, at) SELECT task_id, kind, detail, at FROM events"
                " WHERE task_id = ?",
                (tid,),
            )
        )
    total = scene.store.transact_sync(
        lambda tx: tx.sql("SELECT COUNT(*) AS n FROM events WHERE task_id = ?", (tid,))
    )[0]["n"]
    assert total > TASK_ROWS
    page = client.get(f"/tasks/{tid}")
    assert page.status_code == 200
    assert page.text.count('<li><span class="small">') <= TASK_ROWS, "more events shown than the bound"
    assert f"{total - TASK_ROWS} older event(s)" in page.text and f"task show {tid} --json" in page.text
