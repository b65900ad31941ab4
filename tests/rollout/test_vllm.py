"""vLLM backend (in-process, fp32) against the HF reference: (its engine contract: tests/rollout/test_family_contract.py) greedy
agreement with HF on an image prompt, seeds, and the full-state-dict rule of vLLM's weight reload."""

from __future__ import annotations

import logging

import pytest

from tests.rollout.helpers import GREEDY, clone_state, greedy_mismatch
from vlmrl.types import SamplingParams

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(vllm_qwen2_5_vl):
    assert vllm_qwen2_5_vl.engine_pids == [], "the tests run vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
    return vllm_qwen2_5_vl


def test_vllm_greedy_on_an_image_prompt_equals_hf_token_for_token_fp32(backend, hf, batch):
    """In-process vLLM's greedy output for a prompt with an image equals HF's token for token (fp32)."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16, top_logprobs=5)
    (ref,), (got,) = hf.generate([batch[4]], sampling), backend.generate([batch[4]], sampling)
    assert got.response_ids == ref.response_ids, greedy_mismatch(ref, got, "vllm")


def test_seeded_sampling_is_reproducible(backend, batch):
    """The same seed gives the same samples; another seed other samples; samples of one request differ."""
    seeded = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=1234)
    first = [r.response_ids for r in backend.generate(batch[:4], seeded)]
    again = [r.response_ids for r in backend.generate(batch[:4], seeded)]
    other = [r.response_ids for r in backend.generate(batch[:4], SamplingParams(**{**seeded.__dict__, "seed": 99}))]
    assert first == again
    assert first != other
    assert len({tuple(ids) for ids in first[:4]}) > 1


def test_partial_state_dict_is_refused_and_engine_unharmed(backend, hf, batch, hf_greedy):
    """vLLM's reload re-processes whole layers (a partial push was measured to break the model): refuse it."""
    state = clone_state(hf.model)
    with pytest.raises(ValueError, match="needs exactly the model's"):
        backend.update_weights([("lm_head.weight", state["lm_head.weight"])])
    assert backend.generate([batch[3]], GREEDY)[0].response_ids == hf_greedy[3].response_ids


def test_weight_sync_does_not_warn_about_derived_buffers(backend, hf, batch, hf_greedy):
    """vLLM warns "<Layer>: Failed to load weights" on every sync for layers holding only buffers that no checkpoint
    has (rotary caches, image mean/std); vlmrl filters exactly those, and the sync still lands."""
    from vlmrl.rollout.vllm import RELOAD_LOGGER

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    reload_logger = logging.getLogger(RELOAD_LOGGER)
    reload_logger.addHandler(handler)
    try:
        backend.update_weights(clone_state(hf.model).items())
    finally:
        reload_logger.removeHandler(handler)
    assert not [m for m in seen if "Failed to load weights" in m]
    assert [f for f in reload_logger.filters if type(f).__name__ == "_DerivedBufferFilter"][0].classes >= {
        "RotaryEmbedding", "MRotaryEmbedding"}
    assert backend.generate([batch[3]], GREEDY)[0].response_ids == hf_greedy[3].response_ids
