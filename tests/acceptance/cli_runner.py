"""Run the console script for a test: through the fork server of ``cli_zygote.py`` where that gives
the process an exec would, else by ``subprocess`` (see that module for why and when)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import select
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ZYGOTE = Path(__file__).with_name("cli_zygote.py")
# Variables read as the interpreter starts (encodings, paths, flags, time zone) or as the server's
# imports run (psycopg's implementation and wait function, OpenTelemetry's context), so a fork of a
# server started with other values would not be the process an exec would give.
STARTUP_VARS = ("PYTHON", "LANG", "LC_", "TZ", "PSYCOPG_", "OTEL_")
# execve refuses a string over 128 KiB (MAX_ARG_STRLEN) and all of them past ~2 MiB: a run that
# big goes through exec, so that the test meets the same refusal.
FORK_MAX_STRING = 100_000
FORK_MAX_TOTAL = 1_000_000
READY_TIMEOUT = 60.0
KILL_WAIT = 5.0  # for a run killed on a timeout or an interrupt to end, as subprocess.run waits
PG_SCHEMES = ("postgresql://", "postgres://")


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any STEPWARDEN_* variable, wide enough for rich tables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEPWARDEN_")}
    env.update(COLUMNS="200", NO_COLOR="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _process_state(env: dict[str, str]) -> tuple[object, ...]:
    """What a child inherits at start from its parent besides fds: the interpreter's settings in
    the environment, the umask, the resource limits."""
    limits = tuple(
        resource.getrlimit(getattr(resource, name))
        for name in sorted(dir(resource))
        if name.startswith("RLIMIT_")
    )
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_VARS))), _umask(), limits


def _umask() -> str:
    """The process's umask, read without setting it (another thread may be creating a file); the
    fork server runs only on Linux (pidfds), whose /proc has it."""
    status = Path("/proc/self/status").read_text()
    return status[status.index("Umask:") :].split("\n", 1)[0]


class _Zygote:
    """One fork server of this test process, started at its first use and ended by its pid."""

    def __init__(self, pg: bool, script: Path = ZYGOTE) -> None:
        self.pg, self.script = pg, script
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.failed = os.environ.get("STEPWARDEN_TEST_SPAWN_CLI") == "1" or not hasattr(os, "pidfd_open")
        self.folder = self.path = ""
        self.state: tuple[object, ...] = ()
        self.pids: list[int] = []  # of the runs it forked, for the tests of this module

    def usable_for(self, env: dict[str, str]) -> bool:
        with self.lock:
            if self.failed:
                return False
            if self.proc is None:
                self._start()
            return not self.failed and _process_state(env) == self.state

    def _start(self) -> None:
        env = clean_env()
        self.folder = folder = tempfile.mkdtemp(prefix="stepwarden-cli-zygote-")
        self.path = os.path.join(folder, "sock")
        try:
            with open(os.path.join(folder, "log"), "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, str(self.script), self.path, *(["--pg"] if self.pg else [])],
                    env=env,
                    stdin=subprocess.PIPE,  # never written: its EOF tells the server this process is gone
                    stdout=subprocess.PIPE,
                    stderr=log,
                    cwd=folder,
                )
            assert self.proc.stdout is not None
            ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT)
            if not ready or self.proc.stdout.readline() != b"ready\n":
                raise RuntimeError(f"no `ready` within {READY_TIMEOUT:g}s (see {folder}/log)")
            if os.path.getsize(os.path.join(folder, "log")):
                # an exec'd run would print it on its own stderr, where the tests look
                raise RuntimeError("its imports printed something")
        except BaseException as e:
            self._give_up(f"the CLI fork server did not start ({e}); running the CLI by exec")
            if not isinstance(e, Exception):
                raise
            return
        self.state = _process_state(env)
        atexit.register(self.stop)

    def _give_up(self, why: str) -> None:
        self.failed = True
        print(why, file=sys.stderr)
        self.stop()

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            assert p.stdin is not None
            p.stdin.close()  # the server kills what it still runs and removes its folder
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def run(
        self, argv: list[str], cwd: str, env: dict[str, str], data: bytes, timeout: float
    ) -> tuple[int, bytes, bytes] | None:
        """(exit code as ``subprocess`` gives it, stdout, stderr); ``TimeoutExpired`` as ``run``
        raises it; None if the server could not start the run (then nothing was started)."""
        payload = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        deadline = time.monotonic() + timeout
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        reader = conn.makefile("rb")  # closed with conn: a socket open in a file object stays open
        pipes = [os.pipe() for _ in range(3)]
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
        try:  # closing `conn` before the run's status came kills the run (see cli_zygote)
            try:
                conn.connect(self.path)
                socket.send_fds(conn, [struct.pack("!I", len(payload))], theirs)
                conn.sendall(payload)
            except OSError as e:
                self._give_up(f"the CLI fork server is gone ({e}); running the CLI by exec")
                return None
            finally:
                for fd in theirs:
                    os.close(fd)
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                started = json.loads(reader.readline() or b'{"error": "the server closed the connection"}')
            except TimeoutError:  # closing conn kills the run, if the server started one
                raise subprocess.TimeoutExpired(argv, timeout) from None
            if "pid" not in started:  # the run never started (see cli_zygote): exec it
                self._give_up(f"the CLI fork server could not start a run: {started['error']}")
                return None
            self.pids.append(started["pid"])
            fds, ours = ours, []
            line: bytes | None = None
            try:
                out, err, timed_out = _communicate(fds, data, deadline)
                if not timed_out:
                    conn.settimeout(max(0.01, deadline - time.monotonic()))
                    try:
                        line = reader.readline()
                    except TimeoutError:  # its output closed, yet it runs on
                        timed_out = True
            finally:
                if line is None:  # a timeout or an interrupt: kill the run and wait for its end
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_WR)
                        conn.settimeout(KILL_WAIT)
                        reader.readline()
            if timed_out:
                raise subprocess.TimeoutExpired(argv, timeout, output=out, stderr=err)
            if not line:
                raise RuntimeError(f"the CLI fork server ended during a run (pid {started['pid']})")
            return os.waitstatus_to_exitcode(json.loads(line)["status"]), out, err
        finally:
            for fd in ours:
                os.close(fd)
            reader.close()
            conn.close()


def _communicate(fds: list[int], data: bytes, deadline: float) -> tuple[bytes, bytes, bool]:
    """Write stdin, read stdout and stderr to their ends or to the deadline (then True); closes
    ``fds`` (stdin's write end, stdout's and stderr's read ends)."""
    in_w, out_r, err_r = fds
    sel = selectors.DefaultSelector()
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    os.set_blocking(in_w, False)
    if data:
        sel.register(in_w, selectors.EVENT_WRITE)
    else:
        os.close(in_w)
    sel.register(out_r, selectors.EVENT_READ)
    sel.register(err_r, selectors.EVENT_READ)
    view = memoryview(data)
    timed_out = False
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                fd = key.fd
                if fd == in_w:
                    try:
                        view = view[os.write(in_w, view[:65536]) :]
                    except BrokenPipeError:
                        view = view[:0]  # the run stopped reading, which subprocess ignores too
                    if not view:
                        sel.unregister(in_w)
                        os.close(in_w)
                else:
                    chunk = os.read(fd, 65536)
                    if chunk:
                        chunks[fd].append(chunk)
                    else:
                        sel.unregister(fd)
                        os.close(fd)
    finally:
        for key in list(sel.get_map().values()):
            os.close(key.fd)
        sel.close()
    return b"".join(chunks[out_r]), b"".join(chunks[err_r]), timed_out


_ZYGOTES = {False: _Zygote(pg=False), True: _Zygote(pg=True)}


def _forkable(argv: list[str], cwd: Path, env: dict[str, str]) -> bool:
    """Whether exec would start this run at all, with nothing a fork would do otherwise."""
    strings = [os.fsencode(a) for a in argv] + [os.fsencode(f"{k}={v}") for k, v in env.items()]
    return (
        all(k and "=" not in k for k in env)  # exec refuses such a name; os.environ too
        and cwd.is_absolute()
        and cwd.is_dir()
        and all(b"\0" not in s and len(s) <= FORK_MAX_STRING for s in strings)
        and sum(len(s) for s in strings) <= FORK_MAX_TOTAL
    )


def _given_postgres(argv: list[str], env: dict[str, str]) -> bool:
    """A run given a PostgreSQL URL imports that store; one not given it must not find it imported."""
    urls = [env.get("STEPWARDEN_DB", "")]
    for i, a in enumerate(argv):
        if a == "--db" and i + 1 < len(argv):
            urls.append(argv[i + 1])
        elif a.startswith("--db="):
            urls.append(a.removeprefix("--db="))
    return any(u.startswith(PG_SCHEMES) for u in urls)


def fork_server(pg: bool) -> _Zygote:
    """The server that runs plain commands (``pg=False``) or those given a PostgreSQL URL."""
    return _ZYGOTES[pg]


def run_console_script(
    cmd: list[str] | list[bytes], cwd: Path, env: dict[str, str], data: bytes, timeout: float
) -> tuple[int, bytes, bytes]:
    """Run ``cmd`` (the console script and its arguments) as a process of its own."""
    argv = [os.fsdecode(a) for a in cmd]
    if _forkable(argv, cwd, env):
        zygote = fork_server(_given_postgres(argv, env))
        if zygote.usable_for(env):
            result = zygote.run(argv, str(cwd), env, data, timeout)
            if result is not None:
                return result
    p = subprocess.run(cmd, cwd=cwd, env=env, input=data, capture_output=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr
