"""Helpers shared by the peer drivers. Standard library only: each peer runs in its own virtual
environment (``bench/.peers/NAME``), which has the peer but not stepwarden."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def on_signals_exit() -> None:
    """SIGTERM/SIGINT raise SystemExit, so the driver's ``finally`` ends the worker it started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))


def parser(doc: str | None) -> argparse.ArgumentParser:
    on_signals_exit()
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--db", required=True, help="sqlite file path or postgresql:// URL")
    ap.add_argument("--workload", choices=("w1", "w2"), required=True)
    ap.add_argument("--tasks", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--work", required=True, help="a scratch folder for logs")
    ap.add_argument("--timeout", type=float, default=600.0)
    return ap


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(HERE) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


def start(cmd: list[str], log: Path, environ: dict[str, str]) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(cmd, env=environ, stdout=out, stderr=subprocess.STDOUT, cwd=str(HERE))


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace: float = 20.0) -> None:
    """End one process we started, by its pid: ``sig`` first, SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, sig)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def wait_until(
    check: Callable[[], Any], timeout: float, every: float = 0.02, proc: subprocess.Popen[bytes] | None = None
) -> Any:
    """Poll ``check`` until it returns something truthy; bounded by ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the worker exited with code {proc.returncode}")
        if time.monotonic() > end:
            raise TimeoutError(f"not done after {timeout}s")
        time.sleep(every)


def report(**fields: Any) -> None:
    """The driver's one line of output, read by bench/run.py."""
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()


def publish(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` for a process that polls for it: written whole beside it, then
    renamed into place, so the reader never finds the file before its content (with a plain write
    it may see it empty, between the open that creates it and the write)."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
