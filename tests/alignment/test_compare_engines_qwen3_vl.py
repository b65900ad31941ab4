"""The compare tool on the embedded Qwen3-VL (fp32, CPU) with the real engines: HF, vLLM and SGLang agree exactly,
and an engine started without Qwen3-VL's mrope interleaving is reported as not aligned.

`compare --backends hf,vllm` runs as a user runs it (each side its own validate-only process); SGLang's side is
validated in this process (what a side of `--backends` runs, without another interpreter importing the engines) and
compared with the artifacts of that run; the mis-set engine
is reached by validating a copy of the model whose config.json lacks `mrope_interleaved` with
`rollout.family_engine_settings=false` (vlmrl then starts vLLM on that config as it is, as a deployment outside vlmrl
would), and its artifact is compared with the HF one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.alignment.test_compare_engines import compare_in_process, family_setup
from tests.alignment.test_compare_engines import read_report as _report
from tests.alignment.test_compare_engines import validate_side as _validate
from vlmrl.alignment.compare import main

pytestmark = pytest.mark.vllm  # every test reuses the `compare --backends hf,vllm` run


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The colour set and the overrides every side shares (float32 engines)."""
    return family_setup(tmp_path_factory, "tiny-qwen3-vl", "rollout.dtype=float32")


@pytest.fixture(scope="module")
def hf_vs_vllm(setup):
    root, overrides, _ = setup
    out = root / "hf_vs_vllm"
    return compare_in_process("hf,vllm", overrides, out), out


@pytest.fixture(scope="module")
def flagless(setup) -> Path:
    """The model with `mrope_interleaved` removed from config.json (transformers interleaves anyway)."""
    root, _, model = setup
    folder = root / "qwen3-vl-flagless"
    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["rope_parameters"]["mrope_interleaved"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def test_hf_vs_vllm_fp32_is_aligned_and_exact(hf_vs_vllm):
    status, out = hf_vs_vllm
    report = _report(out)
    assert status == 0 and report["ok"]
    assert report["summary"]["exact"] == report["summary"]["samples"] == 7
    assert report["summary"]["max_abs_logprob_delta"] < 1e-4, "fp32 engines agree to float rounding"


@pytest.mark.sglang
def test_vllm_vs_sglang_and_hf_vs_sglang_fp32_are_exact(setup, hf_vs_vllm):
    """The third engine: SGLang's validation artifact against vLLM's and HF's from the `--backends hf,vllm` run."""
    root, overrides, _ = setup
    _, first = hf_vs_vllm
    sglang = _validate(overrides, "sglang", root / "val_sglang.jsonl")
    out = root / "vllm_vs_sglang"
    assert main([str(first / "val_b_vllm.jsonl"), str(sglang), "--out", str(out), "--no-html"]) == 0
    report = _report(out)
    assert report["summary"]["exact"] == report["summary"]["samples"] == 7
    assert report["summary"]["max_abs_logprob_delta"] < 1e-4
    assert main([str(first / "val_a_hf.jsonl"), str(sglang), "--out", str(root / "hf_vs_sglang"), "--no-html"]) == 0
    assert _report(root / "hf_vs_sglang")["summary"]["exact"] == 7


@pytest.mark.sglang
def test_the_trainer_scores_each_engines_samples_as_it_did(setup, hf_vs_vllm):
    """The trainer side on Qwen3-VL (packed, token-budget micro-batches, 3-token logprob chunks) against vLLM's and
    SGLang's float32 samples: every sample exact under the float32 thresholds (deepstack and interleaved mrope
    included)."""
    from vlmrl.alignment.artifact import read_artifact
    from vlmrl.alignment.diff import Thresholds, compare_artifacts
    from vlmrl.alignment.precision import FP32_THRESHOLDS
    from vlmrl.config import load_config
    from vlmrl.trainer.teacher_forcing import score_reference

    root, overrides, _ = setup
    _, first = hf_vs_vllm
    packed = ["actor.padding_free=true", "actor.micro_batch_tokens=300", "actor.logprob_chunk_size=3"]
    sglang = root / "val_sglang.jsonl"
    if not sglang.exists():
        sglang = _validate(overrides, "sglang", sglang)
    for engine in (first / "val_b_vllm.jsonl", sglang):
        config = load_config([*overrides, *packed, "trainer.val_only=true", "rollout.name=vllm"])
        trainer = score_reference(config, engine, root / f"trainer_{engine.stem}.jsonl")
        comparison = compare_artifacts(*read_artifact(engine), *read_artifact(trainer), Thresholds(**FP32_THRESHOLDS))
        assert comparison.ok and comparison.exact == comparison.total == 7, engine
        assert comparison.max_abs_logprob_delta < 1e-4


def test_engine_without_mrope_interleaving_is_not_aligned(setup, hf_vs_vllm, flagless):
    """vLLM started on the flagless config as it is computes other rope angles than transformers: the tool exits 1
    and names divergences (or logprob drift) on the image rows; the text row (1-D positions: all three sections
    carry the same position, so interleaving changes nothing) stays exact. Both sides are float32, so the tool's
    float32 thresholds apply: with the bf16 ones these splits (margins 0.03-0.2 nats) would pass as near-ties."""
    root, overrides, _ = setup
    _, out = hf_vs_vllm
    misset = _validate([*overrides, f"actor.model_path={flagless}", "rollout.family_engine_settings=false"], "vllm",
                       root / "val_vllm_misset.jsonl")
    status = main([str(out / "val_a_hf.jsonl"), str(misset), "--out", str(root / "misset"), "--no-html"])
    report = _report(root / "misset")
    assert status == 1 and not report["ok"]
    causes = {cause: count for cause, count in report["summary"]["causes"].items() if count}
    assert set(causes) <= {"logprob_drift", "real_divergence", "near_tie"}, causes
    assert causes.get("real_divergence", 0) + causes.get("logprob_drift", 0) >= 1, causes
    assert report["summary"]["max_abs_logprob_delta"] > 1e-2
    text_row = next(s for s in report["samples"] if s["index"] == 6)
    assert text_row["cause"] is None


def test_same_config_with_vlmrl_settings_is_aligned(setup, hf_vs_vllm, flagless):
    """The same flagless config with vlmrl's default engine settings (it passes mrope_interleaved): exact again."""
    root, overrides, _ = setup
    _, out = hf_vs_vllm
    fixed = _validate([*overrides, f"actor.model_path={flagless}"], "vllm", root / "val_vllm_fixed.jsonl")
    assert main([str(out / "val_a_hf.jsonl"), str(fixed), "--out", str(root / "fixed"), "--no-html"]) == 0
    report = _report(root / "fixed")
    assert report["summary"]["exact"] == 7
    assert "config.actor.model_path" in {d["key"] for d in report["setting_differences"]}
