"""Process helpers on real processes: a tree is killed with its grandchildren, liveness and exit are seen, and
environment overrides are put back even when the block raises."""

from __future__ import annotations

import doctest
import os
import subprocess
import sys
import time

import pytest

import vlmrl.utils.processes
from vlmrl.utils.processes import env_override, is_alive, kill_process_group, kill_tree, wait_for_exit

# A child that starts a grandchild, prints the grandchild's pid, and sleeps; the grandchild sleeps too.
_PARENT = ("import subprocess, sys, time\n"
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
           "print(child.pid, flush=True)\n"
           "time.sleep(600)\n")


def _tree(**popen) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True, **popen)
    return parent, int(parent.stdout.readline())


def test_doctests():
    result = doctest.testmod(vlmrl.utils.processes)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("grace_s", [0.0, 5.0])
def test_kill_tree_ends_the_process_and_its_grandchild(grace_s):
    parent, grandchild = _tree()
    assert is_alive(parent.pid) and is_alive(grandchild)
    kill_tree(parent.pid, grace_s=grace_s)
    parent.wait(timeout=30)
    assert wait_for_exit(grandchild, timeout_s=30) and not is_alive(grandchild)
    assert not is_alive(parent.pid)
    kill_tree(parent.pid)  # already gone: nothing to do, no error


def test_kill_process_group_reaps_the_leader_and_ends_its_group():
    parent, grandchild = _tree(start_new_session=True)
    kill_process_group(parent)
    assert parent.returncode is not None, "reaped"
    assert wait_for_exit(grandchild, timeout_s=30)
    kill_process_group(parent)  # reaped already: its pid may be another's now, so nothing is signalled


def test_wait_for_exit_times_out_on_a_live_process():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = time.monotonic()
        assert wait_for_exit(sleeper.pid, timeout_s=0.2) is False
        assert time.monotonic() - started < 30
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not is_alive(sleeper.pid) and wait_for_exit(sleeper.pid, timeout_s=1)


def test_env_override_sets_unsets_and_restores_even_on_an_exception(monkeypatch):
    monkeypatch.setenv("VLMRL_TEST_KEPT", "before")
    monkeypatch.delenv("VLMRL_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError, match="engine failed to start"):
        with env_override({"VLMRL_TEST_KEPT": None, "VLMRL_TEST_NEW": "1"}):
            assert "VLMRL_TEST_KEPT" not in os.environ and os.environ["VLMRL_TEST_NEW"] == "1"
            raise RuntimeError("engine failed to start")
    assert os.environ["VLMRL_TEST_KEPT"] == "before" and "VLMRL_TEST_NEW" not in os.environ
