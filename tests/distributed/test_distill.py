"""On-policy distillation's teacher sharded over two Ray workers (FSDP2, gloo, CPU) as the reference is: its logprobs
of the student's rows and a loss-mode distillation step equal the single-process actor's. float64 on both sides, so
only the summation order differs (the tolerances of tests/distributed/test_group.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.batches import make_batch
from tests.distributed.test_group import WEIGHT_ATOL, actor_config, assert_same_weights, start_dp2
from vlmrl.actor.local import Actor
from vlmrl.algorithms.config import DistillConfig
from vlmrl.algorithms.grpo import group_advantages

pytestmark = pytest.mark.ray


def test_dp2_teacher_logprobs_and_distillation_step_match_dp1(ray_cluster, tiny_model_path, processor,
                                                             synthetic_rows):
    distill = DistillConfig(teacher="tiny-large", teacher_dtype="float64", mode="loss", estimator="k3", coef=0.5)
    config = actor_config(tiny_model_path, micro=2)
    batch = make_batch(processor, synthetic_rows[:2], n=2, response_length=4)
    single = Actor(config, total_steps=1, mini_batch_samples=4, distill=distill)
    single.model.double()  # float64 like the workers (the optimizer holds the same parameter objects)
    start = {name: tensor.clone() for name, tensor in single.named_tensors()}
    old, _ = single.compute_logprobs(batch)
    teacher, _ = single.compute_logprobs(batch, teacher=True)
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding)
    loss_batch = replace(batch, teacher_logprobs=teacher)
    expected = single.update(loss_batch, old, advantages)

    with start_dp2(config, 4, distill=distill) as sharded:
        sharded_teacher, _ = sharded.compute_logprobs(batch, teacher=True)
        got = sharded.update(loss_batch, old, advantages)
        weights = dict(sharded.named_tensors())
    torch.testing.assert_close(sharded_teacher, teacher, rtol=0, atol=1e-10)
    assert expected["distill/loss"] > 0  # k3 of two different models: the step had a distillation term to share
    assert abs(got["distill/loss"] - expected["distill/loss"]) <= 1e-9 * abs(expected["distill/loss"])
    assert_same_weights({n: t for n, t in single.named_tensors()}, weights, start, atol=WEIGHT_ATOL)
