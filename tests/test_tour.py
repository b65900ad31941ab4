"""The README's tour, command by command, with short settings: train (the demo script), validate what it trained
through `checkpoints/latest`, compare vLLM and SGLang on it, and find the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The demo's recipe, shortened: the same config file, fewer steps and rows.
SHORT = ["trainer.total_steps=2", "trainer.format_warmup_steps=2", "data.synthetic_train_size=64",
         "data.synthetic_val_size=8"]


def _run(command: list[str], **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, **env})
    assert done.returncode == 0, f"{command[:4]}... exited {done.returncode}: {done.stderr[-3000:]}"
    return done


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.sglang
def test_the_tour_runs_as_written(tmp_path):
    demo = tmp_path / "demo"
    # 1. train (what `make demo` runs)
    trained = _run(["bash", "examples/qwen2_5_vl_grpo.sh", *SHORT], OUTPUT_DIR=str(demo))
    latest = demo / "checkpoints" / "latest"
    for name in ("metrics.jsonl", "curves.png", "engine.log", "checkpoints/latest/model.safetensors"):
        assert (demo / name).exists(), f"the demo did not write {name}"
    assert os.readlink(latest) == "global_step_2"
    # vLLM logs a line per weight sync (the prefix-cache reset after each load): engine.log, not the console
    per_sync = "reset prefix cache"
    assert per_sync not in trained.stdout + trained.stderr, "vLLM's per-sync lines belong in engine.log"
    assert per_sync in (demo / "engine.log").read_text()

    # 2. validate what it trained: the demo's config (not the real recipe), on the trained weights
    validated = _run(["bash", "examples/qwen2_5_vl_grpo.sh", *SHORT], VAL_ONLY="1", MODEL_PATH=str(latest),
                     OUTPUT_DIR=str(tmp_path / "demo-val"))
    artifact = tmp_path / "demo-val" / "validation_vllm_step2.jsonl"
    assert artifact.exists(), validated.stdout[-2000:]
    assert "val/accuracy by step: 2:" in validated.stdout

    # 3. compare the engines on it; 4. the report
    report = tmp_path / "demo-compare"
    _run([sys.executable, "-m", "vlmrl.alignment.compare", "--backends", "vllm,sglang",
          "config=examples/configs/tiny_synthetic.yaml", f"actor.model_path={latest}", *SHORT,
          f"trainer.output_dir={tmp_path / 'compare-runs'}", "--out", str(report)])
    assert (report / "report.html").stat().st_size > 0
    assert json.loads((report / "report.json").read_text())
    # each side ran as its own validate-only process: its log is kept, its artifact was moved into place
    for side, backend in (("a", "vllm"), ("b", "sglang")):
        log = (report / f"val_{side}_{backend}.log").read_text().splitlines()
        assert f"trainer.val_only=true rollout.name={backend}" in log[0], log[:2]
        assert (report / f"val_{side}_{backend}.jsonl").exists()
        assert not list((report / f"run_{side}_{backend}").glob("validation_*.jsonl"))
