"""The engines' own routing capture on a GPU (`gpu` tier: vLLM's and SGLang's `enable_return_routed_experts`,
neither of which runs on a CPU): with rollout.*.capture_routing the normal batched generate returns every sample's
routing, and it is transformers' routing of the same tokens in every MoE layer, up to float32 near-ties."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY

NEAR_TIE = 1e-4
"""A pair may differ only where transformers' k-th and (k+1)-th router probabilities are this close: float32 kernels
on a GPU (other reduction orders, TF32 where an engine allows it) move router probabilities by ~1e-6 to 1e-5."""


@pytest.mark.gpu
@pytest.mark.parametrize("name", [pytest.param("vllm", marks=pytest.mark.vllm),
                                  pytest.param("sglang", marks=pytest.mark.sglang)])
def test_the_engines_own_capture_returns_transformers_routing(name, qwen3_vl_moe_path, hf_qwen3_vl_moe, batch):
    from vlmrl.alignment.routing import compare_routing, differing_sets, transformers_routing
    from vlmrl.rollout.registry import get_backend

    with get_backend(name, qwen3_vl_moe_path, dtype="float32", max_model_len=1024, timeout_s=300,
                     gpu_memory_utilization=0.3, capture_routing=True) as backend:
        assert backend.captures_routing()
        results = backend.generate(batch, GREEDY)
    for request, result in zip(batch, results):
        engine = result.routed_experts
        assert engine is not None, f"{name}: {request.uid} came back without its routing"
        ours, margins = transformers_routing(hf_qwen3_vl_moe, request, result.response_ids[:-1])
        assert engine.shape == ours.shape, "one routing per token the engine ran, per MoE layer"
        differs = differing_sets(engine, ours)
        assert (margins[differs] < NEAR_TIE).all(), compare_routing(engine, ours).describe()
