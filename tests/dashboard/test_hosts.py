"""The ``Host`` check (DNS-rebinding defence) as the command sets it up: on loopback as before plus
the public origin's host and ``--allowed-host`` names; beyond loopback on once the operator names
the hosts browsers use, else off as before, with a warning at start.

The commands here are told ``--host 0.0.0.0`` but bind 127.0.0.1 (``bind`` is replaced): what is
tested is what the command makes of the address, and nothing listens beyond this machine."""

from __future__ import annotations

import socket
import warnings
from pathlib import Path
from typing import Any

import pytest

from stepwarden.dashboard import command
from stepwarden.dashboard.web import create_app
from stepwarden.store import Store

from .command_harness import invoke_dashboard, record_serving

with warnings.catch_warnings():  # Starlette would rather use httpx2; httpx is what we have
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")

REBIND = "rebind.evil.example:8080"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    real_bind = command.bind

    def loopback_bind(host: str, port: int) -> socket.socket:
        return real_bind("127.0.0.1", port)

    monkeypatch.setattr(command, "bind", loopback_bind)
    return record_serving(monkeypatch)


def start(tmp_path: Path, *args: str) -> str:
    """Run the command with ``args`` (its app is in ``served``); what it printed."""
    r = invoke_dashboard(tmp_path, *args)
    assert r.exit_code == 0, r.output
    return r.output


def status(app: Any, host: str) -> int:
    with TestClient(app, base_url=f"http://{host}", follow_redirects=False) as c:
        code: int = c.get("/").status_code
    return code


def rebinding_warnings(output: str) -> list[str]:
    return [line for line in output.splitlines() if "rebinds" in line]


def test_on_loopback_the_public_origin_host_is_answered(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    """Behind a proxy that passes the browser's Host on (nginx `proxy_set_header Host $host`),
    every page was a 400: only loopback names were allowed."""
    output = start(tmp_path, "--public-origin", "https://ops.example.com")
    app = served[0]["app"]
    for host in ("ops.example.com", "OPS.example.com:443", "ops.example.com.", "127.0.0.1:8080", "localhost"):
        assert status(app, host) == 200, host
    assert status(app, REBIND) == 400
    assert rebinding_warnings(output) == []


def test_on_loopback_allowed_hosts_are_answered(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    start(tmp_path, "--allowed-host", "dash.internal", "--allowed-host", "Other.Internal.")
    app = served[0]["app"]
    for host in ("dash.internal", "dash.internal:8080", "other.internal", "127.0.0.1"):
        assert status(app, host) == 200, host
    assert status(app, REBIND) == 400
    assert status(app, "dash.internal.evil.example") == 400


def test_an_ip_address_in_host_is_answered(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    """Rebinding needs a DNS name; a Host that is an address comes from a page of that address
    (an operator typing it, a load balancer's health check), so it is not refused."""
    start(tmp_path, "--host", "0.0.0.0", "--public-origin", "https://ops.example.com")
    app = served[0]["app"]
    for host in ("10.1.2.3:8080", "192.0.2.7", "[fd00::1]:8080", "[::1]"):
        assert status(app, host) == 200, host
    assert status(app, "10.1.2.3.nip.io:8080") == 400


def test_beyond_loopback_allowed_hosts_turn_the_check_on(
    tmp_path: Path, served: list[dict[str, Any]]
) -> None:
    """Bound beyond loopback, any Host was answered: a page rebinding its name to this machine
    could read every page. With the names browsers use given, only those (and loopback names,
    and addresses) are."""
    output = start(tmp_path, "--host", "0.0.0.0", "--allowed-host", "dash.internal")
    app = served[0]["app"]
    assert status(app, "dash.internal:8080") == 200
    assert status(app, "localhost:8080") == 200
    with TestClient(app, base_url=f"http://{REBIND}") as c:
        r = c.get("/")
    assert r.status_code == 400
    assert "'rebind.evil.example'" in r.text and "--allowed-host" in r.text
    assert rebinding_warnings(output) == []


def test_beyond_loopback_the_public_origin_turns_the_check_on(
    tmp_path: Path, served: list[dict[str, Any]]
) -> None:
    output = start(tmp_path, "--host", "0.0.0.0", "--public-origin", "https://ops.example.com:8443")
    app = served[0]["app"]
    assert status(app, "ops.example.com:8443") == 200
    assert status(app, REBIND) == 400
    assert rebinding_warnings(output) == []


def test_beyond_loopback_without_a_list_any_host_is_answered_with_a_warning(
    tmp_path: Path, served: list[dict[str, Any]]
) -> None:
    """As before (an upgrade must not refuse names nobody listed), but said at start, in one line
    that names the risk and the option."""
    output = start(tmp_path, "--host", "0.0.0.0")
    assert status(served[0]["app"], REBIND) == 200
    [line] = rebinding_warnings(output)
    assert line.startswith("warning: ") and "--allowed-host" in line and "0.0.0.0" in line


@pytest.mark.parametrize(
    "value",
    [
        "https://ops.example.com",
        "ops.example.com:443",
        "ops example",
        "-ops.example.com",
        "a..b",
        "",
        "[ops.example.com]",  # brackets hold an IPv6 address, never a name
        "ops.example.com..",
    ],
)
def test_an_allowed_host_that_is_not_a_host_name_is_one_error_line(
    tmp_path: Path, served: list[dict[str, Any]], value: str
) -> None:
    r = invoke_dashboard(tmp_path, "--allowed-host", value)
    assert r.exit_code == 2, r.output
    assert "--allowed-host" in r.output and "is not a host name or an IP address" in r.output
    assert not served


@pytest.mark.parametrize("value", ["10.0.0.5", "::1", "[::1]", "[fd00::1]", "127.0.0.1."])
def test_an_allowed_host_that_is_an_ip_address_is_one_error_line_that_says_why(
    tmp_path: Path, served: list[dict[str, Any]], value: str
) -> None:
    """An address in Host is always answered, so listing one would decide nothing: it was accepted
    (and dropped, in effect), leaving an operator to believe other addresses were refused."""
    r = invoke_dashboard(tmp_path, "--allowed-host", value)
    assert r.exit_code == 2 and not served, r.output
    [line] = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert "--allowed-host" in line and "is an IP address" in line and "always answers" in line
    assert "--allowed-host localhost" in line  # what to do when browsers use addresses only


def test_beyond_loopback_allowed_host_localhost_turns_the_check_on_for_addresses_only(
    tmp_path: Path, served: list[dict[str, Any]]
) -> None:
    """What the error line for an address suggests: browsers that use addresses are answered, and
    no name but localhost is."""
    output = start(tmp_path, "--host", "0.0.0.0", "--allowed-host", "localhost")
    app = served[0]["app"]
    assert status(app, "10.1.2.3:8080") == 200 and status(app, "localhost") == 200
    assert status(app, REBIND) == 400
    assert rebinding_warnings(output) == []


def test_the_allowlist_is_every_name_and_names_only() -> None:
    """One list, made in one place: localhost, the --host value if it is a name, the public
    origin's host and the allowed names; never an address (always answered, so it would decide
    nothing). Beyond loopback, None (any Host) until a name or a public origin is given."""
    allowlist = command.host_allowlist
    assert allowlist("127.0.0.2", None, (), loopback=True) == ("localhost",)
    assert allowlist("[::1]", None, (), loopback=True) == ("localhost",)
    assert allowlist("localhost", None, ("dash.internal",), loopback=True) == ("localhost", "dash.internal")
    assert allowlist("0.0.0.0", None, (), loopback=False) is None
    assert allowlist("0.0.0.0", "https://Ops.Example.com:8443", (), loopback=False) == (
        "localhost",
        "ops.example.com",
    )
    assert allowlist("::", "https://[fd00::1]", ("dash.internal",), loopback=False) == (
        "localhost",
        "dash.internal",
    )
    assert allowlist("dash.lan", None, ("Other.Internal.",), loopback=False) == (
        "localhost",
        "dash.lan",
        "Other.Internal.",  # as given: the check compares without case or final dot
    )


def test_the_check_compares_names_without_case_port_or_final_dot_and_brackets_only_an_ipv6_address(
    store: Store,
) -> None:
    """Normalised once, by the check, for its list and each header alike: a caller of create_app may
    give names as operators type them. ``[ops.example.com]`` is no way to write the name."""
    app = create_app(store, allowed_hosts=[" Ops.Example.COM. ", "[::1]"])
    for host in ("ops.example.com", "OPS.example.com.:443", "[fd00::1]:8080", "127.0.0.1"):
        assert status(app, host) == 200, host
    with TestClient(app) as c:  # as a header: no URL can hold a bracketed name
        for host in ("[ops.example.com]", "[ops.example.com]:443", "ops.example.com.evil.example", REBIND):
            assert c.get("/", headers={"Host": host}).status_code == 400, host


def test_create_app_answers_the_names_it_is_given_and_no_other(store: Store) -> None:
    """The command puts the public origin's host on the list (host_allowlist); create_app adds
    nothing of its own, so the list it is given is the whole list."""
    app = create_app(store, allowed_hosts=["localhost"], public_origin="https://ops.example.com")
    assert status(app, "localhost:8080") == 200
    assert status(app, "ops.example.com") == 400
