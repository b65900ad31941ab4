"""vLLM's sleep mode on a GPU (vLLM refuses it on CPU): sleep() hands the engine's memory back to the device, and
after wake_up() the engine generates exactly what it generated before (the weights came back from host memory)."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, build_batch

pytestmark = [pytest.mark.vllm, pytest.mark.gpu]

MEMORY_FRACTION = 0.3
"""gpu_memory_utilization of the engine under test: what it may take, weights + KV cache."""


def test_sleep_frees_the_device_memory_and_wake_up_gives_the_same_outputs(tiny_model_path):
    import torch

    from vlmrl.processors.loading import load_processor
    from vlmrl.rollout.registry import get_backend

    requests = build_batch(load_processor(tiny_model_path))
    with get_backend("vllm", tiny_model_path, dtype="float32", max_model_len=1024, timeout_s=300,
                     gpu_memory_utilization=MEMORY_FRACTION, enable_sleep_mode=True, enforce_eager=True) as backend:
        before = backend.generate(requests, GREEDY)
        awake_free, total = torch.cuda.mem_get_info()  # the whole device, whichever process the engine runs in
        backend.sleep()
        asleep_free, _ = torch.cuda.mem_get_info()
        backend.wake_up()
        after = backend.generate(requests, GREEDY)
    released = asleep_free - awake_free
    # level-1 sleep drops the KV cache and moves the weights to host memory: most of what the engine took
    assert released >= 0.5 * MEMORY_FRACTION * total, (
        f"sleep() released {released / 2**30:.2f} GiB of the {MEMORY_FRACTION * total / 2**30:.1f} GiB the engine "
        "may take")
    for request, first, again in zip(requests, before, after):
        assert again.response_ids == first.response_ids, f"{request.uid}: other tokens after wake_up()"
        diff = max(abs(a - b) for a, b in zip(first.response_logprobs, again.response_logprobs))
        assert diff <= 1e-5, f"{request.uid}: logprobs moved by {diff:.2e} after wake_up()"
