"""A real short run on the tiny model (hf backend) with one weight sync dropped on purpose: the drift artifact shows
the stale engine, and `python -m vlmrl.alignment.drift` finds the jump at the step after and names `weights`."""

from __future__ import annotations

import doctest
import json
import logging

import pytest
import torch

from tests.trainer.test_fit import base_args
from vlmrl.actor import Actor
from vlmrl.alignment import drift
from vlmrl.alignment.drift import main as drift_main
from vlmrl.alignment.drift_artifact import read_drift
from vlmrl.config import ConfigError, load_config
from vlmrl.trainer import drift as trainer_drift
from vlmrl.trainer.drift import drift_rows
from vlmrl.trainer.fit import fit
from vlmrl.trainer.metrics import read_metrics

STEPS = 24
DROPPED = 12
"""The sync after this step's update is dropped: step DROPPED + 1 samples with step DROPPED - 1's weights."""


def test_a_dropped_weight_sync_is_a_jump_with_the_cause_weights(tiny_model_path, tmp_path, monkeypatch, caplog):
    real_sync = Actor.sync_weights
    calls = []

    def sync_dropping_one(self, backend):  # the fault: one sync falls on the floor without an error
        calls.append(len(calls) + 1)
        if len(calls) != DROPPED:
            real_sync(self, backend)

    monkeypatch.setattr(Actor, "sync_weights", sync_dropping_one)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="vlmrl.trainer.fit"):
        fit(load_config(base_args(tiny_model_path, out, f"trainer.total_steps={STEPS}", "trainer.test_freq=-1",
                                  "trainer.val_before_train=false", "rollout.temperature=1.0")))
    assert f"step {DROPPED}: the weight sync loaded nothing" in caplog.text

    records = read_drift(out)
    assert sorted({r.step for r in records}) == list(range(1, STEPS + 1))
    assert all(len([r for r in records if r.step == s]) == 1 for s in range(1, STEPS + 1)), "5% of 16, at least 1"
    stale = {r.step for r in records if r.engine_weight_version != r.trainer_weight_version}
    assert stale == {DROPPED + 1}, "only the rollout right after the dropped sync ran on old weights"
    rows = read_metrics(out / "metrics.jsonl")
    assert all("mismatch/k3" in row and "timing/drift" in row for row in rows)

    report_dir = tmp_path / "report"
    assert drift_main([str(out), "--out", str(report_dir)]) == 1
    report = json.loads((report_dir / "drift.json").read_text())
    assert report["series"] == "mismatch/k3" and report["jump_steps"] == [DROPPED + 1]
    jump = next(s for s in report["steps"] if s["step"] == DROPPED + 1)
    assert [w["cause"] for w in jump["worst"]] == ["weights"]
    before = [s["metrics"]["mismatch/k3"] for s in report["steps"] if s["step"] <= DROPPED]
    assert jump["metrics"]["mismatch/k3"] > 100 * max(before), "a stale engine is far off a synced one"
    assert (report_dir / "drift.png").stat().st_size > 0 and (report_dir / "drift.html").exists()


def test_drift_rows_are_seeded_by_step_skip_padding_and_keep_at_least_one():
    padding = torch.tensor([False] * 60 + [True] * 4)
    rows = drift_rows(padding, 0.05, seed=1, step=7)
    assert rows == drift_rows(padding, 0.05, seed=1, step=7), "a rerun or a resumed run keeps the same rows"
    assert len(rows) == 3 and all(row < 60 for row in rows)
    assert drift_rows(padding, 0.05, seed=1, step=8) != rows or drift_rows(padding, 0.05, seed=2, step=7) != rows
    assert len(drift_rows(torch.tensor([False] * 4), 0.05, 1, 1)) == 1
    assert drift_rows(padding, 0.0, 1, 1) == [] and drift_rows(torch.tensor([True] * 4), 0.05, 1, 1) == []


def test_a_drift_fraction_outside_0_1_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"trainer.drift_fraction=1.5 must be in \[0, 1\]"):
        load_config(["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic",
                     "trainer.drift_fraction=1.5"])


def test_docstring_examples_hold():
    for module in (drift, trainer_drift):
        failures, tried = doctest.testmod(module)
        assert tried > 0 and failures == 0, module.__name__
