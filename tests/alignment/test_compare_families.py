"""The compare tool on real engines for every embedded dense family: one line per family in `MATRIX`.

Each family's `compare --backends hf,vllm` runs once (`Runs`: its sides validated in this process by
`compare_in_process`) on the colour set (6 image rows larger than the model's max_pixels + 1 text row), and every
check on the family reads that run: HF and vLLM aligned (exact in float32; within the bfloat16 band where the
family's engines compute only bfloat16 on CPU), SGLang aligned with them, the trainer scoring each engine's samples
(exactly, packed with token-budget micro-batches and 3-token logprob chunks; as precision within the band where the
engine computed in bfloat16), and the family's own checks (an engine started without a setting its model needs is
reported as not aligned, with the reason).

The default family (Qwen2.5-VL, `tiny`) runs the same checks in test_compare_engines.py, beside the tool tests that
reuse its run (one run there, not a second here); the default model on videos in test_compare_engines_video.py.

The runs are kept in a cache keyed by the model rather than a parametrised module fixture: a family's own checks are
parametrised for it alone, and pytest groups a parametrised fixture's tests by parameter index, which differs between
two parametrisations, so the family's run would be made again.

A new family: an entry in `vlmrl.models.families.FAMILIES`, its tiny builder, and one line here.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.alignment.test_compare_engines import IMAGE_SIZES, compare_in_process, family_setup, read_report
from tests.alignment.test_compare_engines import validate_side as _validate
from vlmrl.alignment.compare import main


@dataclass(frozen=True)
class Line:
    """How a family is held to the compare tool: its dtype, exact or banded, which engines each check reads."""

    dtype: str = "float32"
    """rollout.dtype; `auto` where the family's engines compute only bfloat16 on CPU (the headers record which)."""
    exact: bool = True
    """Float32 on every side: each sample exact, logprobs equal to float rounding. Else aligned within the bfloat16
    band (splits at near-ties, drift), and a float32 trainer on the engine's samples is precision, not exact."""
    sglang_against: tuple[str, ...] = ("vllm",)
    """The sides of the hf,vllm run SGLang's validation artifact is compared with."""
    trainer_on: tuple[str, ...] = ("vllm",)
    """The engines whose samples the trainer scores."""
    full: tuple[str, ...] = ()
    """Checks only `make test-all` runs ("sglang", "trainer"): another test covers the same path in make test."""


MATRIX: dict[str, Line] = {
    "tiny-qwen3-vl": Line(sglang_against=("vllm", "hf"), trainer_on=("vllm", "sglang")),
    # Not here: a mis-set engine caught in bfloat16. vLLM started without `mrope_interleaved` on this tiny random model
    # (family_engine_settings=false) measured like a correct one: 6 near-ties + 1 drift of 7, mean |dlogp| 0.0315
    # (correct: 0.0324), so bfloat16's noise hides it; the family settings whose absence does show (SGLang without
    # full_attention_interval or deepstack_visual_indexes) stop the engine before any output (tests/rollout/qwen3_5/).
    "tiny-qwen3.5": Line(dtype="auto", exact=False, sglang_against=("vllm", "hf")),
    # SGLang's side is `full` for these two (15-26 s each): make test holds SGLang to HF on nine requests in the engine
    # contract (tests/rollout/test_family_contract.py) and validates on SGLang in tests/trainer/test_glm4v.py and
    # test_internvl.py.
    "tiny-glm4v": Line(full=("sglang",)),
    "tiny-internvl": Line(full=("sglang",)),
}
"""Embedded model -> how its family is held to the compare tool."""

DEFAULT = "tiny"
"""The default model: its line's checks are in test_compare_engines.py, on the run its tool tests share."""

ROWS = len(IMAGE_SIZES) + 1
"""The colour set's rows: the image rows and one text row."""

ALIGNED_CAUSES = {"exact", "near_tie", "logprob_drift"}
"""What two correct bfloat16 implementations may show: equal samples, splits at near-ties, logprob drift."""

PACKED = ["actor.padding_free=true", "actor.micro_batch_tokens=300", "actor.logprob_chunk_size=3"]
"""The trainer side's packing, token-budget micro-batches and logprob chunks."""


class Runs:
    """Each family's set-up, `compare --backends hf,vllm` run and SGLang side, made on first use and kept for the
    module."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._setups: dict[str, tuple[Path, list[str], Path]] = {}
        self._runs: dict[str, tuple[int, Path]] = {}
        self._sglang: dict[str, Path] = {}

    def setup(self, variant: str) -> tuple[Path, list[str], Path]:
        """(folder, the overrides every side shares, the model) of `variant` (`family_setup`)."""
        if variant not in self._setups:
            self._setups[variant] = family_setup(self._tmp, variant, f"rollout.dtype={MATRIX[variant].dtype}")
        return self._setups[variant]

    def hf_vs_vllm(self, variant: str) -> tuple[int, Path]:
        """`compare --backends hf,vllm` on `variant`: (exit status, out folder)."""
        if variant not in self._runs:
            root, overrides, _ = self.setup(variant)
            self._runs[variant] = compare_in_process("hf,vllm", overrides, root / "hf_vs_vllm"), root / "hf_vs_vllm"
        return self._runs[variant]

    def side(self, variant: str, backend: str) -> Path:
        """`backend`'s validation artifact on `variant`: HF's and vLLM's from the hf,vllm run, SGLang's its own."""
        if backend != "sglang":
            return self.hf_vs_vllm(variant)[1] / {"hf": "val_a_hf.jsonl", "vllm": "val_b_vllm.jsonl"}[backend]
        if variant not in self._sglang:
            root, overrides, _ = self.setup(variant)
            self._sglang[variant] = _validate(overrides, "sglang", root / "val_sglang.jsonl")
        return self._sglang[variant]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory)


def _params(check: str, pairs) -> list:
    """pytest params (variant, backend) for `check` on the given pairs, marked with the engines they start and `full`
    where the family's line says so."""
    params = []
    for variant, backend in pairs:
        marks = [pytest.mark.vllm] + ([pytest.mark.sglang] if backend == "sglang" or check == "sglang" else [])
        params.append(pytest.param(variant, backend, id=f"{variant}-{backend}",
                                   marks=marks + ([pytest.mark.full] if check in MATRIX[variant].full else [])))
    return params


def _causes(report: dict) -> dict[str, int]:
    return {cause: count for cause, count in report["summary"]["causes"].items() if count}


def assert_aligned(status: int, report: dict, line: Line) -> None:
    """Two correct engines on the colour set: exit 0, aligned, neither side's engine mis-set; in float32 every sample
    exact to float rounding, in bfloat16 only the differences two correct bfloat16 engines show, the mean within the
    band."""
    from vlmrl.alignment.diff import Thresholds

    causes = _causes(report)
    assert status == 0 and report["ok"], causes
    assert report["summary"]["samples"] == ROWS
    assert report["a"]["engine_problems"] == report["b"]["engine_problems"] == []
    if line.exact:
        assert report["summary"]["exact"] == ROWS, [s["explanation"] for s in report["samples"] if s["cause"]]
        assert report["summary"]["max_abs_logprob_delta"] < 1e-4, "fp32 engines agree to float rounding"
    else:
        assert set(causes) <= ALIGNED_CAUSES, causes
        assert report["summary"]["mean_abs_logprob_delta"] < Thresholds().max_mean_logprob_delta


@pytest.mark.vllm
@pytest.mark.parametrize("variant", list(MATRIX))
def test_hf_and_vllm_are_aligned(runs, variant):
    status, out = runs.hf_vs_vllm(variant)
    assert_aligned(status, read_report(out), MATRIX[variant])
    assert (out / "report.html").stat().st_size > 0


@pytest.mark.parametrize(("variant", "other"),
                         _params("sglang", [(v, o) for v, line in MATRIX.items() for o in line.sglang_against]))
def test_sglang_is_aligned_with_the_other_engine(runs, variant, other):
    """SGLang's validation artifact against the hf,vllm run's side of `other`."""
    root = runs.setup(variant)[0]
    out = root / f"{other}_vs_sglang"
    status = main([str(runs.side(variant, other)), str(runs.side(variant, "sglang")), "--out", str(out), "--no-html"])
    assert_aligned(status, read_report(out), MATRIX[variant])


@pytest.mark.parametrize(("variant", "engine"), _params(
    "trainer", [(v, e) for v, line in MATRIX.items() if line.exact for e in line.trainer_on]))
def test_the_trainer_scores_the_engines_samples_exactly(runs, variant, engine):
    """The trainer side (packed, token-budget micro-batches, 3-token logprob chunks) on the engine's float32
    samples: the same inputs, every sample exact under the float32 thresholds."""
    from vlmrl.alignment.artifact import read_artifact
    from vlmrl.alignment.diff import Thresholds, compare_artifacts
    from vlmrl.alignment.precision import FP32_THRESHOLDS
    from vlmrl.config import load_config
    from vlmrl.trainer.teacher_forcing import score_reference

    root, overrides, _ = runs.setup(variant)
    samples = runs.side(variant, engine)
    config = load_config([*overrides, *PACKED, "trainer.val_only=true", "rollout.name=vllm"])
    meta, records = read_artifact(score_reference(config, samples, root / f"trainer_{engine}.jsonl"))
    assert meta.backend == "trainer" and meta.dtype == "float32"
    comparison = compare_artifacts(*read_artifact(samples), meta, records, Thresholds(**FP32_THRESHOLDS))
    assert comparison.ok and comparison.exact == comparison.total == ROWS, [s.explanation for s in comparison.samples]
    assert comparison.max_abs_logprob_delta < 1e-4


@pytest.mark.parametrize(("variant", "engine"), _params(
    "trainer", [(v, e) for v, line in MATRIX.items() if not line.exact for e in line.trainer_on]))
def test_a_float32_trainer_on_bfloat16_samples_is_precision_not_exact(runs, variant, engine):
    """`--backends vllm,trainer` with the line's rollout.dtype: the engine computed in bfloat16 (its header says so,
    whatever its config says), the trainer in float32. Every sample whose logprobs differ by more than float32
    rounding is precision (different dtypes), none of them "exact"; the report says the bfloat16 thresholds judged
    it because a side computed below float32."""
    from vlmrl.alignment.artifact import read_artifact
    from vlmrl.alignment.precision import FP32_THRESHOLDS
    from vlmrl.config import load_config
    from vlmrl.trainer.teacher_forcing import score_reference

    root, overrides, _ = runs.setup(variant)
    samples = runs.side(variant, engine)
    meta, _ = read_artifact(samples)
    assert (meta.config["rollout"]["dtype"], meta.dtype) == (MATRIX[variant].dtype, "bfloat16")
    trainer = score_reference(load_config([*overrides, "trainer.val_only=true", "rollout.name=vllm"]), samples,
                              root / f"trainer_{engine}.jsonl")
    assert read_artifact(trainer)[0].dtype == "float32"
    main([str(samples), str(trainer), "--out", str(root / "trainer"), "--no-html"])
    report = read_report(root / "trainer")
    assert report["thresholds"]["band"] == "bfloat16"
    assert f"a side computed below float32 ({engine} bfloat16, trainer float32)" in report["thresholds"]["line"]
    apart = [s for s in report["samples"] if s["max_abs_logprob_delta"] > FP32_THRESHOLDS["drift_tolerance"]]
    assert apart, "bfloat16 against float32 differs beyond float32 rounding"
    assert all(s["cause"] in ("precision", "logprob_drift") for s in apart), [s["cause"] for s in apart]
    assert all("band of bfloat16 vs float32" in s["explanation"] for s in apart if s["cause"] == "precision")


def _copy_without(model: Path, folder: Path, *keys: str) -> Path:
    """A copy of `model` whose config.json lacks the key at the path `keys` (under text_config)."""
    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    parent = config["text_config"]
    for key in keys[:-1]:
        parent = parent[key]
    del parent[keys[-1]]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


# -- The families' own checks: each reads its family's hf,vllm run ------------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize("variant", ["tiny-glm4v"])
def test_vllm_without_attention_bias_is_not_aligned_and_the_report_says_why(runs, variant, capsys):
    """vLLM started on a GLM-4.1V config without `attention_bias` as it is (vlmrl's override turned off, as a
    deployment outside vlmrl would start it) drops the q/k/v biases: the tool exits 1 with divergences or drift on
    text and image rows alike, and names the family's reason for that side."""
    root, overrides, model = runs.setup(variant)
    biasless = _copy_without(model, root / "glm4v-biasless", "attention_bias")
    misset = _validate([*overrides, f"actor.model_path={biasless}", "rollout.family_engine_settings=false"], "vllm",
                       root / "val_vllm_misset.jsonl")
    status = main([str(runs.side(variant, "hf")), str(misset), "--out", str(root / "misset"), "--no-html"])
    report = read_report(root / "misset")
    assert status == 1 and not report["ok"]
    assert report["summary"]["max_abs_logprob_delta"] > 1e-2
    assert len(report["b"]["engine_problems"]) == 1 and "attention_bias" in report["b"]["engine_problems"][0]
    printed = " ".join(capsys.readouterr().out.split())
    assert "engine was started without a setting its model needs" in printed and "attention_bias" in printed


@pytest.fixture(scope="module")
def flagless(runs) -> Path:
    """Qwen3-VL with `mrope_interleaved` removed from config.json (transformers interleaves anyway)."""
    root, _, model = runs.setup("tiny-qwen3-vl")
    return _copy_without(model, root / "qwen3-vl-flagless", "rope_parameters", "mrope_interleaved")


@pytest.mark.vllm
@pytest.mark.parametrize("variant", ["tiny-qwen3-vl"])
def test_engine_without_mrope_interleaving_is_not_aligned(runs, variant, flagless):
    """vLLM started on the flagless config as it is (`rollout.family_engine_settings=false`, as a deployment outside
    vlmrl would) computes other rope angles than transformers: the tool exits 1 and names divergences (or logprob
    drift) on the image rows; the text row (1-D positions: all three sections carry the same position, so
    interleaving changes nothing) stays exact. Both sides are float32, so the tool's float32 thresholds apply: with
    the bf16 ones these splits (margins 0.03-0.2 nats) would pass as near-ties."""
    root, overrides, _ = runs.setup(variant)
    misset = _validate([*overrides, f"actor.model_path={flagless}", "rollout.family_engine_settings=false"], "vllm",
                       root / "val_vllm_misset.jsonl")
    status = main([str(runs.side(variant, "hf")), str(misset), "--out", str(root / "misset"), "--no-html"])
    report = read_report(root / "misset")
    assert status == 1 and not report["ok"]
    causes = _causes(report)
    assert set(causes) <= {"logprob_drift", "real_divergence", "near_tie"}, causes
    assert causes.get("real_divergence", 0) + causes.get("logprob_drift", 0) >= 1, causes
    assert report["summary"]["max_abs_logprob_delta"] > 1e-2
    text_row = next(s for s in report["samples"] if s["index"] == ROWS - 1)
    assert text_row["cause"] is None


@pytest.mark.vllm
@pytest.mark.parametrize("variant", ["tiny-qwen3-vl"])
def test_same_config_with_vlmrl_settings_is_aligned(runs, variant, flagless):
    """The same flagless config with vlmrl's default engine settings (it passes mrope_interleaved): exact again."""
    root, overrides, _ = runs.setup(variant)
    fixed = _validate([*overrides, f"actor.model_path={flagless}"], "vllm", root / "val_vllm_fixed.jsonl")
    assert main([str(runs.side(variant, "hf")), str(fixed), "--out", str(root / "fixed"), "--no-html"]) == 0
    report = read_report(root / "fixed")
    assert report["summary"]["exact"] == ROWS
    assert "config.actor.model_path" in {d["key"] for d in report["setting_differences"]}


def test_every_dense_family_has_a_line():
    """A dense family in FAMILIES whose embedded models have no line here (nor are the default model) would run no
    compare on real engines."""
    from vlmrl.models.families import FAMILIES

    covered = set(MATRIX) | {DEFAULT}
    missing = [f.name for f in FAMILIES if f.experts is None and not set(f.tiny_variants) & covered]
    assert not missing, f"dense families without a line in MATRIX: {missing}"
