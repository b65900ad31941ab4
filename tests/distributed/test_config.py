"""The cluster keys are the trainer section's (trainer.n_gpus_per_node x trainer.nnodes, as in verl), checked there."""

from __future__ import annotations

from vlmrl.config import Config, load_config
from vlmrl.trainer.config import TrainerConfig


def test_cluster_keys_are_the_trainers():
    assert TrainerConfig(n_gpus_per_node=4, nnodes=2).world_size == 8
    assert TrainerConfig().world_size == 1
    config = load_config(["actor.model_path=tiny", "data.train_files=synthetic", "trainer.n_gpus_per_node=2",
                          "trainer.nnodes=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
                          "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=2",
                          "actor.ppo_micro_batch_size_per_gpu=1"], check_model=False)
    assert config.derived.world_size == 4 == Config(trainer=config.trainer).derived.world_size


def test_cluster_problems_say_what_to_change():
    assert TrainerConfig(n_gpus_per_node=0).problems() == ["trainer.n_gpus_per_node and trainer.nnodes must be >= 1"]
    assert TrainerConfig(engine_placement="gpu").problems() == [
        "trainer.engine_placement='gpu' is not one of ['worker', 'node']"]
    assert TrainerConfig(nnodes=0, total_epochs=0).problems() == [
        "trainer.total_epochs=0 must be >= 1", "trainer.n_gpus_per_node and trainer.nnodes must be >= 1"]
