"""A throwaway PostgreSQL server on 127.0.0.1, for tests, benchmarks and the chaos harness.

Binaries come from the ``pgserver`` wheel (PostgreSQL in a Python package) when installed, else
from ``initdb``/``pg_ctl`` on PATH. PostgreSQL refuses to run as root, so as root the server runs
as an unprivileged system user (created if missing). The server listens on TCP, so it can be
restarted on the same port and reached through a proxy.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

RUN_AS = "stepwarden-pg"


def find_bin_dir() -> Path:
    spec = importlib.util.find_spec("pgserver")  # located, not imported: its import has side effects
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / "pginstall" / "bin"
        if (path / "pg_ctl").exists():
            return path
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    # Debian's and Ubuntu's postgresql packages put their binaries off the PATH (pgserver has no
    # wheel for Python 3.13 or later): the newest version installed.
    installed = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if installed:
        return installed[-1].parent
    raise RuntimeError(
        "no PostgreSQL binaries: pip install pgserver (Python 3.12 or older), or install postgresql"
        " (initdb, pg_ctl)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _user() -> str | None:
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pwd.getpwnam(RUN_AS)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", RUN_AS],
            check=True,
            capture_output=True,
        )
    return RUN_AS


def _open_up(path: Path) -> None:
    """Let the unprivileged server user traverse to (and read) our binaries and data."""
    for p in [path, *path.parents]:
        mode = p.stat().st_mode
        if mode & 0o005 != 0o005:
            p.chmod(mode | 0o005)


class LocalPostgres:
    """``start()``, ``stop()``, ``restart()``, ``url(db)``; end it with ``stop()``."""

    def __init__(self, data_dir: Path, port: int | None = None, *, durable: bool = False) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.bin = find_bin_dir()
        self.user = _user()
        self.durable = durable
        self.log = self.data_dir.parent / f"{self.data_dir.name}.log"

    def _run(self, *args: str, timeout: float = 60) -> None:
        kw: dict[str, object] = (
            {"user": self.user, "group": self.user, "extra_groups": []} if self.user else {}
        )
        r = subprocess.run(
            [str(self.bin / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout, **kw
        )  # type: ignore[call-overload]
        if r.returncode != 0:
            raise RuntimeError(f"{args[0]} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")

    def init(self) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.user:
            _open_up(self.bin)
            _open_up(self.data_dir.parent)
            shutil.chown(self.data_dir, self.user, self.user)
            self.log.touch()
            shutil.chown(self.log, self.user, self.user)
        self._run(
            "initdb",
            "-D",
            str(self.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-sync",
        )
        conf = [
            f"port = {self.port}",
            "listen_addresses = '127.0.0.1'",
            f"unix_socket_directories = '{self.data_dir}'",
            "max_connections = 200",
            "shared_buffers = 128MB",
            # The tests' own reads of whole tables (a state-machine test's dumps) were compiled
            # by Debian's LLVM build at every run: 535 s against 5 s for one test.
            "jit = off",
        ]
        if not self.durable:  # throwaway test data: trade durability for speed
            conf += ["fsync = off", "synchronous_commit = off", "full_page_writes = off"]
        with open(self.data_dir / "postgresql.conf", "a") as f:
            f.write("\n".join(conf) + "\n")

    def start(self) -> LocalPostgres:
        self.init()
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log), "-w", "-t", "60", "start")
        self.wait_ready()
        return self

    def stop(self, mode: str = "fast") -> None:
        if (self.data_dir / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self) -> None:
        self.stop("fast")
        self.start()

    def wait_ready(self, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > end:
                    raise RuntimeError(
                        f"PostgreSQL did not start on port {self.port}; see {self.log}"
                    ) from None
                time.sleep(0.05)

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"


def wait_for_lock_waiter(url: str, timeout: float = 10.0) -> None:
    """Return once a session of the database at ``url`` waits on a lock (a row, a table, an
    advisory lock): a test's cue that the transaction it started has reached the lock the test
    holds. It polls on a connection of its own in autocommit mode, since ``pg_stat_activity`` is
    read once per transaction: a poll inside the test's own transaction would never see it change."""
    import psycopg

    end = time.monotonic() + timeout
    with psycopg.connect(url, autocommit=True) as watch:
        while not watch.execute(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone():
            if time.monotonic() > end:
                raise TimeoutError(f"no session of the database waited on a lock within {timeout} s")
            time.sleep(0.01)
