"""A vLLM engine whose process dies fails the next call at once with an error naming the backend.

In-process vLLM (what the other tests and the CPU default use) has no process of its own to lose: its death is the
caller's. So this module starts vLLM in its multiprocess mode (the default on GPU), whose engine core runs in a
child process, and kills that process.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.rollout.helpers import GREEDY
from vlmrl.rollout.errors import EngineDeadError
from vlmrl.rollout.registry import get_backend

pytestmark = pytest.mark.vllm


def test_killed_engine_core_fails_next_call_with_clear_error(tiny_model_path, batch, hf_greedy):
    backend = get_backend("vllm", tiny_model_path, dtype="float32", max_model_len=1024, multiprocess=True,
                          timeout_s=300)
    try:
        assert len(backend.engine_pids) == 1
        assert backend.generate(batch[3:4], GREEDY)[0].response_ids == hf_greedy[3].response_ids
        os.kill(backend.engine_pids[0], signal.SIGKILL)
        # EngineDeadError, not EngineTimeoutError: the death is seen, not waited out (timeout_s is 300 s).
        with pytest.raises(EngineDeadError, match="^vllm: "):
            backend.generate(batch[3:4], GREEDY)
        with pytest.raises(EngineDeadError, match="^vllm: .*unusable"):
            backend.generate(batch[:1], GREEDY)
    finally:
        backend.close()
