"""The operator token from a file (``--token-file``, ``STEPWARDEN_DASHBOARD_TOKEN_FILE``): a Docker
or systemd secret, or a pipe from a password manager. A file that cannot give a token is one error
line (exit 2) that never shows its content; a file other users may read, and a short token, are
served with a warning."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

from .command_harness import invoke_dashboard, record_serving

STRONG = "Zk3-sT9_qLw2vX8nB4mR"  # 20 characters
SHORT = "hunter2"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    return record_serving(monkeypatch)


def secret(tmp_path: Path, content: bytes | str, mode: int = 0o600, name: str = "token") -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    path.chmod(mode)
    return path


def served_token(served: list[dict[str, Any]]) -> str | None:
    assert len(served) == 1
    token: str | None = served[0]["app"].state.dashboard.guard.token
    return token


def warnings_of(r: Result) -> list[str]:
    return [line for line in r.output.splitlines() if line.startswith("warning:")]


def test_a_private_token_file_is_read_without_its_newline_and_without_a_warning(
    tmp_path: Path, served: list[dict[str, Any]]
) -> None:
    path = secret(tmp_path, f"{STRONG}\n")
    r = invoke_dashboard(tmp_path, "--token-file", str(path))
    assert r.exit_code == 0, r.output
    assert served_token(served) == STRONG
    assert "operator actions enabled" in r.output
    assert warnings_of(r) == []
    assert STRONG not in r.output


def test_the_environment_names_the_token_file_too(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    path = secret(tmp_path, f"  {STRONG}\r\n")
    r = invoke_dashboard(tmp_path, env={"STEPWARDEN_DASHBOARD_TOKEN_FILE": str(path)})
    assert r.exit_code == 0, r.output
    assert served_token(served) == STRONG


def test_a_pipe_is_read_as_process_substitution_gives_it(
    tmp_path: Path, served: list[dict[str, Any]]
) -> None:
    """``--token-file <(pass show ops/dashboard)``: a /dev/fd path to a pipe, no mode to check."""
    read, write = os.pipe()

    def feed() -> None:
        os.write(write, f"{STRONG}\n".encode())
        os.close(write)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        r = invoke_dashboard(tmp_path, "--token-file", f"/dev/fd/{read}")
    finally:
        writer.join(timeout=10)
        os.close(read)
    assert r.exit_code == 0, r.output
    assert served_token(served) == STRONG
    assert warnings_of(r) == []


def test_a_token_file_other_users_can_read_is_served_with_a_warning(
    tmp_path: Path, served: list[dict[str, Any]]
) -> None:
    path = secret(tmp_path, STRONG, mode=0o644)
    r = invoke_dashboard(tmp_path, "--token-file", str(path))
    assert r.exit_code == 0, r.output
    assert served_token(served) == STRONG
    [line] = warnings_of(r)
    assert "open to other users (mode 0644)" in line and f"chmod 600 {path}" in line
    assert STRONG not in r.output


@pytest.mark.parametrize("how", ["option", "file"])
def test_a_short_token_is_served_with_a_warning_that_says_how_to_make_a_strong_one(
    tmp_path: Path, served: list[dict[str, Any]], how: str
) -> None:
    args = ["--token", SHORT] if how == "option" else ["--token-file", str(secret(tmp_path, SHORT))]
    r = invoke_dashboard(tmp_path, *args)
    assert r.exit_code == 0, r.output
    assert served_token(served) == SHORT
    [line] = warnings_of(r)
    assert "7 characters" in line and "secrets.token_urlsafe" in line
    assert SHORT not in r.output


def test_a_strong_token_and_a_read_only_dashboard_have_no_token_warning(
    tmp_path: Path, served: list[dict[str, Any]]
) -> None:
    assert warnings_of(invoke_dashboard(tmp_path, "--token", STRONG)) == []
    assert warnings_of(invoke_dashboard(tmp_path)) == []
    assert [served_token([s]) for s in served] == [STRONG, None]


def test_a_token_and_a_token_file_together_are_refused(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    path = secret(tmp_path, STRONG)
    for args, env in [
        (["--token", STRONG, "--token-file", str(path)], {}),
        (["--token-file", str(path)], {"STEPWARDEN_DASHBOARD_TOKEN": STRONG}),
    ]:
        r = invoke_dashboard(tmp_path, *args, env=env)
        assert r.exit_code == 2, r.output
        errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and "not both" in errors[0], r.output
    assert not served


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "holds no token"),
        (b" \n\t\n", "holds no token"),
        (b"two words\n", "no space, tab or control character"),
        ("t\u00f6ken-with-umlaut-0123".encode(), "non-ASCII"),
        (b"x" * 5000, "longer than 4096 bytes"),
    ],
)
def test_a_token_file_that_gives_no_usable_token_is_one_error_line_that_hides_its_content(
    tmp_path: Path, served: list[dict[str, Any]], content: bytes, says: str
) -> None:
    path = secret(tmp_path, content)
    r = invoke_dashboard(tmp_path, "--token-file", str(path))
    assert r.exit_code == 2 and not served, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "'--token-file'" in errors[0] and says in errors[0], r.output
    assert "Traceback" not in r.output
    for secret_text in (b"two words", "t\u00f6ken".encode(), b"xxxxxxxx"):
        assert secret_text.decode() not in r.output


@pytest.mark.parametrize("kind", ["missing", "directory", "unreadable"])
def test_a_token_file_that_cannot_be_read_is_one_error_line(
    tmp_path: Path, served: list[dict[str, Any]], kind: str
) -> None:
    path = tmp_path / "token"
    if kind == "directory":
        path.mkdir()
    elif kind == "unreadable":
        secret(tmp_path, STRONG, mode=0o000)
        if os.access(path, os.R_OK):  # root reads anything: make it unreadable another way
            path.unlink()
            os.symlink(path, path)  # a loop: ELOOP, as unreadable as it gets for root
    r = invoke_dashboard(tmp_path, "--token-file", str(path))
    assert r.exit_code == 2 and not served, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "'--token-file'" in errors[0] and str(path) in errors[0], r.output
    assert "Traceback" not in r.output
