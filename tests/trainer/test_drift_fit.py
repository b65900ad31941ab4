"""Real short runs with one weight sync dropped, or landed partly, on purpose: the demo (30 steps on vLLM) and the
tiny model on the hf backend. The drift artifact and the weights probe show the engine off the trainer's weights, and
`python -m vlmrl.alignment.drift` finds the jump at the step after and names `weights`."""

from __future__ import annotations

import doctest
import json
import logging

import pytest
import torch

from tests.trainer.test_fit import ROOT, base_args
from vlmrl.actor.local import Actor
from vlmrl.alignment import drift, weight_probe
from vlmrl.alignment.drift import main as drift_main
from vlmrl.alignment.drift_artifact import read_drift
from vlmrl.alignment.weight_probe import IN_SYNC, PARTIAL, STALE, read_probes
from vlmrl.config import ConfigError, load_config
from vlmrl.trainer import drift_samples
from vlmrl.trainer.drift_samples import drift_rows
from vlmrl.trainer.engine_probe import WeightProbeError
from vlmrl.trainer.fit import fit
from vlmrl.trainer.metrics import read_metrics

STEPS = 30
DROPPED = 15
"""The sync after this step's update is dropped: step DROPPED + 1 samples with step DROPPED - 1's weights."""


# A variant (marker `full`, make test-all; 42-48 s): make test keeps the drift detector on recorded drifts
# (tests/alignment/test_drift.py) and the weight probe naming a partly landed and an unlanded sync in the fit loop
# (the two tests below).
@pytest.mark.vllm
@pytest.mark.full
def test_a_dropped_weight_sync_in_the_demo_is_a_jump_with_the_cause_weights(tmp_path, monkeypatch, caplog):
    """The demo as `make demo` runs it (vLLM, its format warm-up, 16 prompts x 8 samples), for 30 steps, with the sync
    after step 15 falling on the floor without an error."""
    # call 1 is the format warm-up's sync (step 0), call k + 1 step k's
    monkeypatch.setattr(Actor, "sync_weights", _dropping(DROPPED + 1))
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="vlmrl.trainer"):
        fit(load_config([f"config={ROOT / 'examples' / 'configs' / 'tiny_synthetic.yaml'}",
                         f"trainer.total_steps={STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
                         "trainer.save_freq=-1", f"trainer.output_dir={out}"]))
    assert f"step {DROPPED}: the weight sync loaded nothing" in caplog.text

    records = read_drift(out)
    assert sorted({r.step for r in records}) == list(range(1, STEPS + 1))
    assert all(len([r for r in records if r.step == s]) == 6 for s in range(1, STEPS + 1)), "5% of 128"
    stale = {r.step for r in records if r.engine_weight_version != r.trainer_weight_version}
    assert stale == {DROPPED + 1}, "only the rollout right after the dropped sync ran on old weights"
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(STEPS + 1)), "step 0: the format warm-up's line"
    rows = rows[1:]
    assert all("mismatch/k3" in row and "timing/drift" in row for row in rows)

    report_dir = tmp_path / "report"
    assert drift_main([str(out), "--out", str(report_dir)]) == 1
    report = json.loads((report_dir / "drift.json").read_text())
    assert report["series"] == "mismatch/k3" and report["jump_steps"] == [DROPPED + 1]
    jump = next(s for s in report["steps"] if s["step"] == DROPPED + 1)
    assert {w["cause"] for w in jump["worst"]} == {"weights"} and len(jump["worst"]) == 5
    before = [s["metrics"]["mismatch/k3"] for s in report["steps"] if s["step"] <= DROPPED]
    assert jump["metrics"]["mismatch/k3"] > 100 * max(before), "a stale engine is far off a synced one"
    assert (report_dir / "drift.png").stat().st_size > 0 and (report_dir / "drift.html").exists()

    # the weights probe read the engine itself: stale right after the dropped sync, in sync again after the next
    probes = read_probes(out)
    assert [p.step for p in probes] == list(range(STEPS + 1))
    assert [p.step for p in probes if p.verdict != IN_SYNC] == [DROPPED]
    assert probes[DROPPED].verdict == STALE and abs(probes[DROPPED].landed_fraction) < 0.05
    assert probes[DROPPED + 1].reference_step == DROPPED - 1, "judged from the last probe in sync"
    judged = [p for p in probes[1:] if p.resolved and p.step != DROPPED]
    assert len(judged) >= STEPS // 2, "most syncs are judged (the others changed the probe's greedy tokens)"
    assert all(0.9 < p.landed_fraction < 1.1 for p in judged), "every other sync landed"
    assert [p["step"] for p in report["failed_probes"]] == [DROPPED]
    assert all("weight_probe/max_abs_dlogp" in row for row in rows)


def _dropping(call: int):
    """Actor.sync_weights whose `call`-th call falls on the floor without an error (the others sync)."""
    real_sync = Actor.sync_weights
    calls = []

    def sync(self, backend):
        calls.append(1)
        if len(calls) != call:
            real_sync(self, backend)

    return sync


def _holding_back(step: int, fragment: str):
    """Actor.sync_weights that, at the `step`-th sync, sends `fragment`'s tensors as the sync before sent them: the
    engine counts a weight load and every name arrives, but that part of the update does not land."""
    real_sync = Actor.sync_weights
    calls, sent = [], {}

    def sync(self, backend):
        calls.append(len(calls) + 1)
        state = list(self.named_tensors())
        if len(calls) == step:
            backend.update_weights([(name, sent.get(name, t)) for name, t in state])
            return
        sent.update({name: t.detach().clone() for name, t in state if fragment in name})
        real_sync(self, backend)

    return sync


def test_a_sync_that_landed_partly_is_named_by_the_probe_where_the_load_count_sees_none(tiny_model_path, tmp_path,
                                                                                     monkeypatch, caplog):
    """The sync after step PARTLY sends the first decoder layer's tensors from before training: the backend counts
    the load (every drift record says the engine was on the trainer's step), yet the probe after it says partial,
    and the drift tool puts the next step's jump down to the weights through that probe."""
    partly = 8
    monkeypatch.setattr(Actor, "sync_weights", _holding_back(partly, "language_model.layers.0."))
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="vlmrl"):
        fit(load_config(base_args(tiny_model_path, out, "trainer.total_steps=12", "trainer.test_freq=-1",
                                  "trainer.val_before_train=false", "rollout.temperature=1.0")))
    assert "the weight sync loaded nothing" not in caplog.text
    assert f"step {partly}: weight probe partial" in caplog.text
    assert all(not r.weights_stale for r in read_drift(out)), "the load count saw every sync land"
    probes = read_probes(out)
    assert [p.step for p in probes if p.failed] == [partly] and probes[partly].verdict == PARTIAL
    assert 0.25 < probes[partly].landed_fraction < 0.9 and probes[partly + 1].verdict == IN_SYNC
    report_dir = tmp_path / "report"
    assert drift_main([str(out), "--out", str(report_dir)]) == 1
    report = json.loads((report_dir / "drift.json").read_text())
    assert [p["step"] for p in report["failed_probes"]] == [partly]
    assert report["jump_steps"] == [partly + 1]
    worst = next(s for s in report["steps"] if s["step"] == partly + 1)["worst"]
    assert {w["cause"] for w in worst} == {"weights"}
    assert all(f"weights probe after step {partly}'s sync: partial" in w["explanation"] for w in worst)


def test_weight_probe_action_error_stops_the_run_at_the_step_whose_sync_did_not_land(tiny_model_path, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setattr(Actor, "sync_weights", _dropping(2))
    out = tmp_path / "run"
    with pytest.raises(WeightProbeError, match=r"step 2: weight probe stale: .*the sync did not land"):
        fit(load_config(base_args(tiny_model_path, out, "trainer.total_steps=4", "trainer.test_freq=-1",
                                  "trainer.val_before_train=false", "trainer.weight_probe_action=error")))
    assert [row["step"] for row in read_metrics(out / "metrics.jsonl")] == [1], "no step trained on after it"


def test_drift_rows_are_seeded_by_step_skip_padding_and_keep_at_least_one():
    padding = torch.tensor([False] * 60 + [True] * 4)
    rows = drift_rows(padding, 0.05, seed=1, step=7)
    assert rows == drift_rows(padding, 0.05, seed=1, step=7), "a rerun or a resumed run keeps the same rows"
    assert len(rows) == 3 and all(row < 60 for row in rows)
    assert drift_rows(padding, 0.05, seed=1, step=8) != rows or drift_rows(padding, 0.05, seed=2, step=7) != rows
    assert len(drift_rows(torch.tensor([False] * 4), 0.05, 1, 1)) == 1
    assert drift_rows(padding, 0.0, 1, 1) == [] and drift_rows(torch.tensor([True] * 4), 0.05, 1, 1) == []


@pytest.mark.parametrize(("setting", "says"), [
    ("trainer.drift_fraction=1.5", r"trainer.drift_fraction=1.5 must be in \[0, 1\]"),
    ("trainer.weight_probe_tokens=-1", r"trainer.weight_probe_tokens=-1 must be >= 0"),
    ("trainer.weight_probe_action=abort", r"trainer.weight_probe_action='abort' is not one of \['warn', 'error'\]")])
def test_a_drift_or_probe_setting_out_of_range_is_refused_at_load(setting, says):
    with pytest.raises(ConfigError, match=says):
        load_config(["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic", setting])


def test_docstring_examples_hold():
    for module in (drift, drift_samples, weight_probe):
        failures, tried = doctest.testmod(module)
        assert tried > 0 and failures == 0, module.__name__
