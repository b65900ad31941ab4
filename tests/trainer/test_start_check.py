"""The start-up check: before step 1 the engine answers the weight probe's request (a training row with its image)
and the trainer scores the engine's tokens; an engine that computes another model than the trainer (it read the
config otherwise, skipped weights it did not expect, loaded other ones) stops the run there with one named error,
whatever trainer.weight_probe_action says, instead of training on another model's samples."""

from __future__ import annotations

import pytest

from tests.trainer.test_fit import base_args
from vlmrl.config import load_config
from vlmrl.train import reported_error
from vlmrl.trainer.engine_probe import EngineModelError
from vlmrl.trainer.fit import setup_process, setup_run, start_of_training


@pytest.mark.vllm
def test_an_engine_computing_another_model_is_stopped_before_step_1(tiny_model_path, tmp_path):
    """vLLM holding the model with one MLP's down projection negated (as an engine that dropped a layer's weights
    would compute) against the trainer's own: refused at step 0, naming the engine, the probe's image and the gap;
    `python -m vlmrl.train` shows it as one error line (exit 1). The same run with the engine in step passes."""
    config = load_config(base_args(tiny_model_path, tmp_path / "run", "rollout.name=vllm", "rollout.dtype=float32",
                                   "trainer.val_before_train=false", "trainer.weight_probe_action=warn"))
    setup_process(config)
    run = setup_run(config)
    try:
        start_of_training(run)  # in step: no error, the probe's record in sync
        assert run.probe.last.verdict == "in_sync" and run.probe.request.images
        state = {name: t.detach().clone() for name, t in run.actor.named_tensors()}
        other = {name: (-t if "layers.1.mlp.down_proj" in name else t) for name, t in state.items()}
        run.parts.backend.update_weights(other.items())
        run.probe.state = type(run.probe.state)()  # a fresh run's probe: nothing judged before
        with pytest.raises(EngineModelError, match=r"the vllm engine computes another model than the trainer: on the "
                                                   r"probe request \(1 image, \d+ prompt tokens\).* beyond the 0.001"):
            start_of_training(run)
    finally:
        run.close()


def test_the_start_check_is_one_error_line_with_exit_status_1():
    error = EngineModelError("the sglang engine computes another model than the trainer: ...")
    assert reported_error(RuntimeError("rollout failed").with_traceback(None)) is None
    try:
        raise RuntimeError("step 0 failed") from error
    except RuntimeError as wrapped:
        assert reported_error(wrapped) == (str(error), 1)


def test_a_resumed_run_checks_its_restarted_engine_without_touching_the_probes_record(tiny_model_path, tmp_path,
                                                                                       caplog):
    """A run resumed from its checkpoint starts its engine again: fit checks it as before step 1. In step, nothing
    is recorded (the next probe is judged against the checkpoint's reference, as the uninterrupted run's is); an
    engine that computes another model is the start-up check's error (hf backend: the check is the engine's
    answer against the trainer's logprobs, whatever the engine)."""
    args = base_args(tiny_model_path, tmp_path / "run", "trainer.total_steps=2", "trainer.save_freq=1",
                     "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.weight_probe_action=warn")
    from vlmrl.trainer.fit import fit

    fit(load_config([*args, "trainer.total_steps=1"]))
    config = load_config(args)
    setup_process(config)
    run = setup_run(config)
    try:
        assert run.step == 1
        probes = sorted((tmp_path / "run" / "drift").glob("probe_*.json"))
        reference = run.probe.state_dict()
        run.probe.check_resumed(run.actor, run.parts.backend, run.step, run.engine_version)
        assert run.probe.state_dict() == reference and run.probe.last is None, "the check recorded a probe"
        assert sorted((tmp_path / "run" / "drift").glob("probe_*.json")) == probes
        state = {name: t.detach().clone() for name, t in run.actor.named_tensors()}
        other = {name: (-t if "layers.1.mlp.down_proj" in name else t) for name, t in state.items()}
        run.parts.backend.update_weights(other.items())
        with pytest.raises(EngineModelError, match=r"the hf engine computes another model than the trainer"):
            run.probe.check_resumed(run.actor, run.parts.backend, run.step, run.engine_version)
    finally:
        run.close()
    with caplog.at_level("INFO", logger="vlmrl.trainer.engine_probe"):
        fit(config)  # the resume as a user runs it: fit checks the engine before step 2
    assert "resumed at step 1: the hf engine computes the trainer's model" in caplog.text
