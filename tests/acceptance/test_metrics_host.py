"""``worker --metrics-host HOST``: where a worker's own metrics listen (127.0.0.1 unless told
otherwise, as the dashboard). A host that cannot work is exit 2, one ``error:`` line, and no store
created. Only loopback addresses are bound or sent to."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from .helpers import DEMO_APP, SW, clean_env, refused_without_store, wait_until


@pytest.mark.parametrize("host", ["", "not a host", "-leading-hyphen", "a..b", "http://127.0.0.1/", "x\n"])
def test_a_malformed_metrics_host_is_refused_before_anything_is_written(tmp_path: Path, host: str) -> None:
    line = refused_without_store(
        tmp_path, "worker", "--app", DEMO_APP, "--metrics-port", "0", "--metrics-host", host
    )
    assert "--metrics-host" in line and "is not an IP address or a host name" in line, line


def test_a_metrics_host_without_a_port_is_refused(tmp_path: Path) -> None:
    line = refused_without_store(tmp_path, "worker", "--app", DEMO_APP, "--metrics-host", "127.0.0.1")
    assert "--metrics-host needs --metrics-port" in line, line


def test_the_metrics_listen_on_the_host_given(tmp_path: Path) -> None:
    """127.0.0.2 is loopback too (all of 127/8), and not the default: the URL and the socket
    are the host given."""
    log_path = tmp_path / "worker.log"
    db = tmp_path / "store.db"
    cmd = [str(SW), "--db", f"sqlite:///{db}", "worker", "--app", DEMO_APP, "--name", "mh"]
    cmd += ["--metrics-port", "0", "--metrics-host", "127.0.0.2"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), cwd=tmp_path)
        try:

            def served() -> str | None:
                m = re.search(r"worker metrics on (\S+)", log_path.read_text())
                if m is None and proc.poll() is not None:
                    pytest.fail(f"the worker exited {proc.returncode}:\n{log_path.read_text()}")
                return m.group(1) if m else None

            url = wait_until(served, 30, "the worker's metrics URL")
            assert re.fullmatch(r"http://127\.0\.0\.2:\d+/metrics", url), url
            r = httpx.get(url, timeout=10)
            assert r.status_code == 200 and "stepwarden_worker_info" in r.text
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            with pytest.raises(httpx.ConnectError):  # not on the default address
                httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        finally:
            _stop(proc)
    assert proc.returncode == 0, log_path.read_text()


def test_with_json_logs_every_line_of_a_worker_is_json_its_own_lines_and_its_last_error_too(
    tmp_path: Path,
) -> None:
    """``--log-format json`` is for a log shipper that parses each line of standard error. The
    command's own lines (``worker metrics on …``, the warning that they are served beyond the
    machine) and the ``error:`` line it exits with were plain text among the JSON (left alone in
    session 36); each is now one JSON object, its kind the level."""
    import json

    log_path = tmp_path / "worker.log"
    db = tmp_path / "store.db"
    cmd = [str(SW), "--log-format", "json", "--db", f"sqlite:///{db}", "worker", "--app", DEMO_APP]
    cmd += ["--name", "js", "--metrics-port", "0", "--metrics-host", "0.0.0.0"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), cwd=tmp_path)
        try:
            wait_until(
                lambda: "worker metrics on" in log_path.read_text() or proc.poll() is not None,
                30,
                "the worker's metrics line",
            )
        finally:
            _stop(proc)
    assert proc.returncode == 0, log_path.read_text()
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    own = ("worker metrics on ", "metrics served on ")
    said = {r["message"].split(" on ")[0]: r["level"] for r in records if r["message"].startswith(own)}
    assert said == {"worker metrics": "INFO", "metrics served": "WARNING"}, records
    assert any(r["message"].startswith("worker metrics on http://0.0.0.0:") for r in records), records

    refused = subprocess.run(
        [str(SW), "--log-format", "json", "--db", f"sqlite:///{db}", "worker", "--app", "no_such_module:app"],
        capture_output=True,
        text=True,
        env=clean_env(),
        cwd=tmp_path,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.splitlines()
    assert len(lines) == 1, lines
    error = json.loads(lines[0])
    assert error["level"] == "ERROR" and "no_such_module" in error["message"], error


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as an operator stops a worker; SIGKILL if it is still running 30 s later."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
