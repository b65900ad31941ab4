"""The compare tool on the embedded GLM-4.1V (fp32, CPU) with the real engines: HF, vLLM and SGLang agree exactly,
the trainer scores the engines' samples exactly (packed, chunked), and a vLLM started on a config without
`attention_bias` (vlmrl's override turned off, as a deployment outside vlmrl would start it) is reported as not
aligned, with the family's reason named in the report."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.alignment.test_compare_engines import compare_in_process, family_setup
from tests.alignment.test_compare_engines import read_report as _report
from tests.alignment.test_compare_engines import validate_side as _validate
from vlmrl.alignment.compare import main

pytestmark = pytest.mark.vllm  # every test reuses the `compare --backends hf,vllm` run


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The colour set and the overrides every side shares (float32 engines)."""
    return family_setup(tmp_path_factory, "tiny-glm4v", "rollout.dtype=float32")


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


@pytest.mark.sglang
def test_sglang_and_the_trainer_agree_with_vllm_exactly(setup, hf_vs_vllm):
    """SGLang's validation artifact against vLLM's, and the trainer (packed, token-budget micro-batches, 3-token
    logprob chunks) scoring vLLM's samples: every sample exact under the float32 thresholds."""
    from vlmrl.alignment.artifact import read_artifact
    from vlmrl.alignment.diff import Thresholds, compare_artifacts
    from vlmrl.alignment.precision import FP32_THRESHOLDS
    from vlmrl.config import load_config
    from vlmrl.trainer.teacher_forcing import score_reference

    root, overrides, _ = setup
    _, first = hf_vs_vllm
    sglang = _validate(overrides, "sglang", root / "val_sglang.jsonl")
    assert main([str(first / "val_b_vllm.jsonl"), str(sglang), "--out", str(root / "vs_sglang"), "--no-html"]) == 0
    assert _report(root / "vs_sglang")["summary"]["exact"] == 7
    packed = ["actor.padding_free=true", "actor.micro_batch_tokens=300", "actor.logprob_chunk_size=3"]
    engine = first / "val_b_vllm.jsonl"
    config = load_config([*overrides, *packed, "trainer.val_only=true", "rollout.name=vllm"])
    trainer = score_reference(config, engine, root / "trainer_vllm.jsonl")
    comparison = compare_artifacts(*read_artifact(engine), *read_artifact(trainer), Thresholds(**FP32_THRESHOLDS))
    assert comparison.ok and comparison.exact == comparison.total == 7
    assert comparison.max_abs_logprob_delta < 1e-4


def test_vllm_without_attention_bias_is_not_aligned_and_the_report_says_why(setup, hf_vs_vllm, capsys):
    """vLLM started on a config without `attention_bias` as it is drops the q/k/v biases: the tool exits 1 with
    divergences or drift on text and image rows alike, and names the family's reason for that side."""
    root, overrides, model = setup
    _, out = hf_vs_vllm
    folder = root / "glm4v-biasless"
    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["attention_bias"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    misset = _validate([*overrides, f"actor.model_path={folder}", "rollout.family_engine_settings=false"], "vllm",
                       root / "val_vllm_misset.jsonl")
    status = main([str(out / "val_a_hf.jsonl"), str(misset), "--out", str(root / "misset"), "--no-html"])
    report = _report(root / "misset")
    assert status == 1 and not report["ok"]
    assert report["summary"]["max_abs_logprob_delta"] > 1e-2
    assert len(report["b"]["engine_problems"]) == 1 and "attention_bias" in report["b"]["engine_problems"][0]
    printed = " ".join(capsys.readouterr().out.split())
    assert "engine was started without a setting its model needs" in printed and "attention_bias" in printed
