"""SGLang HTTP server (launched by vlmrl, fp32, CPU) on the embedded Qwen3-VL (its engine contract is a line of
tests/rollout/test_family_contract.py): the mrope setting passed as a server flag where config.json lacks it,
and checked on a server given by URL. The multimodal embedding cache stays off: SGLang crashes on the salted mm_hashes
that would make it safe across weight syncs for Qwen3-VL, so vlmrl refuses to turn it on."""

from __future__ import annotations

import pytest

from tests.rollout.helpers import (
    GREEDY,
    LOGPROB_TOL,
    greedy_mismatch,
    max_drift_from_hf,
)
from vlmrl.rollout.errors import RolloutError
from vlmrl.rollout.registry import get_backend

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend(shared_engines):
    return shared_engines.get("sglang-server", "tiny-qwen3-vl")


def test_multimodal_cache_is_refused_before_any_server_starts(tiny_model_path):
    with pytest.raises(ValueError, match="vlm_cache_size_mb=100 on Qwen3-VL.*set vlm_cache_size_mb=0"):
        get_backend("sglang-server", tiny_model_path, max_model_len=1024, vlm_cache_size_mb=100)


# A variant (marker `full`, make test-all): a second server started on a config without the interleaving flag. make
# test keeps the in-process SGLang engine on that config (tests/rollout/qwen3_vl/test_sglang.py) and the server-flag
# construction (tests/rollout/test_options.py).
@pytest.mark.full
def test_server_flag_for_a_config_without_interleaving(backend, flagless_model_path, hf, batch, hf_greedy):
    """A server vlmrl launches on a config without `mrope_interleaved` gets --json-model-override-args: HF's
    outputs; a client given that server's URL reads the setting back and accepts it. A server started on the config
    as it is (family_engine_settings=false) is refused by a default client, naming the flag to restart it with."""
    backend.close()  # one server at a time: this module's is not needed any more
    with get_backend("sglang-server", flagless_model_path, dtype="float32", max_model_len=1024,
                     timeout_s=300) as fixed:
        results = fixed.generate(batch, GREEDY)
        with get_backend("sglang-server", flagless_model_path, url=fixed.url, max_model_len=1024) as client:
            assert client.generate(batch[3:4], GREEDY)[0].response_ids == hf_greedy[3].response_ids
    problems = [m for ref, got in zip(hf_greedy, results) if (m := greedy_mismatch(ref, got, "sglang-server"))]
    assert not problems, "\n".join(problems)
    assert max_drift_from_hf(hf, batch, results) < LOGPROB_TOL
    with get_backend("sglang-server", flagless_model_path, dtype="float32", max_model_len=1024, timeout_s=300,
                     family_engine_settings=False) as raw:
        with pytest.raises(RolloutError, match="sglang-server: the server at .*mrope_interleaved.*"
                                               "--json-model-override-args"):
            get_backend("sglang-server", flagless_model_path, url=raw.url, max_model_len=1024)
        with get_backend("sglang-server", flagless_model_path, url=raw.url, max_model_len=1024,
                         family_engine_settings=False) as accepted:
            drifted = accepted.generate(batch[3:], GREEDY)
    assert max_drift_from_hf(hf, batch[3:], drifted) > 100 * LOGPROB_TOL
