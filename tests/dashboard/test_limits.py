"""What anyone who reaches the port can make the dashboard hold: request bodies bounded (413)
before any handler reads them, forms only urlencoded and of a few fields, a client that leaves
mid-body kept out of the error log, and a bound on requests served at once.

Every form handler reads its form before it can check who is asking (the CSRF token is in it).
Unbounded, 300 fields of 1 MB to ``/tasks/1/cancel`` made the process hold ~300 MB for a 403, and a
multipart file part was spooled to disk first. The tests drive the ASGI application with a body
that records how much of it was read, as a server would hand it over: a refusal must come
before the body is read, not after."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from acceptance.helpers import Procs, clean_env, wait_until
from stepwarden.dashboard.command import TIMEOUT_KEEP_ALIVE
from stepwarden.dashboard.web import create_app
from stepwarden.store import Store, open_store

from .command_harness import invoke_dashboard, record_serving

TOKEN = "limits-token-0123456789"
KiB = 1024
MiB = 1024 * KiB
MAX_BODY = 64 * KiB  # the documented limits (docs/dashboard.md)
FORM_MAX_FIELDS = 16
# Every handler that reads a form: sign in and out, and the three operator actions.
FORM_PATHS = ["/login", "/logout", "/tasks/1/retry", "/tasks/1/cancel", "/alerts/1/ack"]
URLENCODED = "application/x-www-form-urlencoded"


@dataclass
class Exchange:
    """One request as the application saw it: its answer, and how much of the body it read."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    read: int = 0  # body bytes the application took
    sent: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.body.decode()


def call(
    app: Any,
    path: str,
    chunks: Iterable[bytes],
    headers: dict[str, str],
    *,
    length: int | None = None,
    leave: bool = False,
    method: str = "POST",
) -> Exchange:
    """``method`` (POST) ``path`` with a body handed over chunk by chunk as the application asks
    for it (lazily: a body it does not ask for is never made). ``length`` is sent as
    Content-Length; ``leave``: the client goes away after the last chunk instead of ending the body."""
    seen = Exchange()
    pending = iter(chunks)
    ended = False
    raw = [(k.lower().encode(), v.encode()) for k, v in {"Host": "testserver", **headers}.items()]
    if length is not None:
        raw.append((b"content-length", str(length).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 40000),
        "server": ("testserver", 80),
    }

    async def receive() -> dict[str, Any]:
        nonlocal ended
        if not ended:
            chunk = next(pending, None)
            if chunk is not None:
                seen.read += len(chunk)
                return {"type": "http.request", "body": chunk, "more_body": True}
            ended = True
            if not leave:
                return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        seen.sent.append(message)
        if message["type"] == "http.response.start":
            seen.status = message["status"]
            seen.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            seen.body += message.get("body", b"")

    asyncio.run(app(scope, receive, send))
    return seen


def big_form(total: int, chunk: int = 64 * KiB) -> Iterator[bytes]:
    """A urlencoded form of about ``total`` bytes in ``chunk``-byte pieces: fields of 512 KiB, each
    under the 1 MB Starlette allows a field, as the review's 300 fields of 1 MB were."""
    yield b"csrf=x"
    per_field = 512 * KiB // chunk
    for i in range(total // chunk):
        yield (b"&f%d=" % i if i % per_field == 0 else b"") + b"x" * chunk


def multipart(file_bytes: int, boundary: str = "b0undary") -> Iterator[bytes]:
    """``curl -F csrf=x -F f=@FILE`` with a file of ``file_bytes`` bytes, in 64 KiB pieces."""
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="csrf"\r\n\r\nx\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="f"; filename="big.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    for _ in range(file_bytes // (64 * KiB)):
        yield b"\0" * (64 * KiB)
    yield f"\r\n--{boundary}--\r\n".encode()


# -- bodies over the limit ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", FORM_PATHS)
def test_a_body_announced_over_the_limit_is_refused_before_a_byte_is_read(store: Store, path: str) -> None:
    """8 MiB announced by Content-Length, unauthenticated: 413 at once, nothing read (it was
    read whole and answered 403)."""
    app = create_app(store, TOKEN)
    seen = call(
        app,
        path,
        big_form(8 * MiB),
        {"Content-Type": URLENCODED, "Origin": "http://testserver"},
        length=8 * MiB + 100,
    )
    assert seen.status == 413, (seen.status, seen.text)
    assert seen.text == "refused: the request body is larger than 64 KiB\n"
    assert seen.read == 0
    assert seen.headers["connection"] == "close"  # the rest is not read: the connection is done
    assert "default-src 'none'" in seen.headers["content-security-policy"]


@pytest.mark.parametrize("path", FORM_PATHS)
def test_a_chunked_body_is_cut_off_at_the_limit(store: Store, path: str) -> None:
    """No Content-Length (a chunked upload): counted as it is read, and refused at the chunk that
    crosses the limit; the 8 MiB behind it are never asked for."""
    app = create_app(store, TOKEN)
    seen = call(app, path, big_form(8 * MiB, chunk=16 * KiB), {"Content-Type": URLENCODED})
    assert seen.status == 413, (seen.status, seen.text)
    assert MAX_BODY < seen.read <= MAX_BODY + 16 * KiB + 100
    assert seen.headers["connection"] == "close"


def test_a_script_over_the_limit_hears_413_even_with_the_right_token(store: Store) -> None:
    """The limit comes before any check: the right Bearer token does not lift it."""
    app = create_app(store, TOKEN)
    seen = call(
        app,
        "/tasks/1/retry",
        big_form(1 * MiB),
        {"Content-Type": URLENCODED, "Authorization": f"Bearer {TOKEN}"},
    )
    assert seen.status == 413 and seen.read <= MAX_BODY + 64 * KiB + 100


def test_forms_within_the_limit_are_read_as_before(store: Store) -> None:
    """A small body in several chunks, as a script may send it, reaches the action whole."""
    app = create_app(store, TOKEN)
    chunks = [b"ste", b"p=charge", b"&next=%2Ftasks"]
    seen = call(
        app, "/tasks/424242/retry", chunks, {"Content-Type": URLENCODED, "Authorization": f"Bearer {TOKEN}"}
    )
    assert seen.status == 404, seen.text  # authorised; there is no such task
    assert seen.read == sum(map(len, chunks))


# -- the limits' exact edges -----------------------------------------------------------------------------


def sized_form(total: int) -> bytes:
    """A one-field form (``step=xxx...``) of exactly ``total`` bytes."""
    return b"step=" + b"x" * (total - len(b"step="))


@pytest.mark.parametrize("announced", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize(("size", "refused"), [(MAX_BODY, False), (MAX_BODY + 1, True)], ids=["at", "over"])
def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_refused(
    store: Store, announced: bool, size: int, refused: bool
) -> None:
    """The limit is "at most 64 KiB", by Content-Length and by counting alike: a body of 65,536
    bytes reaches the action whole (404: authorised, no such task), one of 65,537 is a 413 (unread
    when announced). A ``>=`` for ``>`` in either check refuses the first."""
    app = create_app(store, TOKEN)
    body = sized_form(size)
    chunks = [body[i : i + 16 * KiB] for i in range(0, len(body), 16 * KiB)]  # the last: 1 byte over
    seen = call(
        app,
        "/tasks/424242/retry",
        chunks,
        {"Content-Type": URLENCODED, "Authorization": f"Bearer {TOKEN}"},
        length=size if announced else None,
    )
    if refused:
        assert seen.status == 413, (seen.status, seen.text)
        assert seen.read == (0 if announced else size)
    else:
        assert seen.status == 404, (seen.status, seen.text)
        assert seen.read == size


@pytest.mark.parametrize(("fields", "status"), [(FORM_MAX_FIELDS, 404), (FORM_MAX_FIELDS + 1, 400)])
def test_a_form_of_exactly_the_field_limit_is_read_and_one_field_more_is_refused(
    store: Store, fields: int, status: int
) -> None:
    """16 fields reach the action (404: authorised, no such task); 17 are a 400 that names the limit."""
    app = create_app(store, TOKEN)
    body = "&".join(["step=charge", *(f"f{i}=x" for i in range(fields - 1))]).encode()
    seen = call(
        app,
        "/tasks/424242/retry",
        [body],
        {"Content-Type": URLENCODED, "Authorization": f"Bearer {TOKEN}"},
    )
    assert seen.status == status, (seen.status, seen.text)
    if status == 400:
        assert f"Maximum number of fields is {FORM_MAX_FIELDS}" in seen.text


def test_a_get_that_announces_a_large_body_is_refused_unread(store: Store) -> None:
    """The limit is on every request, not only on the forms' paths: a GET is no way round it."""
    app = create_app(store, TOKEN)
    seen = call(app, "/", big_form(8 * MiB), {}, length=8 * MiB, method="GET")
    assert seen.status == 413, (seen.status, seen.text)
    assert seen.read == 0 and seen.headers["connection"] == "close"


def test_a_chunked_body_on_a_get_is_never_read(store: Store) -> None:
    """A page reads no body: one sent with a GET (8 MiB, chunked) is never asked for, and the
    page is served as without it."""
    app = create_app(store, TOKEN)
    seen = call(app, "/", big_form(8 * MiB), {"Transfer-Encoding": "chunked"}, method="GET")
    assert seen.status == 200, (seen.status, seen.text[:200])
    assert seen.read == 0


# -- what a form may be --------------------------------------------------------------------------------


@pytest.mark.parametrize("announced", [True, False], ids=["content-length", "chunked"])
def test_a_multipart_upload_is_refused_unread_and_nothing_is_spooled(
    store: Store, monkeypatch: pytest.MonkeyPatch, announced: bool
) -> None:
    """``curl -F f=@big`` to an action: its file part was spooled to a temporary file (on disk past
    1 MB) before the 403. Now nothing of it is read: 413 when its length is announced, else 415
    (the dashboard's forms are urlencoded), and no temporary file is ever made for it."""
    import starlette.formparsers

    files: list[str] = []
    spooled = tempfile.SpooledTemporaryFile  # what starlette.formparsers imported by name
    on_disk = tempfile.TemporaryFile

    def spool(*args: Any, **kw: Any) -> Any:
        files.append("spooled")
        return spooled(*args, **kw)

    def disk(*args: Any, **kw: Any) -> Any:
        files.append("on disk")
        return on_disk(*args, **kw)

    monkeypatch.setattr(starlette.formparsers, "SpooledTemporaryFile", spool)
    monkeypatch.setattr(tempfile, "TemporaryFile", disk)
    app = create_app(store, TOKEN)
    size = 2 * MiB
    seen = call(
        app,
        "/tasks/1/cancel",
        multipart(size),
        {"Content-Type": "multipart/form-data; boundary=b0undary", "Origin": "http://testserver"},
        length=size + 300 if announced else None,
    )
    assert seen.status == (413 if announced else 415), (seen.status, seen.text)
    if not announced:
        assert "application/x-www-form-urlencoded" in seen.text and "curl -d" in seen.text
    assert seen.read == 0
    assert files == []


def test_a_small_multipart_form_is_refused_and_says_what_to_send(store: Store) -> None:
    app = create_app(store, TOKEN)
    body = [
        b'--b\r\nContent-Disposition: form-data; name="step"\r\n\r\ncharge\r\n--b--\r\n',
    ]
    seen = call(
        app,
        "/tasks/424242/retry",
        body,
        {"Content-Type": "multipart/form-data; boundary=b", "Authorization": f"Bearer {TOKEN}"},
    )
    # a script's answer: one line of text
    assert seen.status == 415 and seen.text.startswith("refused: send the form as") and seen.read == 0
    assert seen.text.endswith("\n") and seen.text.count("\n") == 1


@pytest.mark.parametrize("path", FORM_PATHS)
def test_a_form_of_many_fields_is_refused(store: Store, path: str) -> None:
    """300 tiny fields fit in the body limit; no form here has more than a handful: 400, and the
    fields beyond the limit are not kept."""
    app = create_app(store, TOKEN)
    body = "&".join(f"f{i}=x" for i in range(300)).encode()
    seen = call(app, path, [body], {"Content-Type": URLENCODED, "Origin": "http://testserver"})
    assert seen.status == 400, (seen.status, seen.text[:200])
    assert f"Maximum number of fields is {FORM_MAX_FIELDS}" in seen.text


# -- a client that goes away -----------------------------------------------------------------------


@pytest.mark.parametrize("path", FORM_PATHS)
def test_a_client_that_leaves_mid_body_is_no_application_error(
    store: Store, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The form reader raises ClientDisconnect; it left the application, which uvicorn logs as
    "Exception in ASGI application" with a traceback (and the dashboard as a failed request).
    Now there is no one to answer, nothing is raised, and nothing is logged above debug."""
    app = create_app(store, TOKEN)
    with caplog.at_level(logging.DEBUG):
        seen = call(
            app, path, [b"csrf=abc&na"], {"Content-Type": URLENCODED}, length=1000, leave=True
        )  # raised before
    assert seen.sent == []
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []
    assert any("left before its body was read" in r.getMessage() for r in caplog.records)


def _start(
    procs: Procs, tmp_path: Path, *extra: str, group: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], str, int]:
    """The real command in a subprocess (``python -m stepwarden.dashboard``, with ``group``'s
    options before the command's); its host and port."""
    url = f"sqlite:///{tmp_path / 'served.db'}"
    open_store(url).close()
    module = "stepwarden" if group else "stepwarden.dashboard"  # the logging options are the CLI's
    cmd = [sys.executable, "-m", module, "--db", url, *group, "dashboard", "--port", "0"]
    cmd += extra
    p = procs.start(cmd, "dashboard", clean_env(STEPWARDEN_DASHBOARD_TOKEN=TOKEN))

    def listening() -> str | None:
        if p.poll() is not None:
            pytest.fail(f"the dashboard exited {p.returncode}:\n{procs.log_of(p)}")
        for line in procs.log_of(p).splitlines():
            if "dashboard on http://" in line:
                return line.split("dashboard on http://", 1)[1].split("/", 1)[0]
        return None

    address = wait_until(listening, 30, "the dashboard to say where it listens", 0.05)
    host, port = address.rsplit(":", 1)

    def answering() -> bool:  # the line comes just before uvicorn starts accepting
        try:
            return httpx.get(f"http://{address}/", timeout=10).status_code == 200
        except httpx.ConnectError:
            return False

    wait_until(answering, 30, "the dashboard to answer", 0.05)
    return p, host, int(port)


def _open_body(host: str, port: int) -> socket.socket:
    """A connection that sent a request's headers and part of its 1,000-byte body, and waits."""
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(
        b"POST /tasks/1/cancel HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 1000\r\n\r\ncsrf=abc&na"
    )
    return s


def _stop(procs: Procs, p: subprocess.Popen[bytes]) -> str:
    """SIGTERM, by pid: uvicorn ends once every request it holds has ended (and then lets the
    signal end the process, as it would have without it); its whole log."""
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) in (0, -signal.SIGTERM), procs.log_of(p)
    return procs.log_of(p)


def test_the_served_dashboard_logs_no_traceback_for_a_client_that_leaves(tmp_path: Path) -> None:
    """End to end: uvicorn logged `ERROR: Exception in ASGI application` and a ClientDisconnect
    traceback for every client that closed its connection mid-body."""
    procs = Procs(tmp_path)
    try:
        p, host, port = _start(procs, tmp_path)
        for _ in range(3):
            _open_body(host, port).close()
        assert httpx.get(f"http://{host}:{port}/", timeout=10).status_code == 200
        log = _stop(procs, p)  # every request it held has ended: their errors would be logged by now
    finally:
        procs.stop_all()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert "ClientDisconnect" not in log, log


# -- requests served at once -------------------------------------------------------------------------


def test_requests_served_at_once_are_bounded_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn served any number (each waiting body holds memory and a task): now 100 by default,
    `--limit-concurrency N` to change it; idle keep-alive connections close after 5 s."""
    served = record_serving(monkeypatch)
    for args, limit in (([], 100), (["--limit-concurrency", "7"], 7)):
        r = invoke_dashboard(tmp_path, *args)
        assert r.exit_code == 0, r.output
        config = served[-1]["config"]
        assert (config.limit_concurrency, config.timeout_keep_alive) == (limit, 5)
    for bad in ("0", "1"):  # 1: uvicorn counts the request's own connection, and would refuse all
        r = invoke_dashboard(tmp_path, "--limit-concurrency", bad)
        assert r.exit_code == 2 and "--limit-concurrency" in r.output


def test_beyond_the_limit_a_request_hears_503_until_a_slot_is_free(tmp_path: Path) -> None:
    """With `--limit-concurrency 2`, a client holding a request open (its body unfinished) and the
    next one's own connection fill it: that one hears 503; once the first leaves, 200."""
    procs = Procs(tmp_path)
    try:
        p, host, port = _start(procs, tmp_path, "--limit-concurrency", "2", group=("--log-format", "json"))
        held = _open_body(host, port)
        try:
            r = httpx.get(f"http://{host}:{port}/", timeout=10)
            assert r.status_code == 503, r.text
        finally:
            held.close()

        def served() -> bool:
            return httpx.get(f"http://{host}:{port}/", timeout=10).status_code == 200

        wait_until(served, 20, "a slot to come back once the held request's client left", 0.05)
        log = _stop(procs, p)
    finally:
        procs.stop_all()
    assert "Traceback" not in log, log
    # --log-format json: uvicorn's own warning is a JSON line too (found by review: its default
    # logging configuration wrote plain text among the JSON lines)
    lines = [ln for ln in log.splitlines() if ln.strip() and "dashboard on http://" not in ln]
    records = [json.loads(ln) for ln in lines]
    assert any("Exceeded concurrency limit" in r.get("msg", r.get("message", "")) for r in records), lines


def test_a_connection_that_sends_nothing_holds_a_slot_until_its_client_closes_it(tmp_path: Path) -> None:
    """What docs/dashboard.md "Limits" says: uvicorn counts every open connection against
    ``--limit-concurrency``, and a connection that never sends a byte has no timeout (the
    keep-alive timer starts only after an answer). Two silent sockets with a limit of 3 keep a GET
    at 503, still past the keep-alive timeout; closed, they give their slots back. On loopback only
    local processes can do that; beyond it, a proxy in front is what bounds such clients."""
    procs = Procs(tmp_path)
    try:
        p, host, port = _start(procs, tmp_path, "--limit-concurrency", "3")
        silent = [socket.create_connection((host, port), timeout=10) for _ in range(2)]
        try:
            assert httpx.get(f"http://{host}:{port}/", timeout=10).status_code == 503
            time.sleep(TIMEOUT_KEEP_ALIVE + 1)  # no timer of uvicorn's closes them meanwhile
            assert httpx.get(f"http://{host}:{port}/", timeout=10).status_code == 503
        finally:
            for s in silent:
                s.close()

        def served() -> bool:
            return httpx.get(f"http://{host}:{port}/", timeout=10).status_code == 200

        wait_until(served, 20, "the slots to come back once the silent clients closed", 0.05)
        log = _stop(procs, p)
    finally:
        procs.stop_all()
    assert "Traceback" not in log, log
