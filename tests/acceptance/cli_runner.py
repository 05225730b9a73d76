"""Run the console script for a test: through the fork server of ``cli_zygote.py`` where that is the
same as a fresh ``exec``, else by ``subprocess`` (see that module for why and when)."""

from __future__ import annotations

import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ZYGOTE = Path(__file__).with_name("cli_zygote.py")
# Variables the interpreter reads as it starts (its encodings, paths, flags, time zone), so a fork of
# a server started with other values would not be the process an exec would give.
STARTUP_VARS = ("PYTHON", "LANG", "LC_", "TZ")
# execve refuses an argument over 128 KiB (MAX_ARG_STRLEN) and all of them past ~2 MiB: a run that
# big goes through exec, so that the test meets the same refusal.
FORK_MAX_ARG = 100_000
FORK_MAX_TOTAL = 1_000_000


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_VARS)}


class _Zygote:
    """The fork server of this test process, started at its first use and ended by its pid."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.failed = os.environ.get("STEPWARDEN_TEST_SPAWN_CLI") == "1" or not hasattr(os, "pidfd_open")
        self.folder = self.path = ""

    def usable_for(self, env: dict[str, str]) -> bool:
        with self.lock:
            if self.failed:
                return False
            if _startup_env(env) != _startup_env(dict(os.environ)):
                return False  # a test's own interpreter settings (a PYTHONPATH, a locale): exec
            if self.proc is None:
                self._start(env)
            return not self.failed

    def _start(self, env: dict[str, str]) -> None:
        self.folder = folder = tempfile.mkdtemp(prefix="stepwarden-cli-zygote-")
        self.path = os.path.join(folder, "sock")
        log = open(os.path.join(folder, "log"), "wb")  # noqa: SIM115 - the server's, kept open by it
        self.proc = subprocess.Popen(
            [sys.executable, str(ZYGOTE), self.path],
            env=env,
            stdin=subprocess.PIPE,  # never written: its EOF tells the server this process is gone
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=folder,
        )
        log.close()
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()  # the server imports for a few tenths of a second
        if ready != b"ready\n":
            self.proc.wait(10)
            shutil.rmtree(folder, ignore_errors=True)
            self.failed = True
            code = self.proc.returncode
            print(f"cli_zygote did not start (exit {code}); running the CLI by exec", file=sys.stderr)
            return
        atexit.register(self.stop)

    def stop(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            assert p.stdin is not None
            p.stdin.close()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(5)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def run(
        self, argv: list[str], cwd: str, env: dict[str, str], data: bytes, timeout: float
    ) -> tuple[int, bytes, bytes]:
        """(exit code as ``subprocess`` gives it, stdout, stderr); ``TimeoutExpired`` as ``run`` raises."""
        payload = json.dumps({"argv": argv, "env": env, "cwd": cwd}).encode()
        deadline = time.monotonic() + timeout
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ours: list[int] = []
        try:
            conn.connect(self.path)
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            ours = [in_w, out_r, err_r]
            try:
                socket.send_fds(conn, [struct.pack("!I", len(payload))], [in_r, out_w, err_w])
                conn.sendall(payload)
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            reader = conn.makefile("rb")
            pid = json.loads(reader.readline())["pid"]
            ours = []  # _communicate closes them, whatever happens
            try:
                out, err = _communicate(in_w, out_r, err_r, data, deadline)
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                line = reader.readline()
            except TimeoutError:
                # the deadline passed: end the run as subprocess.run does, by its pid
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(argv, timeout) from None
            if not line:
                raise RuntimeError(f"the CLI fork server ended during a run (pid {pid})")
            status = json.loads(line)["status"]
            return os.waitstatus_to_exitcode(status), out, err
        finally:
            for fd in ours:
                os.close(fd)
            conn.close()


def _communicate(in_w: int, out_r: int, err_r: int, data: bytes, deadline: float) -> tuple[bytes, bytes]:
    """Write stdin and read stdout and stderr to their ends (closes the three fds)."""
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
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            for key, _ in sel.select(left):
                fd = key.fd
                if fd == in_w:
                    try:
                        view = view[os.write(in_w, view[:65536]) :]
                    except BrokenPipeError:
                        view = view[:0]  # the run stopped reading, as subprocess ignores
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
    except BaseException:
        for key in list(sel.get_map().values()):
            os.close(key.fd)
        raise
    finally:
        sel.close()
    return b"".join(chunks[out_r]), b"".join(chunks[err_r])


_ZYGOTE = _Zygote()


def run_console_script(
    cmd: list[str] | list[bytes], cwd: Path, env: dict[str, str], data: bytes, timeout: float
) -> tuple[int, bytes, bytes]:
    """Run ``cmd`` (the console script and its arguments) as a process of its own."""
    argv = [os.fsdecode(a) for a in cmd]
    size = sum(len(os.fsencode(a)) for a in argv) + sum(len(k) + len(v) for k, v in env.items())
    small = max(len(os.fsencode(a)) for a in argv) <= FORK_MAX_ARG and size <= FORK_MAX_TOTAL
    if small and _ZYGOTE.usable_for(env):
        return _ZYGOTE.run(argv, str(cwd), env, data, timeout)
    p = subprocess.run(cmd, cwd=cwd, env=env, input=data, capture_output=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr
