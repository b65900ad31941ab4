"""The fit loop on the embedded InternVL3.5 (a tiles family, 1-D positions): a short run on vLLM trains, syncs the
engine's weights (renamed to the checkpoint's `language_model.model.*` / `vision_tower.*` / `multi_modal_projector.*`)
and saves a checkpoint that is a complete InternVL folder; validate-only from it on SGLang (text-form requests)
leaves it untouched and writes the artifact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.trainer.test_fit import base_args
from tests.trainer.test_glm4v import _digests, _names
from vlmrl.alignment.artifact import read_artifact
from vlmrl.config import load_config
from vlmrl.trainer.fit import fit
from vlmrl.trainer.metrics import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.sglang]

TILES = ("data.max_pixels=null",)  # pixel bounds do not apply to a tiles family (each image is cut into tiles)


def test_train_on_vllm_checkpoint_and_validate_only_on_sglang(tmp_path):
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.tiny import ensure_built
    from vlmrl.processors.loading import load_processor

    base = str(ensure_built("tiny-internvl"))
    out = tmp_path / "run"
    fit(load_config(base_args(base, out, "rollout.name=vllm", "rollout.dtype=float32", "trainer.total_steps=2",
                              "trainer.save_freq=2", "trainer.val_before_train=false", *TILES)))
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and "val/accuracy" in rows[-1]
    assert all(row["reward/failures"] == 0 for row in rows)
    latest = out / "checkpoints" / "latest"
    assert os.readlink(latest) == "global_step_2"
    assert _names(latest) == _names(Path(base))  # the saved layout, as transformers writes it
    processor = load_processor(str(latest))
    assert processor.family.name == "InternVL3.5" and processor.tokens_per_tile == 16
    trained = AutoModelForImageTextToText.from_pretrained(str(latest), dtype=torch.float32).state_dict()
    initial = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32).state_dict()
    moved = [n for n in initial if not torch.equal(initial[n], trained[n])]
    assert any("vision_tower" in n for n in moved) and any("multi_modal_projector" in n for n in moved)
    assert any("language_model" in n for n in moved)

    before = _digests(latest)
    val = tmp_path / "val"
    metrics = fit(load_config(base_args(str(latest), val, "trainer.val_only=true", "data.train_files=",
                                        "rollout.name=sglang", "rollout.dtype=float32", *TILES)))
    assert _digests(latest) == before
    meta, records = read_artifact(val / "validation_sglang_step2.jsonl")
    assert meta.backend == "sglang" and meta.step == 2 and sorted(r.index for r in records) == list(range(8))
    assert metrics["val/accuracy"] == sum(r.reward_extra["accuracy"] for r in records) / len(records)
