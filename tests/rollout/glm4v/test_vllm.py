"""vLLM (in-process, fp32) on the embedded GLM-4.1V against transformers (its engine contract: a line of
tests/rollout/test_family_contract.py): the `attention_bias` setting vlmrl passes
where config.json lacks it."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, LOGPROB_TOL, greedy_mismatch, max_drift_from_hf

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(vllm_glm4v):
    return vllm_glm4v


def test_config_without_attention_bias_gets_the_setting_and_matches_hf(biasless_model_path, hf, batch, hf_greedy):
    """On a config without `attention_bias` vlmrl starts vLLM with it (hf_overrides): HF's outputs. Started on that
    config as it is (family_engine_settings=false) vLLM drops the q/k/v biases without an error and drifts from
    HF, even on text alone, which is what the override prevents; the family names the problem before a start."""
    from vlmrl.models.families import GLM4V, read_model_config
    from vlmrl.rollout.registry import get_backend

    assert any("attention_bias" in p for p in GLM4V.engine_problems(read_model_config(biasless_model_path), "vllm"))
    with get_backend("vllm", biasless_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as fixed:
        results = fixed.generate(batch, GREEDY)
        problems = [m for ref, got in zip(hf_greedy, results) if (m := greedy_mismatch(ref, got, "vllm"))]
        assert not problems, "\n".join(problems)
        assert max_drift_from_hf(hf, batch, results) < LOGPROB_TOL
    text = [r for r in batch if not r.images]
    with get_backend("vllm", biasless_model_path, dtype="float32", max_model_len=1024, timeout_s=300,
                     family_engine_settings=False) as raw:
        drifted = raw.generate(text, GREEDY)
    assert max_drift_from_hf(hf, text, drifted) > 100 * LOGPROB_TOL, "vLLM built the biases without being told"
