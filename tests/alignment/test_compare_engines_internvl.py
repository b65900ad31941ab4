"""The compare tool on the embedded InternVL3.5 (fp32, CPU) with the real engines: HF and vLLM agree exactly, SGLang
(text-form requests through its Transformers fallback) agrees with vLLM exactly, and the trainer (1-D positions,
tiles, packed and chunked) scores vLLM's samples exactly."""

from __future__ import annotations

import pytest

from tests.alignment.test_compare_engines import compare_in_process, family_setup
from tests.alignment.test_compare_engines import read_report as _report
from tests.alignment.test_compare_engines import validate_side as _validate
from vlmrl.alignment.compare import main

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return family_setup(tmp_path_factory, "tiny-internvl", "rollout.dtype=float32")


@pytest.fixture(scope="module")
def hf_vs_vllm(setup):
    root, overrides, _ = setup
    out = root / "hf_vs_vllm"
    return compare_in_process("hf,vllm", overrides, out), out


def test_hf_vs_vllm_fp32_is_aligned_and_exact(hf_vs_vllm):
    status, out = hf_vs_vllm
    report = _report(out)
    assert status == 0 and report["ok"]
    assert report["summary"]["exact"] == report["summary"]["samples"] == 7
    assert report["summary"]["max_abs_logprob_delta"] < 1e-4, "fp32 engines agree to float rounding"
    assert report["a"]["engine_problems"] == report["b"]["engine_problems"] == []


def test_the_trainer_scores_vllm_samples_exactly(setup, hf_vs_vllm):
    """The trainer (packed, token-budget micro-batches, 3-token logprob chunks) scoring vLLM's samples: every sample
    exact under the float32 thresholds."""
    from vlmrl.alignment.artifact import read_artifact
    from vlmrl.alignment.diff import Thresholds, compare_artifacts
    from vlmrl.alignment.precision import FP32_THRESHOLDS
    from vlmrl.config import load_config
    from vlmrl.trainer.teacher_forcing import score_reference

    root, overrides, _ = setup
    _, first = hf_vs_vllm
    packed = ["actor.padding_free=true", "actor.micro_batch_tokens=300", "actor.logprob_chunk_size=3"]
    engine = first / "val_b_vllm.jsonl"
    config = load_config([*overrides, *packed, "trainer.val_only=true", "rollout.name=vllm"])
    trainer = score_reference(config, engine, root / "trainer_vllm.jsonl")
    comparison = compare_artifacts(*read_artifact(engine), *read_artifact(trainer), Thresholds(**FP32_THRESHOLDS))
    assert comparison.ok and comparison.exact == comparison.total == 7
    assert comparison.max_abs_logprob_delta < 1e-4


# A variant (marker `full`, make test-all; 26 s): make test holds SGLang to HF on nine requests in the engine contract
# (tests/rollout/internvl/test_sglang.py) and validates on SGLang in tests/trainer/test_internvl.py.
@pytest.mark.sglang
@pytest.mark.full
def test_sglang_agrees_with_vllm_exactly(setup, hf_vs_vllm):
    root, overrides, _ = setup
    _, first = hf_vs_vllm
    sglang = _validate(overrides, "sglang", root / "val_sglang.jsonl")
    assert main([str(first / "val_b_vllm.jsonl"), str(sglang), "--out", str(root / "vs_sglang"), "--no-html"]) == 0
    report = _report(root / "vs_sglang")
    assert report["summary"]["exact"] == 7 and report["summary"]["max_abs_logprob_delta"] < 1e-4
