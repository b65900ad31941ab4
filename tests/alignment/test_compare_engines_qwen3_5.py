"""The compare tool on the embedded Qwen3.5 (bfloat16: its engines' only dtype on CPU) with the real engines: HF,
vLLM and SGLang are aligned under the tool's bfloat16 thresholds (the splits they show are near-ties), and an
engine started without one of the family's settings is reported as not aligned.

`compare --backends hf,vllm` runs as a user runs it; SGLang's side is validated in this process and compared with
that run's artifacts. The mis-set engine is vLLM on a copy of the model whose config.json lacks
`mrope_interleaved`, started with `rollout.family_engine_settings=false` (as a deployment outside vlmrl would).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.alignment.test_compare_engines import COLOURS, IMAGE_SIZES, REWARD_FILE, _image_bytes
from vlmrl.alignment.compare import main

pytestmark = pytest.mark.vllm  # every test reuses the `compare --backends hf,vllm` run

ALIGNED_CAUSES = {"exact", "near_tie", "logprob_drift"}
"""What two correct bfloat16 implementations may show: equal samples, splits at near-ties, logprob drift."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from vlmrl.models import ensure_built

    root = tmp_path_factory.mktemp("alignment_qwen3_5")
    rows = [{"data_source": "synthetic/colour", "prompt": [{"role": "user", "content": "<image>Which colour is on top?"}],
             "images": [{"bytes": _image_bytes(size, colour), "path": None}], "ability": "vision",
             "reward_model": {"style": "rule", "ground_truth": colour}, "extra_info": {"index": i}}
            for i, (size, colour) in enumerate(zip(IMAGE_SIZES, COLOURS))]
    rows.append({"data_source": "synthetic/text", "prompt": [{"role": "user", "content": "Name a colour."}],
                 "images": [], "ability": "text", "reward_model": {"style": "rule", "ground_truth": "red"},
                 "extra_info": {"index": 6}})
    data = root / "val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    (root / "rewards.py").write_text(REWARD_FILE)
    model = ensure_built("tiny-qwen3.5")
    overrides = [f"actor.model_path={model}", f"data.val_files={data}", "data.max_prompt_length=128",
                 "data.max_response_length=16", "rollout.dtype=bfloat16", "rollout.val_top_logprobs=5",
                 f"trainer.output_dir={root / 'run'}", f"reward.function={root / 'rewards.py'}:by_length",
                 "rollout.timeout_s=300"]
    return root, overrides, model


@pytest.fixture(scope="module")
def hf_vs_vllm(setup):
    root, overrides, _ = setup
    out = root / "hf_vs_vllm"
    return main(["--backends", "hf,vllm", *overrides, "--out", str(out)]), out


def _validate(overrides, backend, path):
    from vlmrl.config import load_config
    from vlmrl.trainer.validation import validate_with

    config = load_config([*overrides, "trainer.val_only=true", f"rollout.name={backend}"])
    return validate_with(config, backend, artifact_path=path).artifact_path


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _causes(report: dict) -> dict[str, int]:
    return {cause: count for cause, count in report["summary"]["causes"].items() if count}


def test_hf_vs_vllm_bf16_is_aligned(hf_vs_vllm):
    status, out = hf_vs_vllm
    report = _report(out)
    assert status == 0 and report["ok"], _causes(report)
    assert report["summary"]["samples"] == 7
    assert set(_causes(report)) <= ALIGNED_CAUSES, _causes(report)
    assert report["summary"]["exact"] >= 1


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


def test_engine_without_mrope_interleaving_is_not_aligned(setup, hf_vs_vllm):
    """vLLM on the flagless config computes other rope angles on the image rows than transformers: the tool exits 1,
    even under the bfloat16 thresholds."""
    root, overrides, model = setup
    folder = root / "qwen3_5-flagless"
    shutil.copytree(model, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["text_config"]["rope_parameters"]["mrope_interleaved"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    _, out = hf_vs_vllm
    misset = _validate([*overrides, f"actor.model_path={folder}", "rollout.family_engine_settings=false"], "vllm",
                       root / "val_vllm_misset.jsonl")
    status = main([str(out / "val_a_hf.jsonl"), str(misset), "--out", str(root / "misset"), "--no-html"])
    report = _report(root / "misset")
    print("MISSET", _causes(report), report["summary"].get("max_abs_logprob_delta"),
          report["summary"].get("mean_abs_logprob_delta"))
    assert status == 1 and not report["ok"], _causes(report)
