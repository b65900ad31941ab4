"""The cluster section: set as trainer.* keys (TrainerConfig inherits it), checked by itself."""

from __future__ import annotations

from vlmrl.distributed.config import ClusterConfig
from vlmrl.trainer.config import TrainerConfig


def test_cluster_keys_are_the_trainers():
    trainer = TrainerConfig(n_gpus_per_node=4, nnodes=2)
    assert isinstance(trainer, ClusterConfig) and trainer.world_size == 8
    assert ClusterConfig().world_size == 1


def test_cluster_problems_say_what_to_change():
    assert ClusterConfig(n_gpus_per_node=0).problems() == ["trainer.n_gpus_per_node and trainer.nnodes must be >= 1"]
    assert ClusterConfig(engine_placement="gpu").problems() == [
        "trainer.engine_placement='gpu' is not one of ['worker', 'node']"]
    assert TrainerConfig(nnodes=0, total_epochs=0).problems() == [
        "trainer.total_epochs=0 must be >= 1", "trainer.n_gpus_per_node and trainer.nnodes must be >= 1"]
