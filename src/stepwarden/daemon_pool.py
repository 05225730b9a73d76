"""The agents' thread pools: threads that never hold the process at its exit.

A plain operation runs in a thread and cannot be interrupted (AGT4, AGT7). With the standard
``ThreadPoolExecutor`` its threads are joined when the interpreter exits, with no bound: the CLI's
worker exits past them (``os._exit``), but an application that runs a worker from Python, and
returns from ``asyncio.run`` after the worker stopped, hung at its exit for as long as the call
did, for good if it never returned. These threads are daemon threads and are not registered for
that join: the process exits as the CLI's does, the call's result discarded (its attempt was
handed back when the worker stopped). The standard pool cannot be told so without its private
parts, and what it does here is small: start threads up to a bound, hand them calls in order,
drop the queued calls at shutdown.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

_Call = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonPool(Executor):
    """``submit`` and ``shutdown`` as ``ThreadPoolExecutor`` has them, on daemon threads (up to
    ``max_workers``, started as calls come and no thread is idle), named ``PREFIX_N`` as its are."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self.max_workers = max_workers
        self.prefix = thread_name_prefix
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one release per thread waiting for a call
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._calls.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self.max_workers:
                # The thread holds the queue and the semaphore, not the pool: a pool dropped
                # without shutdown is collected, and its finalizer ends the idle threads.
                thread = threading.Thread(
                    target=_work,
                    args=(self._calls, self._idle),
                    name=f"{self.prefix}_{len(self._threads)}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)
                if len(self._threads) == 1:
                    weakref.finalize(self, self._calls.put, None)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more calls; with ``cancel_futures`` the queued ones are cancelled. The running ones
        run on (waited for only with ``wait``)."""
        with self._lock:
            self._shut = True
            if cancel_futures:
                while True:
                    try:
                        call = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    if call is not None:
                        call[0].cancel()
            self._calls.put(None)  # each thread passes it on as it ends
            threads = list(self._threads)
        if wait:
            for thread in threads:
                thread.join()


def _work(calls: queue.SimpleQueue[_Call | None], idle: threading.Semaphore) -> None:
    """A pool thread: run the calls in order until the end (None, passed on to the next thread)."""
    while True:
        call = calls.get()
        if call is None:
            calls.put(None)
            return
        future, fn, args, kwargs = call
        if future.set_running_or_notify_cancel():
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # as ThreadPoolExecutor: the caller sees it, the thread goes on
                future.set_exception(e)
            else:
                future.set_result(result)
        del call, future, fn, args, kwargs
        idle.release()
