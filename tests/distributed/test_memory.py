"""The memory options on two Ray workers (FSDP2, gloo, CPU) take the single-process actor's step: token-budget
micro-batches, padded or with the packed forward (ranks given balanced rows, each rank splitting its packs to the
count of the rank with the most), the packed forward on fixed rows, and parameter + optimizer offload (torch's
CPUOffloadPolicy). float64 as in test_group."""

from __future__ import annotations

import pytest
import torch

from tests.batches import make_batch
from tests.distributed.test_group import (
    actor_config,
    assert_same_metrics,
    assert_same_weights,
    perturbed,
    single_process,
    start_dp2,
)
from vlmrl.actor.config import OffloadConfig
from vlmrl.algorithms.grpo import group_advantages
from vlmrl.batch.padding import upsample_to_multiple

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def batch(processor, synthetic_rows):
    # 6 real rows (one text-only prompt, 'tool tokens' masked out of the loss in two rows) + 2 padding rows
    real = make_batch(processor, synthetic_rows[4:7], n=2, text_only_rows=(1,), seed=1, response_length=8)
    real.response_mask[0, 1:3] = 0
    real.response_mask[3, 2:4] = 0
    return upsample_to_multiple(real, 8, eos_token_id=processor.eos_token_ids[0], pad_token_id=processor.pad_token_id)


# "token-budget" and "packed" alone are variants (marker `full`, make test-all): make test keeps the two together
# ("token-budget-packed") and offload; each alone against one process is in tests/actor/test_micro_batches.py.
@pytest.mark.parametrize("dp2_options", [
    pytest.param(dict(micro_batch_tokens=120, padding_free=True), id="token-budget-packed"),
    pytest.param(dict(micro_batch_tokens=120), id="token-budget", marks=pytest.mark.full),  # budget only: padded packs
    pytest.param(dict(micro=2, padding_free=True), id="packed", marks=pytest.mark.full),  # fixed rows, 2 rows packed
    pytest.param(dict(offload=OffloadConfig(params=True, optimizer=True, reference=True)), id="offload"),
])
def test_dp2_with_memory_options_matches_dp1_fixed_rows(ray_cluster, tiny_model_path, batch, dp2_options):
    extra = dict(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    reference = single_process(actor_config(tiny_model_path, micro=3, **extra), mini_batch_samples=4)
    start = {k: v.clone() for k, v in reference.named_tensors()}
    with start_dp2(actor_config(tiny_model_path, **extra, **{"micro": 1, **dp2_options}), mini_batch_samples=4) as dp2:
        old, entropy = dp2.compute_logprobs(batch, with_entropy=True)
        ref_lp, _ = dp2.compute_logprobs(batch, reference=True)
        expected_old, expected_entropy = reference.compute_logprobs(batch, with_entropy=True)
        assert torch.allclose(old, expected_old, atol=1e-6), "dp=2 logprobs differ from dp=1"
        assert torch.allclose(entropy, expected_entropy, atol=1e-6)
        old = perturbed(old, batch, seed=5)
        advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).double()
        got = dp2.update(batch, old, advantages, ref_lp.double())
        weights = dict(dp2.named_tensors())
    expected = reference.update(batch, old, advantages, ref_lp.double())
    assert expected["actor/kl_loss"] > 0
    assert_same_metrics(expected, got)
    assert_same_weights(dict(reference.named_tensors()), weights, start)
