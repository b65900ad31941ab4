"""vLLM (in-process, float32) on the embedded Qwen3-VL-MoE against transformers: greedy == HF token for token on
nine requests with 0-2 images, and expert weight sync (vLLM's CPU MoE kernel repacks the experts on a reload only
because vlmrl's worker extension asks it to: without that, the push fails or loads the wrong packing)."""

from __future__ import annotations

import pytest

from tests.moe.contract import MoEContract
from tests.rollout.helpers import GREEDY, LOGPROB_TOL, greedy_problems

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(qwen3_vl_moe_path):
    from vlmrl.rollout.registry import get_backend

    with get_backend("vllm", qwen3_vl_moe_path, dtype="float32", max_model_len=1024, timeout_s=300) as started:
        yield started


@pytest.fixture(scope="module")
def hf(hf_qwen3_vl_moe):
    return hf_qwen3_vl_moe


@pytest.fixture(scope="module")
def batch(moe_batch):
    return moe_batch


class TestVLLMQwen3VLMoE(MoEContract):
    def test_greedy_equals_hf(self, backend, batch, hf_qwen3_vl_moe_greedy):
        """Nine requests with 0, 1 and 2 images: HF's ids token for token, its logprobs to float rounding."""
        results = backend.generate(batch, GREEDY)
        problems = greedy_problems(hf_qwen3_vl_moe_greedy, results, backend.name, LOGPROB_TOL)
        assert not problems, "\n".join(problems)
