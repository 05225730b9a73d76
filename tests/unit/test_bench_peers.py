"""The peer drivers' hand-over files: a driver polls for a file that the peer's worker writes
(Huey's time of its last completion, DBOS's ready mark) and reads it as soon as it exists."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers"


def _common() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_peers_common", PEERS / "common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_published_file_is_never_seen_before_its_content(tmp_path: Path) -> None:
    """A plain write creates the file, then fills it: a reader in between read '' (a Huey W1
    repetition was lost to it in run s26: "could not convert string to float: ''")."""
    publish = _common().publish
    n = 400
    seen: list[str] = []
    stop = threading.Event()

    def read_each() -> None:
        for i in range(n):
            path = tmp_path / f"done.{i}"
            while not path.exists():
                if stop.is_set():
                    return
            seen.append(path.read_text())

    reader = threading.Thread(target=read_each)
    reader.start()
    try:
        for i in range(n):
            publish(tmp_path / f"done.{i}", repr(1_700_000_000.0 + i))
    finally:
        reader.join(timeout=30)
        stop.set()
    assert len(seen) == n
    assert [float(x) for x in seen] == [1_700_000_000.0 + i for i in range(n)]
    assert not list(tmp_path.glob("*.part"))
