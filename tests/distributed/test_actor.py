"""ShardedActor on one rank is the single-process trainer's actor: same logprobs, same update, same metrics, same
weights. This guards the two update loops against drifting apart (the multi-rank equivalence is in test_group.py)."""

from __future__ import annotations

import pytest
import torch

from tests.batches import make_batch
from vlmrl.actor.local import Actor
from vlmrl.algorithms.grpo import group_advantages
from vlmrl.config import ActorConfig, OptimConfig
from vlmrl.distributed.actor import ShardedActor, UpdateShard


@pytest.mark.parametrize("mini_batch, given_old", [(4, True), (8, False)], ids=["two-steps", "one-step-no-old"])
def test_one_rank_update_equals_the_single_process_actor(tiny_model_path, processor, synthetic_rows, mini_batch,
                                                         given_old):
    torch.manual_seed(0)
    batch = make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(1,))
    config = ActorConfig(model_path=tiny_model_path, optim=OptimConfig(lr=1e-3, weight_decay=0.01),
                         ppo_micro_batch_size_per_gpu=3, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01,
                         device="cpu", dtype="float32")
    single = Actor(config, total_steps=1, mini_batch_samples=mini_batch)
    single.model.double()
    single.reference.double()
    config.dtype = "float64"
    sharded = ShardedActor(config, world_size=1)

    old, _ = single.compute_logprobs(batch)
    ours, _ = sharded.compute_logprobs(batch)
    assert torch.equal(old, ours)
    old = ((old + 0.05 * torch.randn(old.shape)) * batch.response_mask).double() if given_old else None
    ref, _ = single.compute_logprobs(batch, reference=True)
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).double()

    expected = single.update(batch, old, advantages, ref.double())
    tokens = [float(batch.response_mask[i: i + mini_batch].sum()) for i in range(0, len(batch), mini_batch)]
    got = sharded.update_shard(UpdateShard(batch, old, advantages, ref.double(), tokens, tokens, mini_batch))
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), (key, value, got[key])
    # the second optimizer step sees a policy moved off the reference and ratios off 1
    assert (expected["actor/kl_loss"] > 0) == (mini_batch < len(batch))
    assert (expected["actor/pg_clipfrac"] > 0) == given_old
    weights = dict(sharded.named_tensors())
    for name, tensor in single.named_tensors():
        assert torch.allclose(weights[name], tensor, rtol=0, atol=1e-12), name


def test_compute_dtype_autocasts_as_on_one_device(tiny_model_path, processor, synthetic_rows):
    """fp32 weights with bf16 compute (the GPU default: compute_dtype=auto): the sharded actor autocasts like the
    single-device one, rather than computing in fp32 (other numbers, more memory, slower)."""
    batch = make_batch(processor, synthetic_rows[:2], n=2, text_only_rows=(1,))
    config = ActorConfig(model_path=tiny_model_path, device="cpu", dtype="float32", compute_dtype="bfloat16")
    single = Actor(config, total_steps=1, mini_batch_samples=4)
    sharded = ShardedActor(config, world_size=1)
    assert sharded.compute_dtype == single.compute_dtype == torch.bfloat16
    expected, _ = single.compute_logprobs(batch)
    got, _ = sharded.compute_logprobs(batch)
    assert torch.equal(got, expected)
    config.compute_dtype = "float32"
    full, _ = ShardedActor(config, world_size=1).compute_logprobs(batch)
    assert (full - expected).abs().max() > 1e-3, "bf16 autocast should move the logprobs"
