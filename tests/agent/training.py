"""An agent training run on the taught model with partial rollout carrying groups, shared by the resume tests
(dp=1 in tests/trainer/test_agent_resume.py, dp=2 in tests/distributed/test_agent_resume.py).

The tiny model taught the scripted conversations of tests/agent/scripted.py generates; the tools run on the event loop
(tests.agent.helpers), so the turns are batched alike in every run."""

from __future__ import annotations

import io

import torch

from tests.agent import scripted

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


WITH_GRADIENT = ("rollout.temperature=1.0", "actor.entropy_coeff=0.01")
"""Overrides that give both resume tests' steps a gradient. At the config's temperature 0.05 a group's two samples are
the same conversation, every advantage is 0 and the update only decays the weights (optimizer moments stay 0, so a
resume that lost them would pass). At 1.0 with an entropy bonus, step 1 has a gradient and step 2 has groups whose
samples got different rewards; everything is seeded, so the comparisons stay exact."""


_TAUGHT: dict[str, str] = {}


def teach_model(tiny_model_path: str, tmp_path_factory) -> str:
    """The tiny model taught the scripted conversations, in a temp folder that lasts the session: taught once per
    session (teaching is seeded, so every caller would get the same weights); callers only read it."""
    from vlmrl.processors.loading import load_processor

    if tiny_model_path not in _TAUGHT:
        torch.set_num_threads(1)
        folder = scripted.teach(tiny_model_path, tmp_path_factory.mktemp("taught"), load_processor(tiny_model_path))
        _TAUGHT[tiny_model_path] = str(folder)
    return _TAUGHT[tiny_model_path]


def write_run_files(tmp_path, agent_yaml: str = AGENT):
    """(data parquet, reward file, agent YAML) in tmp_path, written once: a LONG and a SHORT question, each with the
    scripted image, the scripted reward, and the agent section."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data, reward, agent_file = tmp_path / "agent.parquet", tmp_path / "reward.py", tmp_path / "agent.yaml"
    if not data.exists():
        rows = []
        for question in (scripted.LONG_QUESTION, scripted.SHORT_QUESTION):
            row, buffer = scripted.row(question), io.BytesIO()
            row["images"][0].save(buffer, format="PNG")
            rows.append(dict(row, images=[{"bytes": buffer.getvalue()}]))
        pq.write_table(pa.Table.from_pylist(rows), data)
        reward.write_text(scripted.REWARD_FILE)
        agent_file.write_text(agent_yaml)
    return data, reward, agent_file


def make_config(taught_model, tmp_path, out, *overrides: str):
    """The run's config (2 prompts per step, n=2, hf rollout), writing its data, reward and agent files into tmp_path
    once; `overrides` are more key=value arguments (e.g. trainer.n_gpus_per_node=2)."""
    from vlmrl.config import load_config

    data, reward, agent_yaml = write_run_files(tmp_path)
    return load_config([
        f"config={agent_yaml}", f"actor.model_path={taught_model}", f"data.train_files={data}",
        "data.train_batch_size=2", "data.max_prompt_length=96", "data.max_response_length=256",
        "data.max_pixels=12544", "data.shuffle=false", "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_gpu=4", "actor.optim.lr=1e-5", "rollout.name=hf", "rollout.n=2",
        "rollout.temperature=0.05", f"reward.function={reward}:compute_score", "trainer.total_steps=3",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.torch_threads=1",
        f"trainer.output_dir={out}", *overrides])


def step(run) -> dict[str, float]:
    """One step as fit takes it (without logging): the metrics a user sees, timings and throughput left out."""
    from vlmrl.trainer.fit import PhaseTimer, train_step

    metrics = train_step(run, PhaseTimer())
    run.step += 1
    return {k: v for k, v in metrics.items() if not k.startswith(("timing/", "throughput/"))}


def shape(groups) -> list:
    """Carried groups without their uids (fresh requests get random ones in each run)."""
    return [(g.request.index, [(t.response_ids, t.logprobs, t.token_versions, t.done) for t in g.trajectories])
            for g in groups]
