"""What the vLLM backend's logprobs are of, and in which dtype they were computed: rollout.vllm.engine_kwargs can
replace the raw logprobs vlmrl asks for, so the mode is checked at start (as SGLang's backend probes its own), and
the engine's own report of both is what a validation artifact records."""

from __future__ import annotations

import logging

import pytest

from vlmrl.rollout.errors import RolloutError
from vlmrl.rollout.vllm import check_logprobs_mode

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logits"])
def test_a_logits_mode_is_refused_before_the_engine_starts(tiny_model_path, mode):
    """Logits are not logprobs: refused naming the key and what to do, before vLLM is imported or started."""
    from vlmrl.rollout.registry import get_backend

    with pytest.raises(RolloutError, match=f"engine_kwargs.logprobs_mode={mode} makes the engine return logits.*"
                                           "remove the key"):
        get_backend("vllm", tiny_model_path, dtype="float32", engine_kwargs={"logprobs_mode": mode})


def test_processed_logprobs_start_with_a_warning_that_names_what_they_break(caplog):
    """processed_logprobs is how compare shows an engine that returns them (tests/alignment/test_compare_precision.py
    starts a real one): allowed, with a warning naming what training on them gets wrong."""
    with caplog.at_level(logging.WARNING, logger="vlmrl.rollout.vllm"):
        check_logprobs_mode("raw_logprobs")
        assert caplog.text == ""
        check_logprobs_mode("processed_logprobs")
    assert "Old logprobs taken from the engine, rollout correction and mismatch/* are then off" in caplog.text


def test_the_engine_reports_its_dtype_and_raw_logprobs(vllm_qwen2_5_vl):
    """The shared engine (started with dtype float32): what it reports, which the artifact's header records."""
    assert (vllm_qwen2_5_vl.dtype, vllm_qwen2_5_vl.logprobs_mode) == ("float32", "raw_logprobs")
