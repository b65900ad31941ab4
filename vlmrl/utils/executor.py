"""One thread pool for calls that may never return: daemon threads, and calls waited on under a deadline.

Python cannot stop a thread. `concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so
one call blocked forever (a hung engine, a network read without a timeout) would keep a finished run from ever
exiting; a daemon thread does not. `DaemonExecutor` keeps ThreadPoolExecutor's contract (submit, Future, shutdown)
on daemon threads, started as needed up to `workers`, and `call` waits for one call under a deadline, checking the
world (`check`) while it waits.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future
from concurrent.futures import wait as wait_for_futures
from typing import Any, TypeVar

T = TypeVar("T")


class DeadlineExceeded(TimeoutError):
    """A call ran past its deadline; the message names the call. Its thread may still be running it."""


class DaemonExecutor(Executor):
    """ThreadPoolExecutor's contract on daemon threads (named `<name>_<i>`), started as needed up to `workers`."""

    def __init__(self, workers: int, name: str):
        if workers < 1:
            raise ValueError(f"{name}: an executor needs at least one worker, got {workers}")
        self._workers, self._name = workers, name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shut = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: Future = Future()
            self._queue.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._workers:
                thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)
            return future

    def call(self, what: str, fn: Callable[[], T], timeout_s: float, *, check: Callable[[], None] | None = None,
             poll_s: float = 0.5) -> T:
        """fn() on a pool thread; its result, or its exception re-raised here.

        Raises DeadlineExceeded ("<what> did not finish within <timeout_s> s") when it is not done by then (the
        thread stays busy with it). While waiting, `check()` runs every `poll_s`: whatever it raises ends the wait
        early (e.g. the process that would answer has died)."""
        future = self.submit(fn)
        deadline = time.monotonic() + timeout_s
        while True:
            done, _ = wait_for_futures([future], timeout=max(0.0, min(poll_s, deadline - time.monotonic())),
                                       return_when=FIRST_COMPLETED)
            if done:
                return future.result()
            if check is not None:
                check()
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"{what} did not finish within {timeout_s:g} s")

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
                    future.set_exception(err)
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Threads end after their current call; with wait=False a call blocked forever stays, as a daemon."""
        with self._lock:
            self._shut = True
            if cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in self._threads:
                self._queue.put(None)
        if wait:
            for thread in self._threads:
                thread.join()
