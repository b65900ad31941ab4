"""The start-up check: before step 1 the engine answers the weight probe's request (a training row with its image)
and the trainer scores the engine's tokens; an engine that computes another model than the trainer (it read the
config otherwise, skipped weights it did not expect, loaded other ones) stops the run there with one named error,
whatever trainer.weight_probe_action says, instead of training on another model's samples."""

from __future__ import annotations

import pytest
import torch

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
