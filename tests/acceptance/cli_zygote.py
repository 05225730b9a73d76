"""A fork server for the console script: the CLI tests' ``stepwarden`` runs without paying its imports.

Each ``stepwarden`` a test runs used to be a fresh interpreter that imported click, asyncio, rich,
psycopg and stepwarden itself: ~0.3 s of CPU per run on a 2-core machine, a third of the suite's
time over ~1,000 runs. This process imports them once and forks a child per run. The child is a
real process of its own, with the test's stdin, stdout, stderr, environment, working directory and
``argv``, whose exit status (a code, or the signal that ended it) the test receives as from
``subprocess``. The child leaves this module's loop and runs ``sys.exit(main())`` at top level,
like the console script, so the interpreter exits as a real run does (atexit handlers, the join of
non-daemon threads, the flush of stdio).

What a fork cannot reproduce, the client (``helpers.sw``) leaves to a real ``exec``: an
environment whose interpreter settings (``PYTHON*``, ``LANG``, ``LC_*``) differ from this
server's, and arguments too large for ``execve``. ``STEPWARDEN_TEST_SPAWN_CLI=1`` sends every run
through ``exec``.

Protocol, per run, over a Unix socket: the client sends a 4-byte length with three file
descriptors (the child's stdin, stdout, stderr), then that many bytes of JSON (``argv``, ``env``,
``cwd``). The server answers one JSON line with the child's pid, and later one with its wait
status. The server exits when its stdin (a pipe its parent never writes) reaches EOF: when the
test process ends, however it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import struct
import sys
import tempfile
import threading


def _preload() -> None:
    """What a CLI run imports before it does anything, for either store."""
    import psycopg  # noqa: F401
    import psycopg_pool  # noqa: F401
    import rich.console
    import rich.table  # noqa: F401

    import stepwarden.cli
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


def serve(path: str) -> None:
    """Answer runs until stdin closes; returns only in a forked child, ready to run the CLI."""
    _preload()
    if threading.active_count() != 1:  # a fork of a threaded process could inherit a held lock
        sys.stderr.write("cli_zygote: the imports started a thread; refusing to fork\n")
        sys.exit(3)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ, "lifeline")
    sel.register(listener, selectors.EVENT_READ, "listener")
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the client's connection)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in sel.select():
            if key.data == "lifeline":
                if not os.read(0, 4096):
                    os._exit(0)  # the test process is gone: its runs go on, as exec'd ones would
            elif key.data == "listener":
                conn, _ = listener.accept()
                try:
                    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
                    if len(head) < 4:
                        head += _read_exactly(conn, 4 - len(head))
                    (size,) = struct.unpack("!I", head)
                    request = json.loads(_read_exactly(conn, size))
                except (OSError, EOFError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    for fd, (_, other) in running.items():
                        os.close(fd)
                        other.close()
                    sel.close()
                    listener.close()
                    conn.close()
                    _become(request, fds)
                    return
                for fd in fds:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                running[pidfd] = (pid, conn)
                sel.register(pidfd, selectors.EVENT_READ, "child")
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            else:
                pidfd = key.fd
                pid, conn = running.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # a client past its timeout has gone
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                conn.close()


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
    serve(sys.argv[1])
    # Only a forked child gets here: the console script's own last line.
    from stepwarden.cli import main

    sys.exit(main())  # type: ignore[func-returns-value]  # as the console script has it
