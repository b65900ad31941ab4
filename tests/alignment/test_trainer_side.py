"""`compare --backends X,trainer`: the trainer scores an engine's samples teacher-forced (vlmrl.trainer.trainer_side),
on the HF backend as a user runs it (each side its own process). The real engines' case (vLLM's samples, packing,
chunks, other weights, other pixels) is in test_compare_engines.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ray_helpers import local_ray
from vlmrl.alignment.artifact import read_artifact, write_artifact
from vlmrl.alignment.compare import main

ROOT = Path(__file__).resolve().parents[2]


def _overrides(tmp_path, *extra):
    return [f"config={ROOT / 'examples' / 'configs' / 'tiny_synthetic.yaml'}", "data.synthetic_val_size=6",
            f"trainer.output_dir={tmp_path / 'runs'}", *extra]


@pytest.mark.slow
def test_sampled_outputs_compare_token_for_token_and_processed_logprobs_are_named(tmp_path, capsys):
    """At temperature 0.7 with 2 samples per row the two sides still share every token (the trainer scores the
    engine's): aligned in float32. The trainer also keeps its softmax(logits / 0.7) logprobs; an engine artifact
    carrying those instead of raw ones (what an engine with processed logprobs returns) is named on every sample."""
    out = tmp_path / "out"
    sampled = ["rollout.val_temperature=0.7", "rollout.val_n=2", "rollout.dtype=float32"]
    assert main(["--backends", "hf,trainer", *_overrides(tmp_path, *sampled), "--out", str(out), "--no-html"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["samples"] == 12 and report["summary"]["max_abs_logprob_delta"] < 1e-4
    meta_e, engine = read_artifact(out / "val_a_hf.jsonl")
    _, trainer = read_artifact(out / "val_b_trainer.jsonl")
    assert [r.response_ids for r in engine] == [r.response_ids for r in trainer]
    assert len({tuple(r.response_ids) for r in engine}) > 1, "sampling gave different responses"
    assert all(r.tempered_logprobs is not None and r.tempered_logprobs != r.response_logprobs for r in trainer)
    assert "val_temperature=0.7" in (out / "val_b_trainer.log").read_text().splitlines()[0]

    for record, scored in zip(engine, trainer):
        record.response_logprobs = list(scored.tempered_logprobs)
    processed = write_artifact(tmp_path / "processed.jsonl", meta_e, engine)
    assert main([str(processed), str(out / "val_b_trainer.jsonl"), "--out", str(tmp_path / "p"), "--no-html"]) == 1
    report = json.loads((tmp_path / "p" / "report.json").read_text())
    assert report["summary"]["causes"]["processed_logprobs"] == 12
    assert "softmax(logits / temperature)" in report["samples"][0]["explanation"]


def test_what_the_trainer_side_cannot_score_exits_2_before_any_engine(tmp_path, capsys):
    assert main(["--backends", "trainer,trainer", *_overrides(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "pair it with an engine" in capsys.readouterr().err
    dp2 = _overrides(tmp_path, "trainer.n_gpus_per_node=2", "trainer.format_warmup_steps=0")
    assert main(["--backends", "vllm,trainer", *dp2, "--drill-down", "--out", str(tmp_path / "o")]) == 2
    assert "--drill-down hooks the modules of one unsharded model" in capsys.readouterr().err
    agent = _overrides(tmp_path, "agent.enable=true", "agent.max_response_tokens=6")
    assert main(["--backends", "vllm,trainer", *agent, "--out", str(tmp_path / "o")]) == 2
    assert "agent.enable=true" in capsys.readouterr().err
    assert not (tmp_path / "o" / "val_a_vllm.log").exists(), "refused before the engine side ran"


def test_a_reference_from_other_data_or_rows_is_refused_naming_them(tmp_path):
    """An engine artifact of another validation set (6 rows against a config of 4), or of rows this config filters
    (a shorter data.max_prompt_length), is refused naming the data or the rows, not scored against other prompts."""
    from vlmrl.alignment.trainer_side import TrainerSideError
    from vlmrl.config import load_config
    from vlmrl.trainer.trainer_side import score_reference
    from vlmrl.trainer.validation import validate_with

    config = load_config([*_overrides(tmp_path), "trainer.val_only=true", "rollout.name=hf"])
    reference = validate_with(config, "hf", artifact_path=tmp_path / "six.jsonl").artifact_path
    fewer = load_config([*_overrides(tmp_path), "data.synthetic_val_size=4"])
    with pytest.raises(TrainerSideError, match=r"six.jsonl validated other data \(.*6 rows\) than this config's"):
        score_reference(fewer, reference, tmp_path / "t.jsonl")
    meta, records = read_artifact(reference)
    records[0].index = 99  # a row this config's validation set does not have
    write_artifact(tmp_path / "moved.jsonl", meta, records)
    with pytest.raises(TrainerSideError, match=r"moved.jsonl: rows \[99\] are not in this config's validation set"):
        score_reference(load_config(_overrides(tmp_path)), tmp_path / "moved.jsonl", tmp_path / "t.jsonl")


def _with_layer_perturbed(model_path: str, folder: Path, layer: int) -> Path:
    """A copy of the model whose decoder layer `layer` (its weight matrices) moved by 0.05 std."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_path, folder)
    weights = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    moved = 0
    for name, tensor in sorted(weights.items()):
        if f"layers.{layer}." in name and "visual" not in name and tensor.dim() >= 2:
            weights[name] = tensor + torch.randn(tensor.shape, generator=generator) * tensor.std() * 0.05
            moved += 1
    assert moved, f"no decoder layer {layer} tensors in {model_path}"
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


# Qwen3-VL's case is a variant (marker `full`, make test-all): the second family of the same drill-down, which adds
# the deepstack mergers to the watched modules; make test keeps the default model's.
@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", pytest.param("tiny-qwen3-vl", marks=pytest.mark.full)])
def test_the_drill_down_names_the_decoder_layer_that_differs(tmp_path, model, capsys):
    """The trainer on weights whose decoder layer 1 moved, against HF's samples of the original: the drill-down finds
    the vision tower, its mergers (Qwen3-VL: the deepstack mergers) and layer 0 equal and names layer 1; the trainer
    on the original weights, packed and chunked, finds every module within float32 tolerance."""
    from vlmrl.config import load_config
    from vlmrl.models.tiny import ensure_built
    from vlmrl.trainer.trainer_side import score_reference
    from vlmrl.trainer.validation import validate_with

    original = str(ensure_built(model))
    common = [*_overrides(tmp_path, f"actor.model_path={original}", "rollout.dtype=float32"), "trainer.val_only=true",
              "rollout.name=hf"]
    reference = validate_with(load_config(common), "hf", artifact_path=tmp_path / "hf.jsonl").artifact_path
    moved = _with_layer_perturbed(original, tmp_path / "moved", layer=1)
    path = score_reference(load_config([*common, f"actor.model_path={moved}"]), reference, tmp_path / "t.jsonl",
                           drill=True)
    drill = read_artifact(path)[0].drill_down
    assert drill["first"] == "model.language_model.layers.1", drill
    before = [m for m in drill["modules"] if m["name"] != "head"][: [m["name"] for m in drill["modules"]].index(
        "model.language_model.layers.1")]
    assert any("visual" in m["name"] for m in before) and not any(m["differs"] for m in before)
    if model == "tiny-qwen3-vl":
        assert any("deepstack_merger_list" in m["name"] for m in before)

    out = tmp_path / "clean"
    packed = ["actor.padding_free=true", "actor.logprob_chunk_size=2"]
    assert main(["--backends", "hf,trainer", *common[:-2], *packed, "--drill-down", "--out", str(out),
                 "--no-html"]) == 0
    clean = read_artifact(out / "val_b_trainer.jsonl")[0].drill_down
    assert clean["first"] is None and clean["modules"][-1]["name"] == "head"
    printed = " ".join(capsys.readouterr().out.split())
    assert "drill-down on row" in printed and "modules within 0.0001 (relative) of transformers" in printed


@pytest.mark.slow
@pytest.mark.ray
def test_a_lora_checkpoint_is_scored_as_its_base_with_the_trained_adapters(tmp_path, tiny_model_path):
    """A LoRA run's checkpoint (merged weights for the engines, adapter/ beside them): the trainer side builds what
    the run trained, the base model with the checkpoint's adapters, and on HF's samples of the merged weights agrees
    to float32 rounding (adapter vs merged), on one device and sharded over two; the adapters moved the logprobs (the
    base alone is far off)."""
    from tests.trainer.test_fit import base_args
    from tests.trainer.test_lora_fit import LORA
    from vlmrl.alignment.diff import FP32_THRESHOLDS, Thresholds, compare_artifacts
    from vlmrl.config import load_config
    from vlmrl.trainer.fit import fit
    from vlmrl.trainer.trainer_side import score_reference
    from vlmrl.trainer.validation import validate_with

    run = tmp_path / "run"
    fit(load_config(base_args(tiny_model_path, run, *LORA, "trainer.total_steps=2", "trainer.save_freq=2",
                              "trainer.val_before_train=false")))
    checkpoint = run / "checkpoints" / "latest"
    assert (checkpoint / "adapter").is_dir()
    common = base_args(str(checkpoint), tmp_path / "val", "trainer.val_only=true", "data.train_files=",
                       "rollout.dtype=float32")
    merged = validate_with(load_config(common), "hf", artifact_path=tmp_path / "merged.jsonl").artifact_path
    scored = score_reference(load_config([*common, *LORA[:3]]), merged, tmp_path / "adapter.jsonl")
    meta, records = read_artifact(scored)
    comparison = compare_artifacts(*read_artifact(merged), meta, records, Thresholds(**FP32_THRESHOLDS))
    assert comparison.ok and comparison.max_abs_logprob_delta < 1e-4, [s.explanation for s in comparison.samples]
    with local_ray(num_cpus=2):  # the same adapters on the sharded actor (two ranks, FSDP2 over the PeftModel)
        sharded = score_reference(load_config([*common, *LORA[:3], "trainer.n_gpus_per_node=2"]), merged,
                                  tmp_path / "adapter_dp2.jsonl")
    comparison = compare_artifacts(*read_artifact(merged), *read_artifact(sharded), Thresholds(**FP32_THRESHOLDS))
    assert comparison.ok and comparison.max_abs_logprob_delta < 1e-4, [s.explanation for s in comparison.samples]
    base = score_reference(load_config([*common, f"actor.model_path={tiny_model_path}"]), merged,
                           tmp_path / "base.jsonl")
    assert compare_artifacts(*read_artifact(merged), *read_artifact(base)).max_abs_logprob_delta > 1e-3
