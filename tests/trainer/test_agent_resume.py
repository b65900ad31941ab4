"""A run resumed from a checkpoint keeps its partial-rollout state: the groups carried into the next step come back
equal, the prompt queue and data position go on where they were, and the resumed step gives what the uninterrupted
run gives. A checkpoint written before this state was saved still loads, with a log line saying what is missing.

The tiny model taught the scripted conversations of tests/agent/scripted.py generates through the hf backend; the
tools run on the event loop (tests.agent.helpers), so the turns are batched alike in every run."""

from __future__ import annotations

import io
import json
import logging
import shutil

import pytest
import torch

from tests.agent import scripted
from tests.agent.helpers import assert_same_groups
from vlmrl.agent.carry import CARRIED_JSON, CARRIED_TENSORS
from vlmrl.config import load_config
from vlmrl.trainer.checkpoint import checkpoints_root, rng_state, set_rng_state
from vlmrl.trainer.fit import save, setup_process, setup_run, train_step

# 5 groups in flight for a batch of 2: the two SHORT groups fill step 1's batch after one call, and the three LONG
# groups park mid-turn (8-token chunks). The sampler hands out batches of 2, so one prompt waits in the queue.
AGENT = """
agent:
  enable: true
  tools:
    - path: tests.agent.helpers:CountingEcho
    - path: tests.agent.helpers:AsyncZoom
  max_turns: 4
  max_response_tokens: 256
  partial:
    enable: true
    oversample_factor: 2.5
    unfinished: carry
    chunk_tokens: 8
"""


@pytest.fixture(scope="module")
def taught_model(tiny_model_path, tmp_path_factory) -> str:
    from vlmrl.processors import load_processor

    torch.set_num_threads(1)
    return str(scripted.teach(tiny_model_path, tmp_path_factory.mktemp("taught"), load_processor(tiny_model_path)))


def make_config(taught_model, tmp_path, out):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data, reward, agent_yaml = tmp_path / "agent.parquet", tmp_path / "reward.py", tmp_path / "agent.yaml"
    if not data.exists():
        rows = []
        for question in (scripted.LONG_QUESTION, scripted.SHORT_QUESTION):
            row, buffer = scripted.row(question), io.BytesIO()
            row["images"][0].save(buffer, format="PNG")
            rows.append(dict(row, images=[{"bytes": buffer.getvalue()}]))
        pq.write_table(pa.Table.from_pylist(rows), data)
        reward.write_text(scripted.REWARD_FILE)
        agent_yaml.write_text(AGENT)
    return load_config([
        f"config={agent_yaml}", f"actor.model_path={taught_model}", f"data.train_files={data}",
        "data.train_batch_size=2", "data.max_prompt_length=96", "data.max_response_length=256",
        "data.max_pixels=12544", "data.shuffle=false", "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_gpu=4", "actor.optim.lr=1e-5", "rollout.name=hf", "rollout.n=2",
        "rollout.temperature=0.05", f"reward.function={reward}:compute_score", "trainer.total_steps=3",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.torch_threads=1",
        f"trainer.output_dir={out}"])


def step(run) -> dict[str, float]:
    """One step as fit takes it (without logging): the metrics a user sees, timings and throughput left out."""
    metrics = train_step(run)
    run.step += 1
    return {k: v for k, v in metrics.items() if not k.startswith(("timing/", "throughput/"))}


def shape(groups) -> list:
    """Carried groups without their uids (fresh requests get random ones in each run)."""
    return [(g.request.index, [(t.response_ids, t.logprobs, t.token_versions, t.done) for t in g.trajectories])
            for g in groups]


def test_resumed_run_continues_the_carried_groups_like_the_uninterrupted_run(taught_model, tmp_path, caplog):
    config = make_config(taught_model, tmp_path, tmp_path / "run")
    setup_process(config)
    run = setup_run(config)
    resumed = None
    try:
        step(run)
        carried = run.agent.carried
        assert carried and all(not t.done and t.open_turn for g in carried for t in g.trajectories), \
            "step 1 should park the LONG groups mid-turn"
        assert run.prompts.pending == [1]
        checkpoint = save(run)
        rng = rng_state()

        # A fresh run from a copy of the checkpoint, next to the original (which simply goes on).
        shutil.copytree(checkpoints_root(tmp_path / "run"), checkpoints_root(tmp_path / "resumed"))
        resumed = setup_run(make_config(taught_model, tmp_path, tmp_path / "resumed"))
        assert resumed.step == 1
        assert_same_groups(resumed.agent.carried, carried)
        assert resumed.prompts.pending == run.prompts.pending
        assert resumed.sampler.state_dict() == run.sampler.state_dict()

        set_rng_state(rng)  # each process would start step 2 from the RNG state it saved
        expected = step(run)
        set_rng_state(rng)
        got = step(resumed)
        assert expected["partial/resumed_groups"] == len(carried) and expected["partial/stale_tokens"] > 0
        assert got == expected
        assert shape(resumed.agent.carried) == shape(run.agent.carried)
        assert resumed.prompts.pending == run.prompts.pending
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
        run = setup_run(make_config(taught_model, tmp_path, old_dir))
    try:
        assert "holds no carried partial-rollout groups" in caplog.text
        assert "has no prompt-queue position" in caplog.text
        assert run.step == 1 and run.agent.carried == [] and run.prompts.pending == []
        assert step(run)["partial/new_groups"] == 5
    finally:
        run.close()
