"""SGLang Engine (fp32, CPU) on the embedded Qwen3-VL against transformers: the mrope setting vlmrl passes (json_model_override_args) where config.json lacks it."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import GREEDY, LOGPROB_TOL, greedy_mismatch, max_drift_from_hf

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend(sglang_qwen3_vl):
    return sglang_qwen3_vl


# A variant (marker `full`, make test-all): the second family of the same setting. make test keeps SGLang on Qwen3.5's
# config without the keys SGLang reads (tests/rollout/qwen3_5/test_sglang.py, mrope_interleaved among them, through
# the same family overrides), vLLM on this flag-less config (tests/rollout/qwen3_vl/test_vllm.py) and the server flag
# built for it (tests/rollout/test_options.py).
@pytest.mark.full
def test_config_without_interleaving_gets_the_setting_and_matches_hf(flagless_model_path, hf, batch, hf_greedy):
    """On a config without `mrope_interleaved` vlmrl starts SGLang with it: HF's outputs, token for token."""
    from vlmrl.rollout.registry import get_backend

    with get_backend("sglang", flagless_model_path, dtype="float32", max_model_len=1024, timeout_s=300) as fixed:
        results = fixed.generate(batch, GREEDY)
    problems = [m for ref, got in zip(hf_greedy, results) if (m := greedy_mismatch(ref, got, "sglang"))]
    assert not problems, "\n".join(problems)
    assert max_drift_from_hf(hf, batch, results) < LOGPROB_TOL
