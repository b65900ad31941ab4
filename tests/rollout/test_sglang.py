"""SGLang Engine backend (fp32, CPU) against the HF reference: (its engine contract: tests/rollout/test_family_contract.py) greedy
agreement with HF on an image prompt, and a killed scheduler (last: it ends this module's engine)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.rollout.helpers import GREEDY, greedy_mismatch, is_near_tie_or_equal
from vlmrl.rollout.errors import EngineDeadError
from vlmrl.types import SamplingParams

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend(sglang_qwen2_5_vl):
    # Default options: the multimodal embedding cache is off (SGLANG_VLM_CACHE_SIZE_MB=0) and hashes are salted.
    return sglang_qwen2_5_vl


def test_sglang_greedy_on_an_image_prompt_equals_hf_or_near_tie_fp32(backend, hf, batch):
    """The SGLang Engine's greedy output for a prompt with an image equals HF's in fp32, or its first
    divergence is a near-tie (both tokens within the other's top-5). Measured: equal."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16, top_logprobs=5)
    (ref,), (got,) = hf.generate([batch[4]], sampling), backend.generate([batch[4]], sampling)
    assert is_near_tie_or_equal(ref, got, "sglang"), greedy_mismatch(ref, got, "sglang")


def test_an_idle_engine_leaves_the_cpu_to_the_trainer(backend, batch):
    """On a CPU the engine is started with sleep_on_idle: between calls its processes wait on their sockets
    instead of polling them, which held a whole core (of this machine's 2) that the trainer beside it trains on.
    The bound is far from both: a polling scheduler uses about 1 core, a sleeping one about 0.02."""
    import time

    import psutil

    backend.generate(batch[:1], GREEDY)
    processes = [psutil.Process(pid) for pid in backend.engine_pids]

    def cpu_seconds():
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    start, began = cpu_seconds(), time.monotonic()
    time.sleep(2.0)
    cores = (cpu_seconds() - start) / (time.monotonic() - began)
    assert cores < 0.2, f"the idle engine's processes used {cores:.2f} cores"


@pytest.mark.ends_engine
def test_killed_scheduler_fails_next_call_fast_with_clear_error(backend, batch):
    """SGLang's own calls hang forever once the scheduler is gone; the backend names the dead process instead,
    and the caller (this test process) survives SGLang's SIGQUIT machinery."""
    scheduler = backend.engine_pids[0]
    os.kill(scheduler, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=f"^sglang: .*pid {scheduler}"):  # not EngineTimeoutError (300 s)
        backend.generate(batch[:2], GREEDY)
    with pytest.raises(EngineDeadError, match="^sglang: .*unusable"):
        backend.generate(batch[:1], GREEDY)
