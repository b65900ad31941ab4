"""vLLM (in-process, fp32) on the embedded Qwen3-VL against transformers: the mrope setting that vlmrl passes where config.json lacks it."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, LOGPROB_TOL, greedy_mismatch, max_drift_from_hf

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(vllm_qwen3_vl):
    return vllm_qwen3_vl


def test_config_without_interleaving_gets_the_setting_and_matches_hf(flagless_model_path, hf, batch, hf_greedy):
    """On a config without `mrope_interleaved` vlmrl starts vLLM with it (hf_overrides): HF's outputs. Started on
    that config as it is (family_engine_settings=false) vLLM drifts from HF, which is what the override prevents."""
    from vlmrl.rollout.registry import get_backend

    images = [r for r in batch if r.images]
    with get_backend("vllm", flagless_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as fixed:
        results = fixed.generate(batch, GREEDY)
    problems = [m for ref, got in zip(hf_greedy, results) if (m := greedy_mismatch(ref, got, "vllm"))]
    assert not problems, "\n".join(problems)
    assert max_drift_from_hf(hf, batch, results) < LOGPROB_TOL
    with get_backend("vllm", flagless_model_path, dtype="float32", max_model_len=1024, timeout_s=300,
                     family_engine_settings=False) as raw:
        drifted = raw.generate(images, GREEDY)
    assert max_drift_from_hf(hf, images, drifted) > 100 * LOGPROB_TOL, "the engine interleaves without being told"
