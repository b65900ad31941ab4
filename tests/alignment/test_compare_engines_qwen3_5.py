"""The compare tool on the embedded Qwen3.5 (bfloat16: its engines' only dtype on CPU) with the real engines: HF,
vLLM and SGLang are aligned under the tool's bfloat16 thresholds (the splits they show are near-ties).

`compare --backends hf,vllm` runs as a user runs it; SGLang's side is validated in this process and compared with
that run's artifacts.

Not here: a mis-set engine caught in bfloat16. vLLM started without `mrope_interleaved` on this tiny random model
(family_engine_settings=false) measured like a correct one: 6 near-ties + 1 drift of 7, mean |dlogp| 0.0315
(correct: 0.0324), so bfloat16's noise hides it; the family settings whose absence does show (SGLang without
full_attention_interval or deepstack_visual_indexes) stop the engine before any output (tests/rollout/qwen3_5/).
"""

from __future__ import annotations

import pytest

from tests.alignment.test_compare_engines import compare_in_process, family_setup
from tests.alignment.test_compare_engines import read_report as _report
from tests.alignment.test_compare_engines import validate_side as _validate
from vlmrl.alignment.artifact import read_artifact
from vlmrl.alignment.compare import main

pytestmark = pytest.mark.vllm  # every test reuses the `compare --backends hf,vllm` run

ALIGNED_CAUSES = {"exact", "near_tie", "logprob_drift"}
"""What two correct bfloat16 implementations may show: equal samples, splits at near-ties, logprob drift."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # rollout.dtype stays `auto` (the demo's): every CPU backend resolves it to bfloat16 for Qwen3.5, and the
    # artifacts' headers must say so
    return family_setup(tmp_path_factory, "tiny-qwen3.5")


@pytest.fixture(scope="module")
def hf_vs_vllm(setup):
    root, overrides, _ = setup
    out = root / "hf_vs_vllm"
    return compare_in_process("hf,vllm", overrides, out), out


def _causes(report: dict) -> dict[str, int]:
    return {cause: count for cause, count in report["summary"]["causes"].items() if count}


def test_hf_vs_vllm_bf16_is_aligned(hf_vs_vllm):
    status, out = hf_vs_vllm
    report = _report(out)
    assert status == 0 and report["ok"], _causes(report)
    assert report["summary"]["samples"] == 7
    assert set(_causes(report)) <= ALIGNED_CAUSES, _causes(report)
    # measured: 0 of 7 exact, 6 near-ties, 1 drift; mean |dlogp| 0.032, max 0.136 (bfloat16 on both sides)
    assert report["summary"]["mean_abs_logprob_delta"] < 0.05


def test_a_float32_trainer_on_vllms_bfloat16_samples_is_precision_not_exact(setup, hf_vs_vllm):
    """`--backends vllm,trainer` on Qwen3.5 with rollout.dtype auto: vLLM computed in bfloat16 (its header says so,
    though its config says auto), the trainer in float32. Every sample whose logprobs differ by more than float32
    rounding is precision (different dtypes), none of them "exact"; the report says the bfloat16 thresholds judged
    it because a side computed below float32."""
    from vlmrl.alignment.precision import FP32_THRESHOLDS
    from vlmrl.config import load_config
    from vlmrl.trainer.teacher_forcing import score_reference

    root, overrides, _ = setup
    _, first = hf_vs_vllm
    engine = first / "val_b_vllm.jsonl"
    meta, _ = read_artifact(engine)
    assert (meta.config["rollout"]["dtype"], meta.dtype) == ("auto", "bfloat16")
    trainer = score_reference(load_config([*overrides, "trainer.val_only=true", "rollout.name=vllm"]), engine,
                              root / "trainer.jsonl")
    assert read_artifact(trainer)[0].dtype == "float32"
    main([str(engine), str(trainer), "--out", str(root / "trainer"), "--no-html"])
    report = _report(root / "trainer")
    assert report["thresholds"]["band"] == "bfloat16"
    assert "a side computed below float32 (vllm bfloat16, trainer float32)" in report["thresholds"]["line"]
    apart = [s for s in report["samples"] if s["max_abs_logprob_delta"] > FP32_THRESHOLDS["drift_tolerance"]]
    assert apart, "bfloat16 against float32 differs beyond float32 rounding"
    assert all(s["cause"] in ("precision", "logprob_drift") for s in apart), [s["cause"] for s in apart]
    assert all("band of bfloat16 vs float32" in s["explanation"] for s in apart if s["cause"] == "precision")


@pytest.mark.sglang
def test_vllm_vs_sglang_and_hf_vs_sglang_bf16_are_aligned(setup, hf_vs_vllm):
    root, overrides, _ = setup
    _, first = hf_vs_vllm
    sglang = _validate(overrides, "sglang", root / "val_sglang.jsonl")
    for name, other in (("vllm", first / "val_b_vllm.jsonl"), ("hf", first / "val_a_hf.jsonl")):
        out = root / f"{name}_vs_sglang"
        status = main([str(other), str(sglang), "--out", str(out), "--no-html"])
        report = _report(out)
        assert status == 0 and set(_causes(report)) <= ALIGNED_CAUSES, (name, _causes(report))
