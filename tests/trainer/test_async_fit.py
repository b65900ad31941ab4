"""The asynchronous placement (trainer.async_rollout) in real runs on the tiny model: max_staleness=0 is the
synchronous run exactly; with max_staleness=1 the rollout thread runs ahead and no consumed batch is older than the
bound; a run killed with SIGKILL and resumed trains on every prompt once; a failing rollout thread stops the run
with its error; what the placement does not run with is refused at load."""

from __future__ import annotations

import contextlib
import hashlib
import json

import pytest

from tests.trainer.test_fit import _comparable, _straight_and_killed_then_resumed, base_args
from vlmrl.alignment.drift_artifact import read_drift
from vlmrl.config import ConfigError, load_config
from vlmrl.rollout.base import RolloutBackend
from vlmrl.trainer.async_rollout import CONSUMED_FILE, RolloutWorkerError, read_buffer, responses_digest
from vlmrl.trainer.fit import fit
from vlmrl.trainer.metrics import read_metrics

ASYNC = "trainer.async_rollout.enable=true"
CORRECTED = ("algorithm.rollout_correction=token_tis", "rollout.temperature=1.0")


def _consumed(out) -> list[dict]:
    return [json.loads(line) for line in (out / CONSUMED_FILE).read_text().splitlines()]


def _weights(out, step: int) -> str:
    return hashlib.sha256((out / "checkpoints" / f"global_step_{step}" / "model.safetensors").read_bytes()).hexdigest()


def _without_async(row: dict) -> dict:
    return {k: v for k, v in _comparable(row).items() if not k.startswith("async/")}


def test_max_staleness_0_gives_the_synchronous_runs_metrics_and_weights_exactly(tiny_model_path, tmp_path):
    common = ["trainer.total_steps=4", "trainer.save_freq=4", *CORRECTED]
    fit(load_config(base_args(tiny_model_path, tmp_path / "sync", *common)))
    fit(load_config(base_args(tiny_model_path, tmp_path / "async", *common, ASYNC,
                              "trainer.async_rollout.max_staleness=0")))
    sync = read_metrics(tmp_path / "sync" / "metrics.jsonl")
    run = read_metrics(tmp_path / "async" / "metrics.jsonl")
    assert [_without_async(r) for r in run] == [_without_async(r) for r in sync]
    assert all(r["async/staleness"] == 0 for r in run[1:])
    assert _weights(tmp_path / "async", 4) == _weights(tmp_path / "sync", 4)
    assert [c["staleness"] for c in _consumed(tmp_path / "async")] == [0, 0, 0, 0]


def test_the_rollout_thread_runs_ahead_within_the_staleness_bound(tiny_model_path, tmp_path):
    """max_staleness=1: from step 2 on every batch was sampled while the update before it ran, with the weights one
    step older than the trainer's, never older; the drift samples say the same, and the update corrects for it."""
    out = tmp_path / "run"
    fit(load_config(base_args(tiny_model_path, out, "trainer.total_steps=6", "trainer.test_freq=3", *CORRECTED,
                              ASYNC, "trainer.async_rollout.max_staleness=1")))
    consumed = _consumed(out)
    assert [c["step"] for c in consumed] == [1, 2, 3, 4, 5, 6]
    assert all(0 <= c["staleness"] <= 1 for c in consumed)
    assert consumed[0]["staleness"] == 0 and sum(c["staleness"] for c in consumed) >= 3, consumed
    drift = read_drift(out)
    lag = {r.step: r.trainer_weight_version - r.engine_weight_version for r in drift}
    assert lag == {c["step"]: c["staleness"] for c in consumed} and not any(r.weights_stale for r in drift)
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if r["step"] > 0]
    assert all("rollout_correction/weight_mean" in r and r["async/staleness"] <= 1 for r in train)
    assert all(r["weight_probe/in_sync"] == 1.0 for r in train), "every sync landed, between the thread's batches"
    assert [r["step"] for r in rows if "val/accuracy" in r] == [0, 3, 6]
    # the run's staleness histogram so far, step by step: the consumed batches counted at each staleness
    for r in train:
        so_far = [c["staleness"] for c in consumed if c["step"] <= r["step"]]
        assert [r["async/staleness_hist/0"], r["async/staleness_hist/1"]] == [so_far.count(0), so_far.count(1)]


def test_a_sync_interrupts_the_batch_in_flight_at_its_next_segment(tiny_model_path, tmp_path):
    """interrupt_tokens=2 with responses of 16 tokens (a batch takes longer than an update): the sync after each
    update finds the next batch in flight and goes in at its next 2-token boundary; that batch's open samples go on
    with the new weights. Every probe is still in sync (it runs before the batch goes on), and no batch is older
    than the bound by its first segment's version."""
    out = tmp_path / "run"
    fit(load_config(base_args(tiny_model_path, out, "trainer.total_steps=5", "trainer.test_freq=-1",
                              "trainer.val_before_train=false", "data.max_response_length=16", *CORRECTED, ASYNC,
                              "trainer.async_rollout.max_staleness=1", "trainer.async_rollout.interrupt_tokens=2")))
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["weight_probe/in_sync"] == 1.0 and r["async/staleness"] <= 1 for r in rows)
    found = [r["async/sync_found_in_flight"] for r in rows]
    interrupts = [r["async/interrupts"] for r in rows]
    assert sum(found) >= 2 and interrupts[-1] >= 2 and interrupts == sorted(interrupts), (found, interrupts)
    assert sum(r["async/mixed_version_samples"] for r in rows) > 0, "an interrupted batch has samples of two versions"


def test_bypass_anchors_the_update_on_the_engines_logprobs_without_a_recomputing_pass(tiny_model_path, tmp_path):
    """algorithm.rollout_correction=bypass (verl's bypass mode): no old-logprob pass. Synchronous on the fp32 hf
    engine (its logprobs are the trainer's to ~1e-6) it trains as token_tis does, its PPO ratio 1 to 1e-5; in the
    asynchronous placement the same, every batch within the bound and every probe in sync."""
    common = ["trainer.total_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
              "rollout.temperature=1.0"]
    fit(load_config(base_args(tiny_model_path, tmp_path / "tis", *common, "algorithm.rollout_correction=token_tis")))
    fit(load_config(base_args(tiny_model_path, tmp_path / "bypass", *common, "algorithm.rollout_correction=bypass")))
    tis, bypass = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("tis", "bypass"))
    assert all("timing/old_logprobs" in r for r in tis) and not any("timing/old_logprobs" in r for r in bypass)
    assert not any(key.startswith("rollout_correction/") for r in bypass for key in r)
    for a, b in zip(tis, bypass):
        assert b["actor/pg_loss"] == pytest.approx(a["actor/pg_loss"], abs=1e-5)
        assert abs(b["actor/ratio_mean"] - 1) < 1e-5
        # the trainer/engine gap is still measured (by the update's own forward: the second mini-batch's after the
        # first optimizer step, so above token_tis's pre-update figure), not old - engine = 0 by construction
        assert a["rollout/logprob_abs_diff"] < 1e-5 and 0 < b["rollout/logprob_abs_diff"] < 1e-3
        assert b["mismatch/abs_dlogp_max"] > 0
    stale = tmp_path / "stale"
    fit(load_config(base_args(tiny_model_path, stale, "trainer.total_steps=4", *common[1:],
                              "algorithm.rollout_correction=bypass", ASYNC, "trainer.async_rollout.max_staleness=1")))
    rows = read_metrics(stale / "metrics.jsonl")
    assert sum(r["async/staleness"] for r in rows) >= 2 and all(r["async/staleness"] <= 1 for r in rows)
    assert all(r["weight_probe/in_sync"] == 1.0 and "timing/old_logprobs" not in r for r in rows)


def test_staged_syncs_sample_with_the_same_weights_without_the_trainer_waiting(tiny_model_path, tmp_path):
    """trainer.async_rollout.staged_sync: after each update the trainer stages a copy of its weights and goes on;
    the rollout thread loads it before its next batch. At max_staleness=0 every batch is still sampled with the
    weights of the step before it: the samples, metrics and weights of the run that waits for each sync. Only the
    steps that save (here the last) wait and probe, and their probe finds the engine in sync."""
    common = ["trainer.total_steps=4", "trainer.save_freq=4", "trainer.test_freq=-1", *CORRECTED, ASYNC,
              "trainer.async_rollout.max_staleness=0"]
    fit(load_config(base_args(tiny_model_path, tmp_path / "wait", *common)))
    fit(load_config(base_args(tiny_model_path, tmp_path / "staged", *common, "trainer.async_rollout.staged_sync=true")))
    wait, staged = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("wait", "staged"))

    def same(row: dict) -> dict:
        return {k: v for k, v in _without_async(row).items() if not k.startswith("weight_probe/")}

    assert [same(r) for r in staged] == [same(r) for r in wait]
    assert _weights(tmp_path / "staged", 4) == _weights(tmp_path / "wait", 4)
    assert [c["responses"] for c in _consumed(tmp_path / "staged")] == [c["responses"] for c in
                                                                        _consumed(tmp_path / "wait")]
    train = [r for r in staged if r["step"] > 0]
    assert [r.get("async/sync_staged", 0.0) for r in train] == [1.0, 1.0, 1.0, 0.0]
    assert [("weight_probe/in_sync" in r) for r in train] == [False, False, False, True]
    assert train[-1]["weight_probe/in_sync"] == 1.0
    # step 4's batch was made after the thread loaded steps 1-3's staged weights, none of them replaced
    assert train[-1]["async/staged_loads"] == 3 and train[-1]["async/staged_replaced"] == 0


def test_staged_weights_go_into_the_batch_in_flight_at_its_next_segment(tiny_model_path, tmp_path):
    """staged_sync with max_staleness=1 and interrupt_tokens=2 (a batch of 16-token responses takes longer than an
    update): the rollout thread loads the staged weights at the next segment boundary of the batch in flight, whose
    open samples go on with them; no batch is older than the bound, and the last step's probe is in sync."""
    out = tmp_path / "run"
    fit(load_config(base_args(tiny_model_path, out, "trainer.total_steps=5", "trainer.test_freq=-1",
                              "trainer.val_before_train=false", "data.max_response_length=16", *CORRECTED, ASYNC,
                              "trainer.async_rollout.max_staleness=1", "trainer.async_rollout.interrupt_tokens=2",
                              "trainer.async_rollout.staged_sync=true")))
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["async/staleness"] <= 1 for r in rows) and sum(r["async/staleness"] for r in rows) >= 2
    assert rows[-1]["weight_probe/in_sync"] == 1.0
    assert rows[-1]["async/staged_loads"] >= 2, rows[-1]  # step 4's may still be staged at step 5's take
    assert rows[-1]["async/interrupts"] >= 1 and sum(r["async/mixed_version_samples"] for r in rows) > 0


@pytest.mark.slow
def test_kill_9_during_an_async_run_and_resume_trains_on_every_prompt_once(tiny_model_path, tmp_path):
    """Killed after the step-2 checkpoint while the rollout thread had drawn further: the resumed run trains first on
    the batches the checkpoint kept (their samples and versions as made), then draws on after them, so steps 1-5
    train on the uninterrupted run's prompts, each batch once."""
    common = ["trainer.total_steps=5", "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
              "trainer.max_ckpt_to_keep=3", *CORRECTED, ASYNC, "trainer.async_rollout.max_staleness=1"]
    expected, got = _straight_and_killed_then_resumed(tiny_model_path, tmp_path, *common)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [1, 2, 3, 4, 5]
    straight, resumed = _consumed(tmp_path / "straight"), _consumed(tmp_path / "killed")
    assert [c["step"] for c in resumed] == [1, 2, 3, 4, 5]
    assert [c["rows"] for c in resumed] == [c["rows"] for c in straight]
    rows = [row for c in resumed for row in c["rows"]]
    assert len(rows) == len(set(rows)) == 5 * 4, "20 distinct prompts: none lost, none twice"
    hist = [(r["async/staleness_hist/0"], r["async/staleness_hist/1"]) for r in got]
    assert hist == [(r["async/staleness_hist/0"], r["async/staleness_hist/1"]) for r in expected], \
        "the resumed run's histogram counts the steps before its checkpoint"
    # The batches the step-2 checkpoint kept are trained on as they were sampled: same version, same tokens.
    kept = read_buffer(tmp_path / "killed" / "checkpoints" / "global_step_2")
    assert kept and [b["step"] for b in kept] == list(range(3, 3 + len(kept))), "the rollout thread was ahead"
    by_step = {c["step"]: c for c in resumed}
    for batch in kept:
        assert by_step[batch["step"]]["engine_version"] == batch["version"]
        assert by_step[batch["step"]]["responses"] == responses_digest(batch["results"])


def test_a_failing_rollout_thread_stops_the_run_with_its_error(tiny_model_path, tmp_path, monkeypatch):
    """The engine call of step 3's batch raises on the rollout thread: the trainer stops at its next take with the
    error named (never a hang), and the run's engine and thread are closed."""
    real = RolloutBackend.generate
    calls = []

    def generate(self, requests, sampling):
        if sampling.n > 1:  # the training batches (not the weights probe or validation)
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("the engine fell over")
        return real(self, requests, sampling)

    monkeypatch.setattr(RolloutBackend, "generate", generate)
    with pytest.raises(RolloutWorkerError, match="failed making step 3's batch: RuntimeError: the engine fell over"):
        fit(load_config(base_args(tiny_model_path, tmp_path / "run", "trainer.total_steps=5", "trainer.test_freq=-1",
                                  *CORRECTED, ASYNC, "trainer.async_rollout.max_staleness=1")))
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps[-1] == 2, steps


def test_a_staged_load_that_fails_stops_the_run_with_its_error(tiny_model_path, tmp_path, monkeypatch):
    """staged_sync: the rollout thread's load of step 1's staged weights raises; the trainer stops at the batch that
    needed them (step 3's, at max_staleness 1) with the error named, never a hang."""
    import threading

    real = RolloutBackend.update_weights

    def update_weights(self, named_tensors, names=None):
        if threading.current_thread().name == "vlmrl-rollout":
            raise RuntimeError("the load fell over")
        return real(self, named_tensors, names)

    monkeypatch.setattr(RolloutBackend, "update_weights", update_weights)
    with pytest.raises(RolloutWorkerError, match="failed making step 3's batch: RuntimeError: the load fell over"):
        fit(load_config(base_args(tiny_model_path, tmp_path / "run", "trainer.total_steps=5", "trainer.test_freq=-1",
                                  *CORRECTED, ASYNC, "trainer.async_rollout.max_staleness=1",
                                  "trainer.async_rollout.staged_sync=true")))
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")][-1] == 2


@pytest.mark.parametrize(("settings", "says"), [
    (["trainer.n_gpus_per_node=2"], "at dp > 1 needs rollout workers of their own"),
    (["agent.enable=true"], "takes the plain rollout"),
    (["algorithm.dynamic_sampling=true"], "dynamic_sampling's extra draws"),
    (["algorithm.rollout_correction=off"], "need the rollout importance-sampling correction"),
    (["rollout.vllm.enable_sleep_mode=true"], "never frees its memory"),
    (["trainer.async_rollout.max_staleness=-1"], "max_staleness=-1 must be >= 0"),
    (["trainer.async_rollout.buffer_steps=0"], "buffer_steps=0 must be >= 1"),
    (["trainer.async_rollout.interrupt_tokens=-1"], "interrupt_tokens=-1 must be >= 0"),
    (["trainer.async_rollout.staged_sync=true", "actor.lora.rank=4"], "staged_sync stages full weights")])
def test_what_the_async_placement_cannot_run_with_is_refused_at_load(settings, says):
    with pytest.raises(ConfigError, match=says):
        load_config(["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic", ASYNC,
                     "algorithm.rollout_correction=token_tis", *settings])


# The demo learns in the asynchronous placement: in make test on vLLM with its engine in a rollout worker of its own
# (a Ray actor: the placement as a cluster runs it) and staged syncs (the trainer waits for a sync only on the steps
# that validate: measured 60 s against 69 s alone waiting for each, the same curve); on SGLang with the engine on the
# rollout thread, the trainer waiting for each sync, as a variant (marker `full`, make test-all: 150-270 s on 2
# cores). make test keeps the waiting path in runs equal to the synchronous one (tests/trainer/test_async_workers.py,
# tests/cluster) and SGLang's rollout thread with staged syncs in the short run below.
@pytest.mark.slow
@pytest.mark.parametrize(("backend", "workers", "staged"), [
    pytest.param("vllm", 1, True, marks=[pytest.mark.vllm, pytest.mark.ray]),
    pytest.param("sglang", 0, False, marks=[pytest.mark.sglang, pytest.mark.full])])
def test_the_demo_learns_in_the_async_placement(tmp_path, backend, workers, staged):
    """The demo's recipe with the rollout one step ahead (max_staleness=1, token_tis correction): validation
    accuracy rises >= 0.3 above its step-0 value within the demo's 150 steps, every batch within the bound."""
    from tests.ray_helpers import local_ray
    from tests.trainer.test_fit import ROOT, RisenBy

    out = tmp_path / "demo"
    config = load_config([f"config={ROOT / 'examples' / 'configs' / 'tiny_synthetic.yaml'}", f"rollout.name={backend}",
                          ASYNC, "trainer.async_rollout.max_staleness=1", "algorithm.rollout_correction=token_tis",
                          f"trainer.async_rollout.rollout_workers={workers}",
                          f"trainer.async_rollout.staged_sync={str(staged).lower()}", f"trainer.output_dir={out}"])
    with local_ray(num_cpus=2) if workers else contextlib.nullcontext():
        fit(config, stop=RisenBy(0.3))
    curve = [(row["step"], row["val/accuracy"]) for row in read_metrics(out / "metrics.jsonl") if "val/accuracy" in row]
    assert max(acc for _, acc in curve) >= curve[0][1] + 0.3, f"validation accuracy did not rise by 0.3: {curve}"
    consumed = _consumed(out)
    assert all(c["staleness"] <= 1 for c in consumed) and sum(c["staleness"] for c in consumed) > len(consumed) // 2
    if staged:  # every step but those that validate (and the last) staged its sync
        rows = read_metrics(out / "metrics.jsonl")
        assert sum(r.get("async/sync_staged", 0.0) for r in rows) >= len(consumed) * 0.8, len(consumed)


@pytest.mark.sglang
def test_sglang_on_the_rollout_thread_with_staged_syncs_stays_in_step(tmp_path):
    """The asynchronous placement on SGLang (the engine on the rollout thread, staged syncs, one step of staleness):
    every batch within the bound and most a step behind, the syncs between validations staged (the trainer never
    waited for the engine), and the saving step's weight probe finds the engine in sync with the trainer."""
    from tests.trainer.test_fit import ROOT

    out = tmp_path / "sglang"
    fit(load_config([f"config={ROOT / 'examples' / 'configs' / 'tiny_synthetic.yaml'}", "rollout.name=sglang", ASYNC,
                     "trainer.async_rollout.max_staleness=1", "algorithm.rollout_correction=token_tis",
                     "trainer.async_rollout.staged_sync=true", "trainer.total_steps=6", "trainer.save_freq=6",
                     "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.format_warmup_steps=0",
                     f"trainer.output_dir={out}"]))
    consumed = _consumed(out)
    assert len(consumed) == 6 and all(c["staleness"] <= 1 for c in consumed)
    assert sum(c["staleness"] for c in consumed) >= 3
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]
    assert sum(r.get("async/sync_staged", 0.0) for r in rows) >= 4
    assert rows[-1]["weight_probe/in_sync"] == 1.0
