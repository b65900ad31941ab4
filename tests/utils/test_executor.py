"""The daemon executor: ThreadPoolExecutor's results and errors, deadlines that name what overran, and a call blocked
forever that does not keep the interpreter from exiting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from vlmrl.utils.executor import DaemonExecutor, DeadlineExceeded


def test_a_call_past_its_deadline_raises_naming_it_and_the_pool_keeps_serving():
    pool = DaemonExecutor(2, "t")
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="^generate did not finish within 0.2 s$"):
        pool.call("generate", release.wait, timeout_s=0.2, poll_s=0.05)
    assert time.monotonic() - started < 5
    assert pool.call("add", lambda: 1 + 1, timeout_s=5) == 2, "the second worker serves while the first is stuck"
    release.set()
    pool.shutdown()


def test_errors_come_back_as_they_were_raised_even_a_timeout_error():
    pool = DaemonExecutor(1, "t")
    with pytest.raises(KeyError, match="'x'"):
        pool.call("load", lambda: {}["x"], timeout_s=5)

    def own_timeout():
        raise TimeoutError("the tool's own network timeout")

    with pytest.raises(TimeoutError, match="the tool's own") as info:
        pool.call("fetch", own_timeout, timeout_s=5)
    assert not isinstance(info.value, DeadlineExceeded), "the function's timeout is not the deadline"
    pool.shutdown()


def test_check_ends_the_wait_early():
    pool = DaemonExecutor(1, "t")
    dead = threading.Event()
    threading.Timer(0.2, dead.set).start()

    def check():
        if dead.is_set():
            raise RuntimeError("process 123 exited")

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="process 123 exited"):
        pool.call("generate", threading.Event().wait, timeout_s=600, check=check, poll_s=0.05)
    assert time.monotonic() - started < 60
    pool.shutdown(wait=False)


def test_shutdown_refuses_new_work_and_cancels_queued_work():
    pool = DaemonExecutor(1, "t")
    release = threading.Event()
    busy = pool.submit(release.wait)
    queued = pool.submit(lambda: "never")
    pool.shutdown(wait=False, cancel_futures=True)
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: 1)
    release.set()
    assert busy.result(timeout=30) is True


def test_a_call_blocked_forever_does_not_keep_the_process_from_exiting(tmp_path):
    """The agent loop's tool pool and each engine's call thread: results and errors come back like
    ThreadPoolExecutor's, and a call that never returns (a network read without a timeout) leaves the interpreter
    free to exit once the run is done."""
    script = tmp_path / "blocked.py"
    script.write_text(textwrap.dedent("""
        import threading
        from vlmrl.utils.executor import DaemonExecutor, DeadlineExceeded

        pool = DaemonExecutor(2, "t")
        assert pool.submit(lambda x: x + 1, 1).result() == 2
        failed = pool.submit(lambda: 1 / 0)
        assert isinstance(failed.exception(), ZeroDivisionError)
        never = threading.Event()
        pool.submit(never.wait)  # blocked forever
        assert pool.submit(lambda: "still serving").result() == "still serving"
        try:
            pool.call("wait forever", never.wait, timeout_s=0.1)
        except DeadlineExceeded:
            pass
        pool.shutdown(wait=False, cancel_futures=True)
        print("done")
    """))
    # The timeout only turns a hang (the bug) into a failure instead of a stuck test run.
    finished = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert finished.stdout.strip() == "done"
