"""With two Ray workers (trainer.n_gpus_per_node=2: FSDP2-sharded actors on gloo, hf engines colocated in the workers),
a run resumed from a checkpoint keeps its partial-rollout state, and its next step is the uninterrupted run's, bit for
bit: metrics (timings and throughput aside), carried groups, prompt queue, sampler and the updated weights.

The run is tests/agent/training.py's (dp=1: tests/trainer/test_agent_resume.py). The agent loop and the carried groups
stay on the driver; what dp=2 adds is what the workers hold, all rebuilt in fresh processes on resume: the actor shards
from the checkpoint's full weights (init_path), the optimizer moments from the gathered state rank 0 broadcasts, the
reference from actor.model_path, and the engines from the checkpoint folder instead of a weight sync; each turn's
requests are split over the two engines.

Two settings differ from the dp=1 run so that the comparison sees the workers' state: at temperature 0.05 the taught
model's two samples of a group are the same conversation, every group's rewards are equal, and the actor's gradient is
exactly 0 in both steps (the update then only decays the weights; optimizer moments stay 0, so a resume that lost them
would still pass). At temperature 1.0 with an entropy bonus, step 1 has a gradient (the bonus: the optimizer moments
that step 2 uses are not 0) and step 2 has groups whose samples got different rewards (a policy-gradient loss on the
weights loaded from the checkpoint). Everything is seeded, and nothing differs between the two runs' arithmetic (same
weights, same splits over the ranks, gloo's reductions in a fixed order), so equality is exact.

The cluster has 2 CPUs, one per worker: the uninterrupted run goes on to step 2 and is closed before the resumed one
starts, so only two workers live at any time.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from tests.agent.helpers import assert_same_groups
from tests.agent.training import WITH_GRADIENT, make_config, shape, step, teach_model
from vlmrl.trainer.checkpoint import checkpoints_root, rng_state, set_rng_state
from vlmrl.trainer.fit import save, setup_process, setup_run

pytestmark = pytest.mark.ray
DP2 = ("trainer.n_gpus_per_node=2", *WITH_GRADIENT)


@pytest.fixture(scope="module")
def taught_model(tiny_model_path, tmp_path_factory) -> str:
    return teach_model(tiny_model_path, tmp_path_factory)


def weights(run) -> dict[str, torch.Tensor]:
    """The actor's full weights, gathered from the workers' shards."""
    return dict(run.actor.named_tensors())


# A variant (marker `full`, make test-all): the resume matrix at dp=2. make test keeps the same run's resume at dp=1
# (tests/trainer/test_agent_resume.py: the carried groups, prompt queue and sampler), a dp=2 resume of the optimizer
# state gathered and broadcast back into the shards (tests/distributed/test_group.py, the batch that does not divide)
# and a dp=2 fit whose checkpoint is one full HF folder (tests/trainer/test_fit.py, the two-device run).
@pytest.mark.full
def test_dp2_resumed_run_continues_the_carried_groups_like_the_uninterrupted_run(ray_cluster, taught_model, tmp_path):
    config = make_config(taught_model, tmp_path, tmp_path / "run", *DP2)
    setup_process(config)
    run = setup_run(config)
    try:
        assert run.dp_size == 2
        first = step(run)
        carried = run.parts.agent.carried
        assert carried and not any(t.done for g in carried for t in g.trajectories), \
            "step 1 should park the LONG groups unfinished"
        assert any(t.open_turn for g in carried for t in g.trajectories), "no group parked mid-turn"
        assert run.prompts.pending == [1]
        assert first["actor/grad_norm"] > 0, "step 1 did not move the optimizer moments: their resume is untested"
        save(run)
        rng = rng_state()
        saved = copy.deepcopy(carried)  # step 2 continues these groups in place
        saved_pending, saved_sampler = list(run.prompts.pending), copy.deepcopy(run.sampler.state_dict())
        at_save = weights(run)

        set_rng_state(rng)  # each process would start step 2 from the RNG state it saved
        expected = step(run)
        expected_shape, expected_pending = shape(run.parts.agent.carried), list(run.prompts.pending)
        expected_sampler, expected_weights = run.sampler.state_dict(), weights(run)
    finally:
        run.close()  # its workers leave before the resumed run's start
    assert expected["partial/resumed_groups"] == len(saved) and expected["partial/stale_tokens"] > 0
    assert expected["batch/groups_with_signal"] > 0, "step 2 has no reward signal: its update is not compared"
    assert any(not torch.equal(expected_weights[k], at_save[k]) for k in at_save), "step 2 did not change the weights"

    # A fresh run (new workers) from a copy of the checkpoint.
    shutil.copytree(checkpoints_root(tmp_path / "run"), checkpoints_root(tmp_path / "resumed"))
    resumed = setup_run(make_config(taught_model, tmp_path, tmp_path / "resumed", *DP2))
    try:
        assert resumed.step == 1 and resumed.dp_size == 2
        assert_same_groups(resumed.parts.agent.carried, saved)
        assert resumed.prompts.pending == saved_pending
        assert resumed.sampler.state_dict() == saved_sampler
        loaded = weights(resumed)
        assert all(torch.equal(loaded[k], at_save[k]) for k in at_save), "the workers did not load the checkpoint"

        set_rng_state(rng)
        got = step(resumed)
        assert got == expected
        assert shape(resumed.parts.agent.carried) == expected_shape
        assert resumed.prompts.pending == expected_pending
        assert resumed.sampler.state_dict() == expected_sampler
        got_weights = weights(resumed)
    finally:
        resumed.close()
    assert got_weights.keys() == expected_weights.keys()
    different = [k for k in expected_weights if not torch.equal(got_weights[k], expected_weights[k])]
    assert not different, (f"after step 2, {len(different)} of {len(expected_weights)} resumed weight tensors differ "
                           f"from the uninterrupted run's, e.g. {different[:3]}")
