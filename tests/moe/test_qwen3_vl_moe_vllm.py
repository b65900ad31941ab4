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


def test_the_engines_routing_is_transformers_routing(backend, hf, batch):
    """vLLM's own routers, captured on the CPU engine, route every token of the nine requests (expanded prompt and
    response, images included) through transformers' experts in every MoE layer; a pair may differ only where
    transformers' choice was a float32 near-tie (its k-th and (k+1)-th router probabilities within 1e-5)."""
    from vlmrl.alignment.routing import compare_routing, differing_sets, transformers_routing

    pairs = backend.generate_with_routing(batch, GREEDY)
    for request, (result, engine) in zip(batch, pairs):
        ours, margins = transformers_routing(hf, request, result.response_ids[:-1])
        assert engine.shape == ours.shape, "one routing per token the engine ran"
        differs = differing_sets(engine, ours)
        assert (margins[differs] < 1e-5).all(), compare_routing(engine, ours).describe()


def test_a_router_moved_in_the_engine_shows_as_routing_from_its_layer(backend, hf, batch):
    """Only the second MoE layer's router moved in the engine: the comparison with transformers names layer 1 as
    the first whose routing differs, with the first layer's routing untouched."""
    from tests.moe.contract import moved
    from tests.rollout.helpers import clone_state
    from vlmrl.alignment.routing import compare_routing, differing_sets, transformers_routing

    original = clone_state(hf.model)
    backend.update_weights(moved(original, "layers.1.mlp.gate.weight", scale=2.0).items())
    try:
        ((result, engine),) = backend.generate_with_routing(batch[3:4], GREEDY)
    finally:
        backend.update_weights(original.items())
    ours, _ = transformers_routing(hf, batch[3], result.response_ids[:-1])
    agreement = compare_routing(engine, ours)
    assert agreement.first_layer == 1 and agreement.differing_tokens > 0, agreement.describe()
    assert not differing_sets(engine, ours)[0].any()
    assert "the first MoE layer that differs: 1" in agreement.describe()
