"""examples/qwen2_5_vl_grpo.sh picks the run from MODEL_PATH: an embedded name runs the demo on that model, a Qwen3-VL
model (by its config.json, or by a hub id's name) takes the Qwen3-VL geo3k recipe. DRY_RUN=1 prints the command; the
printed arguments must load as a config (and, for the demo, build the processor the run would build)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrl.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def dry_run(**env: str) -> list[str]:
    """The `python -m vlmrl.train` arguments the script would run with."""
    done = subprocess.run(["bash", "examples/qwen2_5_vl_grpo.sh"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "DRY_RUN": "1", **env})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[:3] == [sys.executable, "-m", "vlmrl.train"], lines
    return lines[3:]


def value(args: list[str], key: str) -> str:
    found = [a.split("=", 1)[1] for a in args if a.startswith(key + "=")]
    assert found, f"{key} not set in {args}"
    return found[-1]


@pytest.mark.parametrize("model, output", [("tiny", "outputs/demo"), ("tiny-qwen3-vl", "outputs/demo-tiny-qwen3-vl")])
def test_an_embedded_name_runs_the_demo_on_that_model(model, output):
    args = dry_run(MODEL_PATH=model, ROLLOUT="hf")
    assert value(args, "config") == "examples/configs/tiny_synthetic.yaml"
    assert value(args, "trainer.output_dir") == output
    config = load_config(args)  # checks the model's context too
    assert config.actor.model_path == model and config.data.train_files == "synthetic"
    from vlmrl.processors import load_processor

    processor = load_processor(model, config.data)  # the demo's pixel bounds fit this model's processor
    assert processor.family.name == ("Qwen3-VL" if model == "tiny-qwen3-vl" else "Qwen2.5-VL")


@pytest.mark.parametrize("model, recipe", [("Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl_geo3k"),
                                           ("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_5_vl_geo3k")])
def test_a_hub_id_picks_its_familys_recipe_by_name(model, recipe):
    args = dry_run(MODEL_PATH=model, DATA_DIR="/data/geo3k")
    assert value(args, "config") == f"examples/configs/{recipe}.yaml"
    assert value(args, "trainer.output_dir") == f"outputs/{recipe}"
    config = load_config(args, check_model=False)
    assert config.actor.model_path == model and config.data.train_files == "/data/geo3k/train.parquet"


def test_a_local_folder_picks_the_recipe_of_its_config(tiny_model_path, tiny_qwen3_vl_path, tmp_path):
    """A folder's name says nothing: its config.json decides (both copies are named `policy`)."""
    for source, recipe in [(tiny_qwen3_vl_path, "qwen3_vl_geo3k"), (tiny_model_path, "qwen2_5_vl_geo3k")]:
        folder = tmp_path / recipe / "policy"
        shutil.copytree(source, folder)
        args = dry_run(MODEL_PATH=str(folder), DATA="geo3k")
        assert value(args, "config") == f"examples/configs/{recipe}.yaml"
        assert value(args, "actor.model_path") == str(folder)


def test_the_qwen3_vl_recipe_loads_and_fits_the_models_image_bounds():
    config = load_config([f"config={ROOT / 'examples' / 'configs' / 'qwen3_vl_geo3k.yaml'}"], check_model=False)
    # the released Qwen3-VL processors allow 65536..16777216 pixels: null = the model's minimum
    assert config.data.min_pixels is None and 65536 <= config.data.max_pixels <= 16777216
    assert config.data.max_pixels % (32 * 32) == 0
    assert (config.actor.optim.lr, config.rollout.n, config.actor.kl_loss_coef) == (1e-6, 5, 0.01)
