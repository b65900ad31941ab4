"""The compare tool on a video validation set with the real engines (tiny Qwen2.5-VL, fp32, CPU): HF, vLLM and
SGLang agree exactly on every video row, and a one-sided change of the sampling rate is an input mismatch.

The set: six rows of the synthetic `last_colour` task (4 frames of 112x112 at data.video_fps, two temporal patches
per video: the case where sglang 0.5.23's own Qwen2.5-VL tower attends across temporal patches and drifts by up to
7e-3 nats, see `EngineFacts.sglang_video_per_step_grids`), two `motion` rows, and one row holding an image and a video.
`compare --backends hf,vllm` runs once, as a user runs it (each side its own validate-only process); SGLang's side is
validated in this process (what a side of `--backends` runs, without another interpreter importing the engines) and
compared with that run's HF artifact.
"""

from __future__ import annotations

import json

import pytest

from tests.alignment.test_compare_engines import REWARD_FILE, _image_bytes, compare_in_process
from vlmrl.alignment.artifact import read_artifact
from vlmrl.alignment.compare import main
from vlmrl.data.synthetic import generate_rows, write_rows

pytestmark = pytest.mark.vllm

ROWS = 9


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_path):
    root = tmp_path_factory.mktemp("alignment_video")
    rows = generate_rows("last_colour", 6, seed=4, split="val") + generate_rows("motion", 2, seed=4, split="val")
    mixed = dict(rows[0], prompt=[{"role": "user", "content": "<image>First this, then <video>: which colour?"}],
                 images=[{"bytes": _image_bytes((168, 112), "green"), "path": None}])
    data = write_rows([*rows, mixed], root / "val.parquet")
    (root / "rewards.py").write_text(REWARD_FILE)
    overrides = [f"actor.model_path={tiny_model_path}", f"data.val_files={data}", "data.max_prompt_length=256",
                 "data.max_response_length=16", "data.video_fps=2.0", "rollout.dtype=float32",
                 "rollout.val_top_logprobs=5", f"reward.function={root / 'rewards.py'}:by_length",
                 "rollout.timeout_s=300"]
    return root, overrides


def _compare(setup, backends: str):
    root, overrides = setup
    out = root / backends.replace(",", "_vs_")
    status = compare_in_process(backends, overrides, out, "--no-html")
    return status, out, json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def hf_vs_vllm(setup):
    return _compare(setup, "hf,vllm")


def _assert_exact(status, report):
    assert report["summary"]["samples"] == ROWS
    assert status == 0 and report["ok"], report["summary"]
    assert report["summary"]["exact"] == ROWS, [s["explanation"] for s in report["samples"] if s["cause"]]
    assert report["summary"]["max_abs_logprob_delta"] < 1e-4, "fp32 engines agree to float rounding"


def test_hf_vs_vllm_on_videos_is_aligned_and_exact(hf_vs_vllm):
    status, out, report = hf_vs_vllm
    _assert_exact(status, report)
    _, records = read_artifact(out / "val_b_vllm.jsonl")
    assert all(len(r.videos) == 1 and r.videos[0]["fps"] == 2.0 and r.videos[0]["num_frames"] == 4
               for r in records), "every row went as a video of 4 frames at the configured rate"
    assert sum(len(r.image_hashes) for r in records) == 1, "and the mixed row its image"


# A variant (marker `full`, make test-all): the compare tool on videos is shown on vLLM above; SGLang's video outputs
# equal HF's through the same per-temporal-patch grids on both video families in tests/rollout/test_video_sglang.py.
@pytest.mark.sglang
@pytest.mark.full
def test_hf_vs_sglang_on_videos_is_aligned_and_exact(setup, hf_vs_vllm):
    """Without vlmrl's per-temporal-patch grids SGLang's video features differ from HF's on every row here (1e-3 to
    7e-3 nats per token, over the fp32 mean threshold of 1e-3)."""
    from vlmrl.config import load_config
    from vlmrl.trainer.validation import validate_with

    root, overrides = setup
    _, first, _ = hf_vs_vllm
    config = load_config([*overrides, "trainer.val_only=true", "rollout.name=sglang",
                          f"trainer.output_dir={root / 'run_sglang'}"])
    sglang = validate_with(config, "sglang", artifact_path=root / "val_sglang.jsonl").artifact_path
    out = root / "hf_vs_sglang"
    status = main([str(first / "val_a_hf.jsonl"), str(sglang), "--out", str(out), "--no-html"])
    _assert_exact(status, json.loads((out / "report.json").read_text()))


def test_a_one_sided_fps_change_is_an_input_mismatch(setup, hf_vs_vllm):
    """The same frames declared at 4 fps on one side: other timing, other temporal position ids, so every row is an
    input mismatch (not a model difference), and the report names the setting and the video's rate."""
    from vlmrl.config import load_config
    from vlmrl.trainer.validation import validate_with

    root, overrides = setup
    _, out, _ = hf_vs_vllm
    config = load_config([*overrides, "data.video_fps=4.0", "trainer.val_only=true", "rollout.name=hf",
                          f"trainer.output_dir={root / 'run_fps4'}"])
    fast = validate_with(config, "hf", artifact_path=root / "val_hf_fps4.jsonl").artifact_path
    status = main([str(out / "val_a_hf.jsonl"), str(fast), "--out", str(root / "fps"), "--no-html"])
    report = json.loads((root / "fps" / "report.json").read_text())
    assert status == 1 and not report["ok"]
    assert report["summary"]["causes"]["input_mismatch"] == ROWS
    assert {"key": "config.data.video_fps", "a": 2.0, "b": 4.0} in report["setting_differences"]
    assert all(any("video 0 fps 2.0 vs 4.0" in d for d in s["input_diffs"]) for s in report["samples"])
