"""``App.store`` opened by two threads at once (a web server's first two requests on a fresh app):
one store, opened once. Each thread used to open its own, and all but one were left open, with
their connections and threads, never closed."""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

import stepwarden.app
from stepwarden import App
from stepwarden.store import Store
from stepwarden.store import open_store as real_open_store


class TellsWhenWaitedFor:
    """The app's lock, setting ``waiting`` when a thread finds it taken (and then waits for it)."""

    def __init__(self, lock: Any, waiting: threading.Event) -> None:
        self.lock = lock
        self.waiting = waiting

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            self.waiting.set()
            self.lock.acquire()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.lock.release()


def test_two_threads_asking_a_fresh_app_for_its_store_get_the_one_store_opened_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first opening waits until the other thread is inside ``app.store`` too, calling
    ``open_store`` itself or waiting for the first one's: no timing is assumed."""
    app = App(f"sqlite:///{tmp_path / 'store.db'}")
    other_arrived = threading.Event()
    lock = getattr(app, "_store_lock", threading.Lock())
    app._store_lock = TellsWhenWaitedFor(lock, other_arrived)  # type: ignore[assignment]
    opened: list[Store] = []
    calls = 0
    counting = threading.Lock()

    def open_store(*args: Any, **kwargs: Any) -> Store:
        nonlocal calls
        with counting:
            calls += 1
            first = calls == 1
        if first:
            assert other_arrived.wait(30), "the other thread never came"
        else:
            other_arrived.set()
        store = real_open_store(*args, **kwargs)
        opened.append(store)
        return store

    monkeypatch.setattr(stepwarden.app, "open_store", open_store)
    got: list[Store] = []
    threads = [threading.Thread(target=lambda: got.append(app.store)) for _ in range(2)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert len(got) == 2 and got[0] is got[1], "both threads get the same store"
        assert len(opened) == 1, f"{len(opened)} stores opened for one app"
    finally:
        for s in opened:
            s.close()
