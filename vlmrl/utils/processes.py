"""Process care on psutil: is a process alive, wait for it to exit, kill it with its children, and environment
variables set only for a while (`env_override`)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import psutil


def is_alive(pid: int) -> bool:
    """The process exists and is not a zombie (one that exited and waits for its parent to reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for_exit(pid: int, timeout_s: float) -> bool:
    """Waits up to `timeout_s` for the process to end; True when it has (or never existed)."""
    try:
        psutil.Process(pid).wait(timeout=timeout_s)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return not is_alive(pid)
    return True


def kill_tree(pid: int, grace_s: float = 5.0) -> None:
    """Ends a process and all its descendants: SIGTERM, then SIGKILL for whatever is left after `grace_s`
    (grace_s=0: SIGKILL at once). A process already gone is skipped. Killed children are not reaped here: their
    owner (e.g. multiprocessing) reaps them."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    alive = procs
    if grace_s > 0:
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def kill_process_group(process: subprocess.Popen, grace_s: float = 0.0) -> None:
    """Ends the process group led by `process` (started with start_new_session=True), so also the processes it
    started that have left its tree: SIGTERM, then SIGKILL after `grace_s` (grace_s=0: SIGKILL at once). Reaps
    `process`. The group is signalled only while `process` is unreaped, when its pid cannot belong to another."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
            process.wait(timeout=grace_s or None)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextmanager
def env_override(values: Mapping[str, str | None]) -> Iterator[None]:
    """Sets environment variables (None = unset) for the `with` block, then puts back what was there, even when the
    block raises.

    >>> with env_override({"VLMRL_DOCTEST": "1"}):
    ...     os.environ["VLMRL_DOCTEST"]
    '1'
    >>> "VLMRL_DOCTEST" in os.environ
    False
    """
    saved = {key: os.environ.get(key) for key in values}
    try:
        for key, value in values.items():
            _set(key, value)
        yield
    finally:
        for key, value in saved.items():
            _set(key, value)


def _set(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
