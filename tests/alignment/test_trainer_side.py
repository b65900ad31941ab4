"""`compare --backends X,trainer`: the trainer scores an engine's samples teacher-forced
(vlmrl.trainer.teacher_forcing), on the HF backend as a user runs it (each side its own process). The real engines'
case (vLLM's samples, packing, chunks, other weights, other pixels) is in test_compare_engines.py."""

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
def test_sampled_outputs_compare_token_for_token(tmp_path, capsys):
    """At temperature 0.7 with 2 samples per row the two sides still share every token (the trainer scores the
    engine's): aligned in float32. The trainer also keeps the logprobs of the distribution the engine sampled from,
    which a real vLLM's processed logprobs match (test_compare_precision.py)."""
    out = tmp_path / "out"
    sampled = ["rollout.val_temperature=0.7", "rollout.val_n=2", "rollout.dtype=float32"]
    assert main(["--backends", "hf,trainer", *_overrides(tmp_path, *sampled), "--out", str(out), "--no-html"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["samples"] == 12 and report["summary"]["max_abs_logprob_delta"] < 1e-4
    _, engine = read_artifact(out / "val_a_hf.jsonl")
    _, trainer = read_artifact(out / "val_b_trainer.jsonl")
    assert [r.response_ids for r in engine] == [r.response_ids for r in trainer]
    assert len({tuple(r.response_ids) for r in engine}) > 1, "sampling gave different responses"
    assert all(r.tempered_logprobs is not None and r.tempered_logprobs != r.response_logprobs for r in trainer)
    assert "val_temperature=0.7" in (out / "val_b_trainer.log").read_text().splitlines()[0]


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


def test_a_processor_error_is_one_error_line_and_exit_2(tmp_path, capsys):
    """`python -m vlmrl.trainer.teacher_forcing` with a data.min_pixels below the model's image processor bound: the
    user's to fix, so a config `error:` block naming the setting and the bounds, found as the config loads, and
    exit 2 (not a traceback)."""
    from tests.alignment.toy_artifacts import write_side
    from vlmrl.trainer.teacher_forcing import main as side_main

    reference = write_side(tmp_path / "engine.jsonl", rows=2)
    status = side_main([*_overrides(tmp_path, "data.min_pixels=1000"), "--reference", str(reference),
                        "--out", str(tmp_path / "t.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and err[0] == "error: invalid configuration:" and len(err) == 2, err
    assert err[1].startswith("  - data.min_pixels=1000") and "3136" in err[1] and "Traceback" not in "".join(err)


def test_a_reference_from_other_data_or_rows_is_refused_naming_them(tmp_path):
    """An engine artifact of another validation set (6 rows against a config of 4), or of rows this config filters
    (a shorter data.max_prompt_length), is refused naming the data or the rows, not scored against other prompts."""
    from vlmrl.alignment.trainer_side import TrainerSideError
    from vlmrl.config import load_config
    from vlmrl.trainer.teacher_forcing import score_reference
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
    from vlmrl.trainer.teacher_forcing import score_reference
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
    from vlmrl.alignment.causes import Thresholds
    from vlmrl.alignment.diff import compare_artifacts
    from vlmrl.alignment.precision import FP32_THRESHOLDS
    from vlmrl.config import load_config
    from vlmrl.trainer.fit import fit
    from vlmrl.trainer.teacher_forcing import score_reference
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


def test_doctests():
    import doctest

    import vlmrl.trainer.teacher_forcing as teacher_forcing

    assert doctest.testmod(teacher_forcing).failed == 0


@pytest.mark.vllm
def test_the_sampler_mask_keeps_the_tokens_vllms_sampler_keeps():
    """`sampler_mask` (what the trainer side scores the sampled distribution with) against vLLM's own top-k/top-p
    (its PyTorch path) after the ban and the temperature, on random logits: the same tokens are left out."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from vlmrl.trainer.teacher_forcing import sampler_mask

    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 3
    banned, temperature = [5, 17], 0.7
    for top_k, top_p in ((0, 0.9), (50, 1.0), (50, 0.8), (1, 1.0), (0, 1.0)):
        ours = sampler_mask(logits, banned, temperature, top_k, top_p)
        theirs = logits.clone()
        theirs[:, banned] = float("-inf")
        theirs = apply_top_k_top_p_pytorch(theirs / temperature, torch.full((64,), top_k) if top_k else None,
                                           torch.full((64,), top_p) if top_p < 1 else None)
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (top_k, top_p)
        assert torch.isinf(ours).any(dim=-1).all() and not torch.isinf(ours).all(dim=-1).any()
