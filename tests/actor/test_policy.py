"""The two actors share one construction path and one protocol: the single-process `Actor` and a one-rank
`ShardedActor` built from the same config train the same parameters in the same dtypes, freeze the same vision
tower, copy the same reference and step the same schedule; both actors the loop drives have the protocol's methods
with its exact parameters."""

from __future__ import annotations

import inspect

import pytest
import torch

from vlmrl.actor.base import PolicyActor
from vlmrl.actor.local import Actor
from vlmrl.actor.policy import lr_lambda
from vlmrl.config import ActorConfig, OptimConfig
from vlmrl.distributed.actor import ShardedActor
from vlmrl.distributed.group import DistributedActor
from vlmrl.distributed.vision import WRAPPED_PREFIX


def _config(tiny_model_path: str, dtype: str) -> ActorConfig:
    optim = OptimConfig(lr=1e-3, betas=[0.8, 0.99], weight_decay=0.05, lr_warmup_steps=2, lr_scheduler="cosine")
    return ActorConfig(model_path=tiny_model_path, optim=optim, freeze_vision_tower=True, use_kl_loss=True,
                       device="cpu", dtype=dtype, compute_dtype="bfloat16")


def _trainable(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.dtype]:
    return {name.removeprefix(prefix): p.dtype for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_single_process_and_one_rank_sharded_actor_are_built_alike(tiny_model_path, dtype):
    config = _config(tiny_model_path, dtype)
    single = Actor(config, total_steps=10, mini_batch_samples=4)
    sharded = ShardedActor(config, world_size=1, total_steps=10)

    assert (single.dtype, single.compute_dtype) == (sharded.dtype, sharded.compute_dtype)
    assert single.dtype == getattr(torch, dtype) and single.compute_dtype == torch.bfloat16
    trainable = _trainable(single.model)
    assert trainable == _trainable(sharded.model, WRAPPED_PREFIX)
    assert set(trainable.values()) == {single.dtype}
    # the frozen vision tower: none of its weights trains, on either side, and nothing else is frozen
    all_names = {name for name, _ in single.model.named_parameters()}
    frozen = all_names - set(trainable)
    assert frozen and all(name.startswith("model.visual.") for name in frozen)
    assert {n for n in all_names if n.startswith("model.visual.")} == frozen
    assert [p.numel() for p in single.trainable] == [p.numel() for p in sharded.trainable]
    assert not single.model.config.use_cache and not sharded.model.config.use_cache

    for reference in (single.reference, sharded.reference):
        assert reference is not None and not reference.training
        assert not any(p.requires_grad for p in reference.parameters())

    for ours, theirs in zip(single.optimizer.param_groups, sharded.optimizer.param_groups, strict=True):
        for key in ("lr", "betas", "weight_decay"):
            assert ours[key] == theirs[key], key
    assert single.optimizer.param_groups[0]["betas"] == (0.8, 0.99)
    schedule = [lr_lambda(config.optim, 10)(step) for step in range(12)]
    assert schedule[:3] == [0.5, 1.0, 1.0] and schedule[-1] == 0.0
    for actor in (single, sharded):
        assert [actor.scheduler.lr_lambdas[0](step) for step in range(12)] == schedule


def test_both_actors_the_loop_drives_implement_the_protocol(tiny_model_path):
    config = ActorConfig(model_path=tiny_model_path, device="cpu", dtype="float32")
    assert isinstance(Actor(config, total_steps=1, mini_batch_samples=4), PolicyActor)
    members = [name for name, value in vars(PolicyActor).items() if inspect.isfunction(value)
               and not name.startswith("_")]
    assert {"update", "needs_old_logprobs", "sync_weights", "full_model", "compute_logprobs"} <= set(members)
    for cls in (Actor, DistributedActor):
        assert hasattr(cls, "dp_size"), cls.__name__
        for name in members:
            expected = list(inspect.signature(getattr(PolicyActor, name)).parameters.values())
            got = list(inspect.signature(getattr(cls, name)).parameters.values())
            assert [(p.name, p.kind, p.default, p.annotation) for p in got] == \
                [(p.name, p.kind, p.default, p.annotation) for p in expected], f"{cls.__name__}.{name}"
