"""The compare tool on real engines (tiny Qwen2.5-VL, fp32, CPU): what it says about real backends is true.

Each comparison validates its sides in this process (`compare_in_process`: what each side of `--backends` runs,
without the two interpreters that would import the engines again) and compares the artifacts with the CLI; the
one-process-per-side path (`compare --backends vllm,sglang`, each side's log kept, its artifact moved into place) is
run by the README's tour (tests/test_tour.py). The injected faults run on the HF backend (the diff does not care which
engine made an artifact, and HF starts in a second). The other embedded families run the same checks on real
engines from one matrix (test_compare_families.py), with these helpers.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vlmrl.alignment.artifact import read_artifact
from vlmrl.alignment.compare import main
from vlmrl.alignment.diff import Cause, Thresholds, compare_artifacts
from vlmrl.alignment.precision import FP32_THRESHOLDS

pytestmark = pytest.mark.vllm  # every test reuses the `compare --backends hf,vllm` run

# Images larger than the tiny model's max_pixels (12544), so that max_pixels decides their resized size.
IMAGE_SIZES = [(224, 168), (168, 224), (196, 196), (280, 140), (140, 112), (112, 112)]
COLOURS = ["red", "green", "blue", "red", "green", "blue"]
REWARD_FILE = '''
def by_length(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": (len(solution_str) % 5) / 4, "accuracy": float(len(solution_str) % 2)}


def by_first_char(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str[:1].isalpha()), "accuracy": float(len(solution_str) % 2)}
'''


def _image_bytes(size, colour) -> bytes:
    rng = np.random.default_rng(sum(size))
    pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)  # texture: the vision tower sees detail
    pixels[: size[1] // 2] = {"red": (220, 20, 20), "green": (20, 200, 40), "blue": (30, 40, 220)}[colour]
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def write_colour_set(root: Path) -> Path:
    """Into `root`: val.parquet (6 image rows of IMAGE_SIZES/COLOURS + 1 text row, verl's schema) and rewards.py
    (REWARD_FILE); returns the parquet's path."""
    question = [{"role": "user", "content": "<image>Which colour is on top?"}]
    rows = [{"data_source": "synthetic/colour", "prompt": question,
             "images": [{"bytes": _image_bytes(size, colour), "path": None}], "ability": "vision",
             "reward_model": {"style": "rule", "ground_truth": colour}, "extra_info": {"index": i}}
            for i, (size, colour) in enumerate(zip(IMAGE_SIZES, COLOURS))]
    rows.append({"data_source": "synthetic/text", "prompt": [{"role": "user", "content": "Name a colour."}],
                 "images": [], "ability": "text", "reward_model": {"style": "rule", "ground_truth": "red"},
                 "extra_info": {"index": 6}})
    data = root / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    (root / "rewards.py").write_text(REWARD_FILE)
    return data


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_path):
    """A small verl-schema parquet (6 image rows + 1 text row) and the overrides every side shares."""
    root = tmp_path_factory.mktemp("alignment_engines")
    data = write_colour_set(root)
    overrides = [f"actor.model_path={tiny_model_path}", f"data.val_files={data}", "data.max_prompt_length=128",
                 "data.max_response_length=16", "data.min_pixels=3136", "data.max_pixels=12544",
                 "rollout.dtype=float32", "rollout.val_top_logprobs=5", f"trainer.output_dir={root / 'run'}",
                 f"reward.function={root / 'rewards.py'}:by_length", "rollout.timeout_s=300"]
    return root, overrides


@pytest.fixture(scope="module")
def hf_vs_vllm(setup):
    """`compare --backends hf,vllm`, each side validated in this process: (exit status, out folder)."""
    root, overrides = setup
    out = root / "hf_vs_vllm"
    return compare_in_process("hf,vllm", overrides, out), out


def validate_side(overrides, backend, path):
    """A validate-only pass of `backend` with these overrides, in this process: the artifact's path (what a side of
    `compare --backends` writes). Every engine-compare module validates its sides with it."""
    from vlmrl.config import load_config
    from vlmrl.trainer.validation import validate_with

    config = load_config([*overrides, "trainer.val_only=true", f"rollout.name={backend}"])
    return validate_with(config, backend, artifact_path=path).artifact_path


_validate = validate_side


def read_report(out: Path) -> dict:
    """The compare tool's report.json in `out`."""
    return json.loads((out / "report.json").read_text())


def family_setup(tmp_path_factory, variant: str, *extra: str):
    """(folder, the overrides every side shares, the model) of an engine-compare module on an embedded family: the
    colour set (6 image rows larger than the model's max_pixels + 1 text row), by-length rewards, top-5 logprobs."""
    from vlmrl.models.tiny import ensure_built

    root = tmp_path_factory.mktemp(f"alignment_{variant}")
    data = write_colour_set(root)
    model = ensure_built(variant)
    overrides = [f"actor.model_path={model}", f"data.val_files={data}", "data.max_prompt_length=128",
                 "data.max_response_length=16", *extra, "rollout.val_top_logprobs=5",
                 f"trainer.output_dir={root / 'run'}", f"reward.function={root / 'rewards.py'}:by_length",
                 "rollout.timeout_s=300"]
    return root, overrides, model


def compare_in_process(backends: str, overrides: list[str], out: Path, *options: str) -> int:
    """What `compare --backends A,B ...` computes, with each side validated in this process (`validate_with`, the
    pass each side's own process runs) into out/val_a_A.jsonl and out/val_b_B.jsonl, then the CLI on the two
    artifacts; returns its exit status. Every engine-compare module uses it: the one-process-per-side path (logs,
    artifacts moved into place) is the tour's (tests/test_tour.py), and two more interpreters importing the engines
    cost about 25 s a module."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [_validate([*overrides, f"trainer.output_dir={out / f'run_{side}_{backend}'}"], backend,
                       out / f"val_{side}_{backend}.jsonl") for side, backend in zip("ab", backends.split(","))]
    return main([*map(str, paths), "--out", str(out), *options])


def test_hf_vs_vllm_fp32_is_aligned_and_exact(hf_vs_vllm):
    status, out = hf_vs_vllm
    report = json.loads((out / "report.json").read_text())
    assert status == 0 and report["ok"]
    assert report["summary"]["exact"] == report["summary"]["samples"] == 7
    assert report["summary"]["max_abs_logprob_delta"] < 1e-4, "fp32 engines agree to float rounding"
    assert (out / "report.html").stat().st_size > 0 and (out / "val_a_hf.jsonl").exists()


def _fp32_margins(overrides, splits):
    """For each (row, token position, A's response, B's response) that split there: |lp(A's token) - lp(B's token)|
    under the HF fp32 reference, teacher-forced on the shared prefix (the two responses agree before the split)."""
    from vlmrl.config import load_config
    from vlmrl.trainer.components import load_run_processor, start_run_backend
    from vlmrl.trainer.validation import load_val_dataset

    config = load_config([*overrides, "trainer.val_only=true", "rollout.name=hf", "rollout.dtype=float32"])
    dataset, processor = load_val_dataset(config), load_run_processor(config)
    margins = []
    with start_run_backend(config, "hf") as hf:
        for index, position, ids_a, ids_b in splits:
            request = processor.build_request(dataset[index], index)
            lp_a = hf.score([request], [ids_a[: position + 1]])[0][position]
            lp_b = hf.score([request], [ids_b[: position + 1]])[0][position]
            margins.append(abs(lp_a - lp_b))
    return margins


@pytest.fixture(scope="module")
def bf16_sides(setup):
    """vLLM's and SGLang's bfloat16 validation artifacts (each validated in this process)."""
    root, overrides = setup
    bf16 = [*overrides, "rollout.dtype=bfloat16"]
    return [_validate(bf16, backend, root / f"val_{backend}_bf16.jsonl") for backend in ("vllm", "sglang")]


@pytest.mark.sglang
def test_vllm_vs_sglang_bf16_near_ties_are_near_ties_in_fp32(setup, bf16_sides):
    """In bf16 (the production dtype) the engines split on some tokens (in fp32 they agree exactly, measured).
    Whatever they do is bucketed truthfully: every near-tie is a near-tie of the fp32 reference model too."""
    root, overrides = setup
    sides = bf16_sides
    status = main([*map(str, sides), "--out", str(root / "vllm_vs_sglang"), "--no-html"])
    (meta_a, rec_a), (meta_b, rec_b) = map(read_artifact, sides)
    comparison = compare_artifacts(meta_a, rec_a, meta_b, rec_b)
    assert status == (0 if comparison.ok else 1) and meta_a.config["rollout"]["dtype"] == "bfloat16"
    assert Cause.INPUT_MISMATCH not in comparison.cause_counts, "both engines got the same requests"
    assert all(s.divergence is not None for s in comparison.differing()), "greedy, same budget: splits only"
    ties = [s for s in comparison.samples if s.cause == Cause.NEAR_TIE]
    ids_a = {r.index: r.response_ids for r in rec_a}
    ids_b = {r.index: r.response_ids for r in rec_b}
    margins = _fp32_margins(overrides, [(s.index, s.divergence.position, ids_a[s.index], ids_b[s.index]) for s in ties])
    assert all(m < Thresholds().near_tie_margin for m in margins), list(zip([s.explanation for s in ties], margins))


@pytest.mark.sglang
def test_a_float32_trainer_on_each_bfloat16_engines_samples_is_within_the_band(setup, bf16_sides):
    """The float32 trainer scoring vLLM's and SGLang's bfloat16 samples: the same inputs, every difference bucketed
    precision (within the bfloat16 band), aligned; the gap is the engines' rounding, so it is larger than float32's."""
    root, overrides = setup
    for side in bf16_sides:
        engine = read_artifact(side)
        trainer = _trainer_scores(overrides, side, root / f"trainer_{engine[0].backend}_bf16.jsonl")
        comparison = compare_artifacts(*engine, *read_artifact(trainer))
        assert comparison.ok and set(comparison.cause_counts) <= {Cause.PRECISION}, engine[0].backend
        assert_precision_by_rule(comparison)
        assert 1e-3 < comparison.max_abs_logprob_delta < Thresholds().drift_tolerance


def assert_precision_by_rule(comparison) -> None:
    """Between sides of different dtypes, a sample with the same tokens is bucketed precision exactly when its
    largest |logprob delta| is beyond float32's drift tolerance (and within the band: the comparison is ok), and
    exact otherwise: the rule the report states, for any samples (no count measured on these prompts)."""
    fp32 = FP32_THRESHOLDS["drift_tolerance"]
    for sample in comparison.samples:
        beyond = sample.max_abs_logprob_delta is not None and sample.max_abs_logprob_delta > fp32
        assert (sample.cause == Cause.PRECISION) == (sample.tokens_equal and beyond), (sample.uid, sample.explanation)


def test_other_max_pixels_is_an_input_mismatch(setup, hf_vs_vllm):
    root, overrides = setup
    _, out = hf_vs_vllm
    small = _validate([*overrides, "data.max_pixels=6272"], "hf", root / "val_hf_small.jsonl")
    status = main([str(out / "val_a_hf.jsonl"), str(small), "--out", str(root / "pixels"), "--no-html"])
    report = json.loads((root / "pixels" / "report.json").read_text())
    assert status == 1
    assert report["summary"]["causes"]["input_mismatch"] == 6, "the 6 image rows; the text row is unaffected"
    assert {"key": "config.data.max_pixels", "a": 12544, "b": 6272} in report["setting_differences"]
    mismatch = next(s for s in report["samples"] if s["cause"] == "input_mismatch")
    assert any("resized to" in d for d in mismatch["input_diffs"])


@pytest.fixture(scope="module")
def perturbed_model(setup, tiny_model_path):
    """The tiny model with its language blocks' weights moved by 0.3 std: a model that computes differently."""
    import torch
    from safetensors.torch import load_file, save_file

    root, _ = setup
    perturbed = root / "perturbed"
    shutil.copytree(tiny_model_path, perturbed)
    weights = load_file(perturbed / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in sorted(weights.items()):
        if tensor.dim() >= 2 and "layers" in name and "visual" not in name:  # the language model's blocks
            weights[name] = tensor + torch.randn(tensor.shape, generator=generator) * tensor.std() * 0.3
    save_file(weights, perturbed / "model.safetensors", metadata={"format": "pt"})
    return perturbed


def test_perturbed_weights_are_named_and_are_real_divergences(setup, hf_vs_vllm, perturbed_model):
    """Other weight files: every sample is put down to them (the headers' fingerprints differ), with what they did
    (a real divergence); without fingerprints (artifacts of a run inside training) the divergences themselves."""
    root, overrides = setup
    _, out = hf_vs_vllm
    other = _validate([*overrides, f"actor.model_path={perturbed_model}"], "hf", root / "val_hf_perturbed.jsonl")
    meta_a, rec_a = read_artifact(out / "val_a_hf.jsonl")
    meta_b, rec_b = read_artifact(other)
    comparison = compare_artifacts(meta_a, rec_a, meta_b, rec_b)
    assert comparison.cause_counts == {Cause.WEIGHTS_DIFFER: 7} and not comparison.ok
    assert all(s.explanation.startswith("the sides loaded other weights") and "top-k" in s.explanation
               for s in comparison.samples)
    meta_a.weights = meta_b.weights = ""
    assert compare_artifacts(meta_a, rec_a, meta_b, rec_b).cause_counts == {Cause.REAL_DIVERGENCE: 7}


def _trainer_scores(overrides, reference, out):
    from vlmrl.config import load_config
    from vlmrl.trainer.teacher_forcing import score_reference

    return score_reference(load_config([*overrides, "trainer.val_only=true", "rollout.name=vllm"]), reference, out)


def test_the_trainer_scores_vllms_samples_as_vllm_did(setup, hf_vs_vllm):
    """The trainer side (the actor with padding-free packing, token-budget micro-batches and 3-token logprob chunks)
    on vLLM's fp32 samples: the same inputs, and logprobs equal to float rounding on every token."""
    from vlmrl.alignment.precision import FP32_THRESHOLDS

    root, overrides = setup
    _, out = hf_vs_vllm
    packed = ["actor.padding_free=true", "actor.micro_batch_tokens=300", "actor.logprob_chunk_size=3"]
    trainer = _trainer_scores([*overrides, *packed], out / "val_b_vllm.jsonl", root / "trainer_vllm.jsonl")
    meta_t, rec_t = read_artifact(trainer)
    assert meta_t.backend == "trainer" and meta_t.dtype == "float32" and meta_t.weights
    comparison = compare_artifacts(*read_artifact(out / "val_b_vllm.jsonl"), meta_t, rec_t,
                                   Thresholds(**FP32_THRESHOLDS))
    assert comparison.ok and comparison.exact == comparison.total == 7, [s.explanation for s in comparison.samples]
    assert comparison.max_abs_logprob_delta < 1e-4
    assert sum(len(r.response_ids) for r in rec_t) > 7, "real responses were scored, not empty ones"


# A variant (marker `full`, make test-all; 48 s): the trainer side at dp = 2. make test keeps the trainer side at
# dp = 1 above and dp = 2 == dp = 1 for the same logprob pass (tests/distributed/test_group.py).
@pytest.mark.ray
@pytest.mark.full
def test_the_sharded_trainer_at_dp2_scores_vllms_samples_as_one_device_does(setup, hf_vs_vllm):
    """trainer.n_gpus_per_node=2: the run's FSDP2 actor on two Ray workers (packing, token budget and chunks on),
    each rank scoring its slice of the 7 samples and a padding row: every sample exact against vLLM, and equal to
    the single-device trainer's logprobs to float rounding."""
    from tests.ray_helpers import local_ray
    from vlmrl.alignment.precision import FP32_THRESHOLDS

    root, overrides = setup
    _, out = hf_vs_vllm
    packed = ["actor.padding_free=true", "actor.micro_batch_tokens=300", "actor.logprob_chunk_size=3"]
    one = _trainer_scores([*overrides, *packed], out / "val_b_vllm.jsonl", root / "trainer_dp1.jsonl")
    with local_ray(num_cpus=2):
        two = _trainer_scores([*overrides, *packed, "trainer.n_gpus_per_node=2"], out / "val_b_vllm.jsonl",
                              root / "trainer_dp2.jsonl")
    meta_2, rec_2 = read_artifact(two)
    assert meta_2.dtype == "float32" and meta_2.config["trainer"]["n_gpus_per_node"] == 2
    comparison = compare_artifacts(*read_artifact(out / "val_b_vllm.jsonl"), meta_2, rec_2,
                                   Thresholds(**FP32_THRESHOLDS))
    assert comparison.ok and comparison.exact == comparison.total == 7, [s.explanation for s in comparison.samples]
    _, rec_1 = read_artifact(one)
    deltas = [abs(a - b) for r1, r2 in zip(rec_1, rec_2) for a, b in zip(r1.response_logprobs, r2.response_logprobs)]
    assert len(deltas) == sum(len(r.response_ids) for r in rec_1) > 7 and max(deltas) < 1e-5


def test_a_bfloat16_trainer_against_a_float32_engine_is_precision_within_the_band(setup, hf_vs_vllm):
    """actor.dtype=bfloat16 scoring vLLM's float32 samples: logprobs off by more than float32 rounding, within the
    bfloat16 band: bucketed precision (not drift), and aligned."""
    root, overrides = setup
    _, out = hf_vs_vllm
    trainer = _trainer_scores([*overrides, "actor.dtype=bfloat16"], out / "val_b_vllm.jsonl",
                              root / "trainer_bf16.jsonl")
    meta_t, rec_t = read_artifact(trainer)
    comparison = compare_artifacts(*read_artifact(out / "val_b_vllm.jsonl"), meta_t, rec_t)
    assert meta_t.dtype == "bfloat16" and comparison.ok
    assert set(comparison.cause_counts) == {Cause.PRECISION}
    assert_precision_by_rule(comparison)
    assert "band of float32 vs bfloat16" in comparison.differing()[0].explanation


def test_a_trainer_on_other_weights_or_other_pixels_is_named(setup, hf_vs_vllm, perturbed_model):
    """What trainer-vs-engine failures look like: a trainer on other weights (the engine's tokens, its own logprobs:
    every sample put down to the weights) and a trainer that resizes images otherwise (input mismatch on the 6
    image rows, the text row exact)."""
    root, overrides = setup
    _, out = hf_vs_vllm
    vllm = read_artifact(out / "val_b_vllm.jsonl")
    stale = _trainer_scores([*overrides, f"actor.model_path={perturbed_model}"], out / "val_b_vllm.jsonl",
                            root / "trainer_perturbed.jsonl")
    comparison = compare_artifacts(*vllm, *read_artifact(stale))
    assert comparison.cause_counts == {Cause.WEIGHTS_DIFFER: 7}
    assert all(s.tokens_equal and "logprobs differ by up to" in s.explanation for s in comparison.samples)
    small = _trainer_scores([*overrides, "data.max_pixels=6272"], out / "val_b_vllm.jsonl", root / "trainer_px.jsonl")
    comparison = compare_artifacts(*vllm, *read_artifact(small))
    assert comparison.cause_counts == {Cause.INPUT_MISMATCH: 6} and comparison.exact == 1


def test_different_reward_function_is_a_reward_disagreement(setup, hf_vs_vllm):
    root, overrides = setup
    _, out = hf_vs_vllm
    other = _validate([*overrides, f"reward.function={root / 'rewards.py'}:by_first_char"], "hf",
                      root / "val_hf_reward.jsonl")
    meta_a, rec_a = read_artifact(out / "val_a_hf.jsonl")
    comparison = compare_artifacts(meta_a, rec_a, *read_artifact(other))
    assert set(comparison.cause_counts) == {Cause.REWARD_DISAGREEMENT}
    assert all(s.tokens_equal for s in comparison.samples)


def test_validate_only_artifact_is_the_backends_format(setup, hf_vs_vllm):
    """`python -m vlmrl.train trainer.val_only=true` and `compare --backends` write the same kind of file: they
    compare with each other, row for row, and on the same backend they agree exactly."""
    from vlmrl.train import main as train_main

    root, overrides = setup
    _, out = hf_vs_vllm
    assert train_main([*overrides, "trainer.val_only=true", "rollout.name=hf"]) == 0
    validate_only = root / "run" / "validation_hf_step0.jsonl"
    head_a = json.loads(validate_only.read_text().splitlines()[0])
    head_b = json.loads((out / "val_a_hf.jsonl").read_text().splitlines()[0])
    assert head_a.keys() == head_b.keys() and head_a["meta"].keys() == head_b["meta"].keys()
    assert main([str(validate_only), str(out / "val_a_hf.jsonl"), "--out", str(root / "same"), "--no-html"]) == 0
    report = json.loads((root / "same" / "report.json").read_text())
    assert report["summary"]["exact"] == 7
