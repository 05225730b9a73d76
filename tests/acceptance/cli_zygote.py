"""A fork server for the console script: the CLI tests' ``stepwarden`` runs without paying its imports.

Each ``stepwarden`` a test runs used to be a fresh interpreter that imported click, asyncio, rich
and stepwarden itself: ~0.3 s of CPU per run on a 2-core machine, a third of the suite's time
over ~1,000 runs. This process imports what every run of the console script imports before it
reads its arguments (``stepwarden.cli``; with ``--pg``, also the PostgreSQL store, which a run
given a PostgreSQL URL imports), then forks a child per run. The child is a real process of its
own, with the test's stdin, stdout, stderr, environment, working directory and ``argv``, whose
exit status (a code, or the signal that ended it) the test receives as from ``subprocess``. The
child leaves this module's loop and runs ``sys.exit(main())`` at top level, like the console
script, so the interpreter exits as a real run does (atexit handlers, the join of non-daemon
threads, the flush of stdio).

What a fork does not reproduce, and the client (``cli_runner``) therefore leaves to a real
``exec``: interpreter settings in the environment other than the server's (``PYTHON*``, the
locale, ``TZ``, variables psycopg and OpenTelemetry read at import), a umask or resource limits
other than the server's, a working directory that is not one, an argument or variable too large
for ``execve`` or holding a NUL. Not reproduced at all: every run forked from one server has that
server's hash seed (the CLI orders what it prints, never by hash), and ``/proc/PID/cmdline``
names this script.

Protocol, per run, over a Unix socket: the client sends a 4-byte length with three file
descriptors (the child's stdin, stdout, stderr), then that many bytes of JSON (``argv``, ``env``,
``cwd``). The server answers one JSON line with the child's pid (or an ``error``), and one with
its wait status when it ends. The child waits for a byte from the server before it does anything,
sent once the run is recorded (its pidfd opened and watched): if that fails, the child is killed
having done nothing, and the client runs the command by exec, never twice. Anything the client
sends, or its end of the connection closing before the run ends (a timeout, an interrupted test,
a dead process), kills the run through its pidfd, never a reused pid; the client waits for the
run's end before it raises, as ``subprocess.run`` does. The server exits when its stdin (a pipe
its parent never writes) reaches EOF, killing the runs it still has and removing its folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading


def _preload(pg: bool) -> None:
    import stepwarden.cli

    if pg:
        import stepwarden.store.postgres  # noqa: F401


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = conn.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("client went away mid-request")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _send(conn: socket.socket, message: dict[str, object]) -> None:
    with contextlib.suppress(OSError):  # a client that has gone hears nothing; its run is killed
        conn.sendall(json.dumps(message).encode() + b"\n")


class _Run:
    def __init__(self, pid: int, pidfd: int, conn: socket.socket) -> None:
        self.pid, self.pidfd, self.conn = pid, pidfd, conn
        self.listening = True  # for `kill` or the client's EOF

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # it ended already; its status comes next
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)


def serve(path: str, pg: bool) -> None:
    """Answer runs until stdin closes; returns only in a forked child, ready to run the CLI."""
    _preload(pg)
    if threading.active_count() != 1:  # a fork of a threaded process could inherit a held lock
        sys.stderr.write("cli_zygote: the imports started a thread; refusing to fork\n")
        sys.exit(3)
    probe = os.pidfd_open(os.getpid())  # a kernel or sandbox without pidfds fails here, not per run
    signal.pidfd_send_signal(probe, 0)
    os.close(probe)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ, "lifeline")
    sel.register(listener, selectors.EVENT_READ, "listener")
    runs: dict[int, _Run] = {}  # by pidfd
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in sel.select():
            data = key.data
            if data == "lifeline":
                if not os.read(0, 4096):  # the test process is gone: so is its interest in its runs
                    for run in runs.values():
                        run.kill()
                    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
                    os._exit(0)
            elif data == "listener":
                if _accept(listener, sel, runs):
                    return  # in the child
            elif isinstance(data, _Run):  # the client said `kill`, or went away
                run = data
                if runs.get(run.pidfd) is not run or not run.listening:
                    continue  # it ended earlier in this round: its key is stale
                sel.unregister(run.conn)
                run.listening = False
                run.kill()
            else:  # a pidfd: that run ended
                run = data[1]
                if runs.get(run.pidfd) is not run:
                    continue
                del runs[run.pidfd]
                sel.unregister(run.pidfd)
                if run.listening:
                    sel.unregister(run.conn)
                os.close(run.pidfd)
                _, status = os.waitpid(run.pid, 0)
                _send(run.conn, {"status": status})
                run.conn.close()


def _accept(listener: socket.socket, sel: selectors.BaseSelector, runs: dict[int, _Run]) -> bool:
    """Start the run a client asks for; True in the forked child."""
    conn, _ = listener.accept()
    fds: list[int] = []
    try:
        head, fds, _, _ = socket.recv_fds(conn, 4, 3)
        if len(head) < 4:
            head += _read_exactly(conn, 4 - len(head))
        (size,) = struct.unpack("!I", head)
        request = json.loads(_read_exactly(conn, size))
        if len(fds) != 3:
            raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
        go_r, go_w = os.pipe()
        pid = os.fork()
    except (OSError, EOFError, ValueError) as e:
        _send(conn, {"error": f"{type(e).__name__}: {e}"})
        conn.close()
        for fd in fds:
            os.close(fd)
        return False
    if pid == 0:
        for run in runs.values():
            os.close(run.pidfd)
            run.conn.close()
        sel.close()
        listener.close()
        conn.close()
        os.close(go_w)
        go = os.read(go_r, 1)  # nothing runs before the server has recorded this run
        os.close(go_r)
        if not go:
            os._exit(70)  # the server could not record it: the client runs it by exec instead
        _become(request, fds)
        return True
    os.close(go_r)
    for fd in fds:
        os.close(fd)
    pidfd = -1
    try:
        pidfd = os.pidfd_open(pid)
        run = _Run(pid, pidfd, conn)
        sel.register(pidfd, selectors.EVENT_READ, ("ended", run))
        try:
            sel.register(conn, selectors.EVENT_READ, run)
        except BaseException:
            sel.unregister(pidfd)
            raise
        runs[pidfd] = run
    except (OSError, ValueError) as e:  # the child has done nothing yet: end it, let the client exec
        if pidfd >= 0:
            os.close(pidfd)
        os.close(go_w)
        os.kill(pid, signal.SIGKILL)  # not reaped yet, so this pid is still that child's
        os.waitpid(pid, 0)
        _send(conn, {"error": f"{type(e).__name__}: {e}"})
        conn.close()
        return False
    _send(conn, {"pid": pid})
    os.write(go_w, b"g")
    os.close(go_w)
    return False


def _become(request: dict[str, object], fds: list[int]) -> None:
    """Turn this fork into the run the client asked for (the console script's own process state)."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    argv = request["argv"]
    cwd = request["cwd"]
    assert isinstance(env, dict) and isinstance(argv, list) and isinstance(cwd, str)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [str(a) for a in argv]
    sys.path[0] = os.path.dirname(sys.argv[0])  # as for the console script: its own folder
    tempfile.tempdir = None  # read TMPDIR again, from the run's environment


if __name__ == "__main__":
    serve(sys.argv[1], "--pg" in sys.argv[2:])
    # Only a forked child gets here: the console script's own last line.
    from stepwarden.cli import main

    sys.exit(main())  # type: ignore[func-returns-value]  # as the console script has it
