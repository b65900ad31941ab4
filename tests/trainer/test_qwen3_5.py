"""The fit loop on the embedded Qwen3.5 (hf backend, bfloat16 rollout, float32 trainer): a short run trains, syncs
and saves a checkpoint that is a complete Qwen3.5 folder whose linear-attention (Gated DeltaNet) and vision weights
moved; validate-only on it leaves it untouched and writes the artifact. (The engines loading such a folder, and weight
sync into them, are tests/rollout/qwen3_5's.)"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.trainer.test_fit import base_args
from tests.trainer.test_qwen3_vl import _digests, _names
from vlmrl.alignment.artifact import read_artifact
from vlmrl.config import load_config
from vlmrl.trainer.fit import fit
from vlmrl.trainer.metrics import read_metrics


def test_train_checkpoint_and_validate_only(tiny_qwen3_5_path, tmp_path):
    from transformers import AutoModelForImageTextToText

    from vlmrl.processors.loading import load_processor

    out = tmp_path / "run"
    fit(load_config(base_args(tiny_qwen3_5_path, out, "trainer.total_steps=2", "trainer.save_freq=2",
                              "trainer.val_before_train=false", "actor.padding_free=true")))
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and "val/accuracy" in rows[-1]
    assert all(row["reward/failures"] == 0 for row in rows)
    latest = out / "checkpoints" / "latest"
    assert os.readlink(latest) == "global_step_2" and _names(latest) == _names(Path(tiny_qwen3_5_path))
    assert load_processor(str(latest)).family.name == "Qwen3.5"
    trained = AutoModelForImageTextToText.from_pretrained(str(latest), dtype=torch.float32).state_dict()
    initial = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_5_path, dtype=torch.float32).state_dict()
    moved = [n for n in initial if not torch.equal(initial[n], trained[n])]
    assert any("linear_attn" in n for n in moved) and any("visual" in n for n in moved)

    before = _digests(latest)
    val = tmp_path / "val"
    metrics = fit(load_config(base_args(str(latest), val, "trainer.val_only=true", "data.train_files=")))
    assert _digests(latest) == before
    meta, records = read_artifact(val / "validation_hf_step2.jsonl")
    assert meta.backend == "hf" and meta.step == 2 and sorted(r.index for r in records) == list(range(8))
    assert meta.config["rollout"]["dtype"] in ("auto", "bfloat16")
    assert metrics["val/accuracy"] == sum(r.reward_extra["accuracy"] for r in records) / len(records)
