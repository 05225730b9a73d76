"""The ``dashboard`` click command: the group's ``--db``, loopback by default, token from the env."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from acceptance.helpers import clean_env
from stepwarden.cli_params import is_loopback
from stepwarden.dashboard.command import bind
from stepwarden.store import open_store

from .command_harness import command_env, db_url, group, invoke_dashboard, record_serving


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return record_serving(monkeypatch)


def test_serves_the_group_db_on_loopback(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    url = db_url(tmp_path)
    r = invoke_dashboard(tmp_path)
    assert r.exit_code == 0, r.output
    assert len(served) == 1
    host, port = served[0]["name"][:2]
    assert host == "127.0.0.1" and port > 0
    assert f"dashboard on http://127.0.0.1:{port}/" in r.output
    assert "read-only" in r.output
    app = served[0]["app"]
    assert not app.state.dashboard.guard.actions_enabled
    assert app.state.dashboard.store.url == url


def test_token_from_the_environment(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    r = invoke_dashboard(tmp_path, env={"STEPWARDEN_DASHBOARD_TOKEN": "tok-123"}, db_from_env=True)
    assert r.exit_code == 0, r.output
    assert served[0]["app"].state.dashboard.store.url == db_url(tmp_path)  # from STEPWARDEN_DB
    assert "operator actions enabled" in r.output and "tok-123" not in r.output
    assert served[0]["app"].state.dashboard.guard.token == "tok-123"


def test_refuses_a_store_that_does_not_exist(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    r = CliRunner().invoke(
        group(), ["--db", f"sqlite:///{tmp_path / 'missing.db'}", "dashboard"], env=command_env()
    )
    assert r.exit_code == 1 and "no stepwarden store" in r.output
    assert not (tmp_path / "missing.db").exists() and not served


def test_loopback_detection_and_bind() -> None:
    assert (
        is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("[::1]")
    )
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.1") and not is_loopback("example.org")
    sock = bind("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        sock.listen(1)
        with pytest.raises(click.ClickException, match="cannot listen"):
            bind("127.0.0.1", port)  # taken: one clear line, no traceback
    finally:
        sock.close()


def test_the_command_loads_without_the_extra_and_says_what_to_install(tmp_path: Path) -> None:
    import subprocess
    import sys

    url = db_url(tmp_path)
    open_store(url).close()
    code = (
        "import sys\n"
        "for m in ('starlette', 'uvicorn', 'jinja2', 'prometheus_client'): sys.modules[m] = None\n"
        "from stepwarden.dashboard.command import dashboard\n"
        "from stepwarden.dashboard.__main__ import cli\n"
        "cli(['--db', sys.argv[1], 'dashboard', '--port', '0'])\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, url], capture_output=True, text=True, timeout=60, env=clean_env()
    )
    assert p.returncode == 1, p.stderr
    assert "pip install 'stepwarden[dashboard]'" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("args", "code", "text"),
    [
        (["--db", "sqlite:///{tmp}/missing.db", "dashboard"], 1, "error: no stepwarden store at"),
        (["dashboard", "--port", "99999"], 2, "error: Invalid value for '--port'"),
    ],
)
def test_python_m_stepwarden_dashboard_says_what_is_wrong_in_one_line(
    tmp_path: Path, args: list[str], code: int, text: str
) -> None:
    """It printed click's "Error:" block and exited 0 for a store that does not exist, where
    `stepwarden dashboard` prints one `error:` line and exits 1 (2 for bad input)."""
    import subprocess
    import sys

    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    p = subprocess.run(
        [sys.executable, "-m", "stepwarden.dashboard", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=clean_env(),
    )
    assert p.returncode == code, p
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(text), p.stderr


def _serve_and_get(app: Any, host_header: str, **kw: Any) -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from starlette.testclient import TestClient

    with TestClient(app, base_url=f"http://{host_header}", follow_redirects=False) as c:
        return c.get("/", **kw)


def test_a_loopback_address_other_than_127_0_0_1_answers_on_its_own_name(
    tmp_path: Path, served: list[dict[str, Any]]
) -> None:
    """Every 127.x address is loopback; the dashboard listening on one refused the very URL it
    printed ("invalid Host header"), as only 127.0.0.1, localhost and ::1 were allowed."""
    r = invoke_dashboard(tmp_path, "--host", "127.0.0.2")
    assert r.exit_code == 0, r.output
    app = served[0]["app"]
    port = served[0]["name"][1]
    assert _serve_and_get(app, f"127.0.0.2:{port}").status_code == 200
    assert _serve_and_get(app, f"localhost:{port}").status_code == 200
    assert _serve_and_get(app, f"rebind.evil.example:{port}").status_code == 400


def test_public_origin_behind_a_tls_proxy(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    r = invoke_dashboard(
        tmp_path, "--public-origin", "HTTPS://Ops.Example.com/", env={"STEPWARDEN_DASHBOARD_TOKEN": "tok"}
    )
    assert r.exit_code == 0, r.output
    guard = served[0]["app"].state.dashboard.guard
    assert guard.public_origin == "https://ops.example.com" and guard.secure_cookies


@pytest.mark.parametrize(
    "value",
    ["ftp://ops.example.com", "ops.example.com", "https://ops.example.com/dash", "https://x?y=1", "https://"],
)
def test_a_public_origin_that_is_not_an_origin_is_one_error_line(
    tmp_path: Path, served: list[dict[str, Any]], value: str
) -> None:
    r = invoke_dashboard(tmp_path, "--public-origin", value)
    assert r.exit_code == 2 and "--public-origin" in r.output and "is not an origin" in r.output
    assert not served


def _dashboard(tmp_path: Path, *args: str) -> Any:
    """``stepwarden --db sqlite:///TMP/x.db dashboard ARGS`` as a process, on a store made first."""
    import subprocess
    import sys

    url = db_url(tmp_path)
    open_store(url).close()
    argv = [sys.executable, "-m", "stepwarden", "--db", url, "dashboard", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=clean_env())


@pytest.mark.parametrize(
    "host", ["999.1.1.1", "nosuchhost.invalid", "192.0.2.1"], ids=["malformed", "unresolved", "not ours"]
)
def test_a_host_that_cannot_work_is_bad_input_exit_2_and_a_taken_port_is_exit_1(
    tmp_path: Path, host: str
) -> None:
    """`--host` is the operator's input: one that is malformed, does not resolve or is not an
    address of this machine is exit 2 with one line, as for `worker --metrics-host` (it was exit
    1). A port another process holds is this machine's state: exit 1."""
    p = _dashboard(tmp_path, "--host", host, "--port", "0")
    assert p.returncode == 2, p
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot "), p.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        p = _dashboard(tmp_path, "--host", "127.0.0.1", "--port", str(taken.getsockname()[1]))
    assert p.returncode == 1, p
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot listen on 127.0.0.1:"), p.stderr
