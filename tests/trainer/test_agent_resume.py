"""A run resumed from a checkpoint keeps its partial-rollout state: the groups carried into the next step come back
equal, the prompt queue and data position go on where they were, and the resumed step gives what the uninterrupted
run gives. A checkpoint written before this state was saved still loads, with a log line saying what is missing.

The run (tests/agent/training.py): the tiny model taught the scripted conversations generates through the hf backend
in this process; tests/distributed/test_agent_resume.py checks the same with two Ray workers (dp=2)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from tests.agent.helpers import assert_same_groups
from tests.agent.training import WITH_GRADIENT, make_config, shape, step, teach_model
from vlmrl.agent.carry import CARRIED_JSON, CARRIED_TENSORS
from vlmrl.trainer.checkpoint import checkpoints_root, rng_state, set_rng_state
from vlmrl.trainer.fit import save, setup_process, setup_run


@pytest.fixture(scope="module")
def taught_model(tiny_model_path, tmp_path_factory) -> str:
    return teach_model(tiny_model_path, tmp_path_factory)


def test_resumed_run_continues_the_carried_groups_like_the_uninterrupted_run(taught_model, tmp_path, caplog):
    config = make_config(taught_model, tmp_path, tmp_path / "run", *WITH_GRADIENT)
    setup_process(config)
    run = setup_run(config)
    resumed = None
    try:
        assert step(run)["actor/grad_norm"] > 0
        carried = run.parts.agent.carried
        assert carried and not any(t.done for g in carried for t in g.trajectories), \
            "step 1 should park the LONG groups unfinished"
        assert any(t.open_turn for g in carried for t in g.trajectories), "no group parked mid-turn"
        assert run.prompts.pending == [1]
        checkpoint = save(run)
        rng = rng_state()

        # A fresh run from a copy of the checkpoint, next to the original (which simply goes on).
        shutil.copytree(checkpoints_root(tmp_path / "run"), checkpoints_root(tmp_path / "resumed"))
        resumed = setup_run(make_config(taught_model, tmp_path, tmp_path / "resumed", *WITH_GRADIENT))
        assert resumed.step == 1
        assert_same_groups(resumed.parts.agent.carried, carried)
        assert resumed.prompts.pending == run.prompts.pending
        assert resumed.sampler.state_dict() == run.sampler.state_dict()

        set_rng_state(rng)  # each process would start step 2 from the RNG state it saved
        expected = step(run)
        set_rng_state(rng)
        got = step(resumed)
        assert expected["partial/resumed_groups"] == len(carried) and expected["partial/stale_tokens"] > 0
        assert got == expected
        assert shape(resumed.parts.agent.carried) == shape(run.parts.agent.carried)
        assert resumed.prompts.pending == run.prompts.pending
        after = resumed.actor.model.state_dict()
        for name, tensor in run.actor.model.state_dict().items():  # same update: optimizer state came back too
            assert torch.equal(after[name], tensor), name
    finally:
        run.close()
        if resumed is not None:
            resumed.close()

    # A checkpoint from before carried groups were saved: it loads, says what it lacks, and the run goes on.
    old_dir = tmp_path / "old"
    shutil.copytree(checkpoints_root(tmp_path / "run"), checkpoints_root(old_dir))
    old = checkpoints_root(old_dir) / checkpoint.name
    (old / CARRIED_JSON).unlink()
    (old / CARRIED_TENSORS).unlink()
    info = json.loads((old / "trainer_state.json").read_text())
    del info["prompt_queue"], info["agent_carried_groups"]
    (old / "trainer_state.json").write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING):
        run = setup_run(make_config(taught_model, tmp_path, old_dir, *WITH_GRADIENT))
    try:
        assert "holds no carried partial-rollout groups" in caplog.text
        assert "has no prompt-queue position" in caplog.text
        assert run.step == 1 and run.parts.agent.carried == [] and run.prompts.pending == []
        assert step(run)["partial/new_groups"] == 5
    finally:
        run.close()
