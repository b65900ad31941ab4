"""The CUDA-only paths of the dp=2 update (two Ray workers, one GPU each, FSDP2 over NCCL): bf16 autocast with fp32
master weights, and NCCL's update against gloo's. Built like test_group.py's dp=2 tests, whose helpers they use."""

from __future__ import annotations

import pytest
import torch

from tests.batches import make_batch
from tests.distributed.test_group import actor_config, assert_same_metrics, assert_same_weights, perturbed, start_dp2
from vlmrl.algorithms.grpo import group_advantages
from vlmrl.distributed.group import ClusterSpec, DistributedActor
from vlmrl.distributed.worker import WorkerSpec

pytestmark = [pytest.mark.ray, pytest.mark.gpu(devices=2)]


def _gpu_step(model_path: str, compute_dtype: str, batch, advantages, old=None):
    """One dp=2 step on the GPUs: fp32 weights, `compute_dtype` forwards and backwards (autocast), no weight decay
    (the change is the gradients' alone). `old` None: the old logprobs are this run's, a little perturbed (so that
    PPO ratios differ from 1). Returns (logprobs, old, metrics, weights before, weights after)."""
    config = actor_config(model_path, micro=2, device="cuda", compute_dtype=compute_dtype)
    config.optim.weight_decay = 0.0
    with DistributedActor(ClusterSpec(n_gpus_per_node=2), WorkerSpec(actor=config, torch_threads=1, timeout_s=120),
                          mini_batch_samples=4, timeout_s=300) as dp2:  # GPU bundles: the Ray cluster has GPUs
        logprobs, _ = dp2.compute_logprobs(batch)
        logprobs = logprobs.cpu()
        old = perturbed(logprobs, batch).float() if old is None else old
        start = {k: v.cpu().clone() for k, v in dp2.named_tensors()}
        metrics = dp2.update(batch, old, advantages)
        return logprobs, old, metrics, start, {k: v.cpu() for k, v in dp2.named_tensors()}


def test_bf16_autocast_at_dp2_runs_in_bf16_and_matches_the_fp32_update(ray_cluster, tiny_model_path, processor,
                                                                         synthetic_rows):
    batch = make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(1, 3))
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).float()
    lp32, old, m32, start, after32 = _gpu_step(tiny_model_path, "float32", batch, advantages)
    lp16, _, m16, start16, after16 = _gpu_step(tiny_model_path, "bfloat16", batch, advantages, old)

    assert all(torch.equal(start16[k], start[k]) for k in start), "both runs start from the same weights"
    moved = float((lp16 - lp32).abs().max())
    assert 1e-3 < moved < 0.05, f"bf16 logprobs differ from fp32 by {moved:.3g} (autocast moves them ~1e-2)"
    assert all(t.dtype == torch.float32 for t in after16.values()), "master weights must stay fp32"
    assert m16["actor/grad_norm"] != m32["actor/grad_norm"], "the same gradients in bf16 and fp32: no autocast"
    assert m16["actor/grad_norm"] == pytest.approx(m32["actor/grad_norm"], rel=0.05)
    assert m16["actor/pg_loss"] == pytest.approx(m32["actor/pg_loss"], rel=0.05, abs=0.01)
    # AdamW's steps are about lr * sign(grad): bf16 may flip the sign of the smallest gradients only
    step32 = torch.cat([(after32[k] - start[k]).flatten() for k in start]).double()
    step16 = torch.cat([(after16[k] - start[k]).flatten() for k in start]).double()
    cosine = float(torch.nn.functional.cosine_similarity(step16, step32, dim=0))
    assert cosine > 0.8, f"the bf16 update points elsewhere than the fp32 one (cosine {cosine:.3f})"


def test_nccl_dp2_update_equals_the_gloo_one(ray_cluster, tiny_model_path, processor, synthetic_rows):
    """float64 on both sides (as in test_group.py): only the devices and the summation order differ."""
    batch = make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(1, 3))
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).double()
    extra = dict(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    runs, old = {}, None
    for device in ("cpu", "cuda"):  # gloo, then NCCL: the process group's backend follows the device
        with start_dp2(actor_config(tiny_model_path, micro=1, device=device, **extra), mini_batch_samples=4) as dp2:
            logprobs, _ = dp2.compute_logprobs(batch)
            ref_lp, _ = dp2.compute_logprobs(batch, reference=True)
            logprobs, ref_lp = logprobs.cpu().double(), ref_lp.cpu().double()
            if old is None:  # the NCCL run gets the gloo run's inputs
                old, ref_in = perturbed(logprobs, batch), ref_lp
            start = {k: v.cpu().clone() for k, v in dp2.named_tensors()}
            metrics = dp2.update(batch, old, advantages, ref_in)
            runs[device] = (logprobs, ref_lp, metrics, start, {k: v.cpu() for k, v in dp2.named_tensors()})
    (lp_gloo, ref_gloo, m_gloo, start, w_gloo), (lp_nccl, ref_nccl, m_nccl, _, w_nccl) = runs["cpu"], runs["cuda"]
    for name, a, b in (("logprobs", lp_gloo, lp_nccl), ("reference logprobs", ref_gloo, ref_nccl)):
        diff = float((a - b).abs().max())
        assert diff <= 1e-8, f"{name}: NCCL on the GPUs differs from gloo on the CPUs by {diff:.3g}"
    assert m_gloo["actor/pg_clipfrac"] > 0 and m_gloo["actor/kl_loss"] > 0
    assert_same_metrics(m_gloo, m_nccl)
    assert_same_weights(w_gloo, w_nccl, start)
