"""A throwaway PgBouncer on 127.0.0.1 in front of a PostgreSQL server, for tests.

The binary is the distribution's (Debian: ``apt-get install pgbouncer``, installed as
``/usr/sbin/pgbouncer``). PgBouncer refuses to run as root, so as root it drops to the same
unprivileged user as :mod:`stepwarden.testing.postgres` after reading its configuration. Clients
are trusted (loopback only); the server is reached with the user and password of the server URL.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from .postgres import _user, free_port


def find_pgbouncer() -> str | None:
    """The pgbouncer executable, or None when it is not installed."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer") if os.access(p, os.X_OK)), None
    )


def pgbouncer_version(exe: str) -> tuple[int, int, int]:
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"PgBouncer (\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the version of {exe}: {out!r}")
    return int(m[1]), int(m[2]), int(m[3])


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class LocalPgBouncer:
    """``start()``, ``url(db)``, ``admin(command)``, ``stop()``. Every database of the server is
    reachable under its own name; each (database, user) pair gets at most ``pool_size`` server
    connections, shared by all its clients as ``pool_mode`` says."""

    def __init__(
        self,
        home: Path,
        server_url: str,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 2,
        settings: dict[str, Any] | None = None,
        exe: str | None = None,
    ) -> None:
        found = exe or find_pgbouncer()
        if found is None:
            raise RuntimeError("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
        self.exe = found
        self.version = pgbouncer_version(found)
        self.home = Path(home)
        self.port = free_port()
        self.log = self.home / "pgbouncer.log"
        self.popen: subprocess.Popen[bytes] | None = None
        server = urlsplit(server_url)
        query = dict(parse_qsl(server.query))
        self.user = unquote(server.username or "") or query.get("user") or getpass.getuser()
        target = {
            "host": server.hostname or query.get("host") or "127.0.0.1",
            "port": str(server.port or query.get("port") or 5432),
            "user": self.user,
        }
        password = unquote(server.password or "") or query.get("password")
        if password:
            target["password"] = password
        self.settings: dict[str, Any] = {
            "listen_addr": "127.0.0.1",
            "listen_port": self.port,
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self.home / "users.txt"),
            "admin_users": self.user,
            "pool_mode": pool_mode,
            "default_pool_size": pool_size,
            "min_pool_size": 0,
            "reserve_pool_size": 0,
            "max_client_conn": 500,
            "query_wait_timeout": 60,
        }
        self.settings.update(settings or {})
        self.databases = {"*": " ".join(f"{k}={_quote(v)}" for k, v in target.items())}

    def write_config(self) -> Path:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "users.txt").write_text(f'"{self.user}" ""\n')
        lines = ["[databases]", *(f"{k} = {v}" for k, v in self.databases.items()), "", "[pgbouncer]"]
        lines += [f"{k} = {v}" for k, v in self.settings.items()]
        ini = self.home / "pgbouncer.ini"
        ini.write_text("\n".join(lines) + "\n")
        return ini

    def start(self, timeout: float = 20.0) -> LocalPgBouncer:
        ini = self.write_config()
        cmd = [self.exe, str(ini)]
        user = _user()
        if user:  # it reads its configuration as root, then becomes the unprivileged user
            cmd[1:1] = ["-u", user]
        with open(self.log, "ab") as log:
            self.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        end = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self.popen.returncode}:\n{self.log_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                if time.monotonic() > end:
                    self.stop()
                    raise RuntimeError(
                        f"pgbouncer did not listen on {self.port}:\n{self.log_text()}"
                    ) from None
                time.sleep(0.02)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def url(self, db: str, query: str = "") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{db}" + (f"?{query}" if query else "")

    def admin(self, command: str) -> list[dict[str, Any]]:
        """A command of PgBouncer's admin console (``SHOW POOLS``, ``SHOW SERVERS``, ...)."""
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(
            self.url("pgbouncer"), autocommit=True, prepare_threshold=None, row_factory=dict_row
        ) as conn:
            return list(conn.execute(command).fetchall())

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (PgBouncer's immediate shutdown) to the process this object started, by its
        pid; SIGKILL if it is still there at the deadline."""
        p = self.popen
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
