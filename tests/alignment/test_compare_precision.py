"""compare on the demo config (rollout.dtype auto, the tiny Qwen2.5-VL, CPU): the thresholds follow the dtype each
side's header records it computed in, and a real vLLM started with processed logprobs is named for them.

The float32 pair is HF's artifact and a copy with a drift injected (the diff does not care which engine made an
artifact, and HF starts in a second); the processed logprobs are a real vLLM's, scored by the trainer side.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from vlmrl.alignment.artifact import read_artifact, write_artifact
from vlmrl.alignment.compare import main
from vlmrl.alignment.causes import Cause
from vlmrl.alignment.diff import compare_artifacts
from vlmrl.alignment.precision import FP32_THRESHOLDS

DEMO = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_synthetic.yaml"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A folder and the demo config's overrides (its rollout.dtype stays `auto`; 6 validation rows)."""
    root = tmp_path_factory.mktemp("compare_precision")
    return root, [f"config={DEMO}", "data.synthetic_val_size=6", f"trainer.output_dir={root / 'run'}"]


def _validate(overrides, backend, path):
    from vlmrl.config import load_config
    from vlmrl.trainer.validation import validate_with

    config = load_config([*overrides, "trainer.val_only=true", f"rollout.name={backend}"])
    return validate_with(config, backend, artifact_path=path).artifact_path


def _shifted(path: Path, out: Path, shift: float, **header) -> Path:
    """A copy of the artifact at `path` with every response logprob `shift` nats lower and these header fields."""
    meta, records = read_artifact(path)
    for record in records:
        record.response_logprobs = [value - shift for value in record.response_logprobs]
    return write_artifact(out, dataclasses.replace(meta, **header), records)


def test_a_0_01_nat_drift_between_float32_sides_of_the_demo_config_fails(demo):
    """Both sides computed in float32 (what `auto` resolves to on a CPU for Qwen2.5-VL), as their headers now record:
    the float32 thresholds judge them, so a 0.01-nat drift on every token fails (the bfloat16 band of 0.1 nats, which
    a configured `auto` chose before, let it through), and the report says which thresholds and why. An artifact
    written before headers recorded the dtype (`auto` only) is still read: lower precision is assumed, and said."""
    root, overrides = demo
    hf = _validate(overrides, "hf", root / "hf.jsonl")
    meta, _ = read_artifact(hf)
    assert meta.config["rollout"]["dtype"] == "auto" and meta.dtype == "float32"
    assert meta.logprobs_mode == "raw_logprobs"
    drifted = _shifted(hf, root / "hf_drifted.jsonl", 0.01)
    assert main([str(hf), str(drifted), "--out", str(root / "fp32"), "--no-html"]) == 1
    report = json.loads((root / "fp32" / "report.json").read_text())
    assert report["thresholds"]["band"] == "float32" and report["thresholds"]["values"]["drift_tolerance"] == 0.001
    assert "both sides computed in float32" in report["thresholds"]["line"]
    assert {c["name"] for c in report["checks"] if not c["ok"]} == {"mean |logprob delta| (nats)"}

    old = [_shifted(path, root / f"old_{side}.jsonl", 0.0, dtype="", logprobs_mode="")
           for side, path in (("a", hf), ("b", drifted))]
    assert main([*map(str, old), "--out", str(root / "old"), "--no-html"]) == 0
    report = json.loads((root / "old" / "report.json").read_text())
    assert report["thresholds"]["band"] == "bfloat16"
    assert "A:hf and B:hf recorded no dtype" in report["thresholds"]["line"]
    flags = " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in FP32_THRESHOLDS.items())
    assert flags in report["thresholds"]["reason"]
    assert main([*map(str, old), "--out", str(root / "old32"), "--no-html", *flags.split()]) == 1


@pytest.mark.vllm
def test_a_real_vllms_processed_logprobs_at_temperature_0_7_are_named(demo, caplog):
    """vLLM started with logprobs_mode=processed_logprobs (a warning at start says what that breaks), validating at
    temperature 0.7, against the trainer side: every sample whose logprobs differ from the raw model's is named
    processed_logprobs, none is drift. vLLM renormalises its processed logprobs after the image/video placeholder ban
    (sent as bad_words on every request): they match the trainer's sampled distribution, placeholders left out, to
    float32 rounding (measured 3e-6), where they sat 2e-4..7e-3 nats above softmax(logits / 0.7) over the whole
    vocabulary, which the diff called drift before. Without the
    trainer's sampled-distribution values (an older trainer side, or one at world size > 1) the engine header's
    logprobs_mode names them."""
    from vlmrl.config import load_config
    from vlmrl.trainer.teacher_forcing import score_reference

    root, overrides = demo
    sampled = [*overrides, "rollout.val_temperature=0.7", "rollout.val_n=2",
               "rollout.vllm.engine_kwargs.logprobs_mode=processed_logprobs"]
    with caplog.at_level(logging.WARNING, logger="vlmrl.rollout.vllm"):
        engine = _validate(sampled, "vllm", root / "vllm_processed.jsonl")
    assert "logprobs_mode=processed_logprobs replaces the raw logprobs" in caplog.text
    meta, records = read_artifact(engine)
    assert (meta.dtype, meta.logprobs_mode, meta.config["rollout"]["dtype"]) == ("float32", "processed_logprobs",
                                                                                 "auto")
    trainer = score_reference(load_config([*sampled, "trainer.val_only=true", "rollout.name=vllm"]), engine,
                              root / "trainer.jsonl")
    _, scored = read_artifact(trainer)
    assert all(r.tempered_logprobs is not None for r in scored)
    assert len({tuple(r.response_ids) for r in records}) > 1, "sampling gave different responses"

    assert main([str(engine), str(trainer), "--out", str(root / "processed"), "--no-html"]) == 1
    report = json.loads((root / "processed" / "report.json").read_text())
    assert report["thresholds"]["band"] == "float32"
    causes = {cause for cause, count in report["summary"]["causes"].items() if count}
    assert causes == {"processed_logprobs"}, report["summary"]["causes"]
    tolerance = FP32_THRESHOLDS["drift_tolerance"]
    for sample in report["samples"]:
        assert sample["tempered_max_delta"] <= tolerance, sample["explanation"]
        assert sample["cause"] == "processed_logprobs" or sample["max_abs_logprob_delta"] <= tolerance

    comparison = compare_artifacts(*read_artifact(engine), *read_artifact(_without_sampled_values(trainer, root)))
    named = [s for s in comparison.samples if s.cause is not None]
    assert named and {s.cause for s in named} == {Cause.PROCESSED_LOGPROBS}
    assert all("vllm's engine ran with logprobs_mode=processed_logprobs" in s.explanation for s in named)


def _without_sampled_values(path: Path, root: Path) -> Path:
    meta, records = read_artifact(path)
    for record in records:
        record.tempered_logprobs = None
    return write_artifact(root / "trainer_raw_only.jsonl", meta, records)
