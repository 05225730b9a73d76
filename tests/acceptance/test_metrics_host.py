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
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    assert proc.returncode == 0, log_path.read_text()
