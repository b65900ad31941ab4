"""On-policy distillation's teacher sharded over two Ray workers (FSDP2, gloo, CPU) as the reference is: its logprobs
of the student's rows (and its top-k tokens per position) and two loss-mode distillation steps (k3, then forward KL
over the teacher's top-k) equal the single-process actor's. float64 on both sides, so
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
    # then a forward_kl_topk step: the teacher's top-5 per position, scored by the sharded teacher as by the one
    old_topk, _ = single.compute_logprobs(batch)
    _, top_values, top_ids = single.teacher_top_logprobs(batch, 5)
    topk_batch = replace(batch, teacher_topk_ids=top_ids, teacher_topk_logprobs=top_values)
    expected_topk = single.update(topk_batch, old_topk, advantages)

    with start_dp2(config, 4, distill=distill) as sharded:
        sharded_teacher, _ = sharded.compute_logprobs(batch, teacher=True)
        got = sharded.update(loss_batch, old, advantages)
        sharded_lp, sharded_values, sharded_ids = sharded.teacher_top_logprobs(batch, 5)
        got_topk = sharded.update(topk_batch, old_topk, advantages)
        weights = dict(sharded.named_tensors())
    torch.testing.assert_close(sharded_teacher, teacher, rtol=0, atol=1e-10)
    torch.testing.assert_close(sharded_lp, teacher, rtol=0, atol=1e-10)
    assert torch.equal(sharded_ids, top_ids), "the sharded teacher's top-k tokens are the one teacher's"
    torch.testing.assert_close(sharded_values, top_values, rtol=0, atol=1e-10)
    assert expected["distill/loss"] > 0  # k3 of two different models: the step had a distillation term to share
    assert abs(got["distill/loss"] - expected["distill/loss"]) <= 1e-9 * abs(expected["distill/loss"])
    assert expected_topk["distill/loss"] > 0
    assert abs(got_topk["distill/loss"] - expected_topk["distill/loss"]) <= 1e-9 * abs(expected_topk["distill/loss"])
    assert_same_weights({n: t for n, t in single.named_tensors()}, weights, start, atol=WEIGHT_ATOL)
