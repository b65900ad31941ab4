"""The actor on the tiny Qwen2.5-VL (and, where marked, on both embedded families): logprobs with explicit 3D
positions, micro-batch invariance, KL reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.batches import make_batch
from vlmrl.actor.local import Actor
from vlmrl.algorithms.grpo import group_advantages
from vlmrl.batch.padding import upsample_to_multiple
from vlmrl.config import ActorConfig, OptimConfig
from vlmrl.models.families import family_of


def actor_config(tiny_model_path, **overrides) -> ActorConfig:
    """The actor these tests compare across micro-batchings, in its per-row vision encoding (share_vision off): the
    micro-batch invariances below are exact there; sharing the tower across rows is held to it, padded, packed and
    with LoRA, in tests/actor/test_vision_share.py (its tower gradients agree to float32 rounding, since
    transformers computes parts of the tower, its RMSNorm and rotary, in float32 whatever the model's dtype)."""
    config = ActorConfig(model_path=tiny_model_path, optim=OptimConfig(lr=1e-3, weight_decay=0.0),
                         ppo_micro_batch_size_per_gpu=8, device="cpu", dtype="float32", share_vision=False)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@pytest.fixture(scope="module")
def batch(processor, synthetic_rows):
    # 4 prompts x 2 samples; prompt 2 is text-only, so micro-batches mix rows with and without images
    return make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(2,))


@pytest.fixture(scope="module")
def family_batch(tiny_family, synthetic_rows):
    """(model path, processor, batch like `batch`) for each embedded family."""
    path, processor = tiny_family
    return path, processor, make_batch(processor, synthetic_rows[:4], n=2, text_only_rows=(2,))


def test_logprobs_equal_transformers_own_position_computation(family_batch):
    """The actor passes vlmrl's (3, B, L) position ids and no mm_token_type_ids; transformers, given the token types
    instead (5.x needs them without position ids), computes its own: the logprobs agree (Qwen3-VL: its own
    get_rope_index, interleaved mrope, deepstack)."""
    tiny_model_path, processor, batch = family_batch
    actor = Actor(actor_config(tiny_model_path, ppo_micro_batch_size_per_gpu=3), total_steps=1, mini_batch_samples=8)
    seen = []
    hook = actor.model.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(kwargs), with_kwargs=True)
    ours, _ = actor.compute_logprobs(batch)
    hook.remove()
    assert seen and all("mm_token_type_ids" not in kw for kw in seen)
    rows = 3 if processor.family.inputs.mrope else None  # a 1-D family (InternVL) gets one row of positions
    assert all(kw["position_ids"].shape == ((rows,) if rows else ()) + kw["input_ids"].shape for kw in seen)
    model = actor.model.eval()
    p_len = batch.prompt_length
    for row in range(len(batch)):
        # transformers computes mrope positions itself when told which tokens are image tokens
        ids = batch.input_ids[row : row + 1]
        mm = batch.multi_modal_inputs[row]
        inputs = processor.family.inputs.forward_inputs(dict(
            input_ids=ids, attention_mask=batch.attention_mask[row : row + 1],
            mm_token_type_ids=(ids == processor.image_token_id).int(), pixel_values=mm.get("pixel_values"),
            image_grid_thw=mm.get("image_grid_thw")))
        with torch.no_grad():
            logits = model(**inputs).logits
        logprobs = torch.log_softmax(logits[0, p_len - 1 : -1], dim=-1)
        expected = logprobs.gather(-1, batch.input_ids[row, p_len:, None])[:, 0] * batch.response_mask[row]
        assert torch.allclose(ours[row], expected, atol=1e-5), f"row {row}"


def test_logprobs_do_not_depend_on_micro_batch_size(tiny_model_path, batch):
    actor = Actor(actor_config(tiny_model_path), total_steps=1, mini_batch_samples=8)
    whole, entropy = actor.compute_logprobs(batch, with_entropy=True)
    actor.config.ppo_micro_batch_size_per_gpu = 1
    single, _ = actor.compute_logprobs(batch)
    assert torch.allclose(whole, single, atol=1e-5)
    assert (whole[batch.response_mask == 0] == 0).all()
    assert (entropy[batch.response_mask > 0] > 0).all()


def _one_update(tiny_model_path, batch, micro: int, dtype=torch.float64):
    actor = Actor(actor_config(tiny_model_path, ppo_micro_batch_size_per_gpu=micro), total_steps=1,
                  mini_batch_samples=len(batch))
    actor.model.to(dtype)  # float64 so that only the accumulation order could differ
    old, _ = actor.compute_logprobs(batch)
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding)
    metrics = actor.update(batch, old.to(dtype), advantages.to(dtype))
    grads = {name: p.grad.clone() for name, p in actor.model.named_parameters() if p.grad is not None}
    return actor, metrics, grads


def _vision(name: str) -> bool:
    """A parameter of the vision side (Qwen and GLM: model.visual; InternVL: model.vision_tower)."""
    return "visual" in name or "vision_tower" in name


def test_one_micro_batch_of_8_equals_eight_of_1(family_batch):
    tiny_model_path, _, batch = family_batch
    big, big_metrics, big_grads = _one_update(tiny_model_path, batch, micro=8)
    small, small_metrics, small_grads = _one_update(tiny_model_path, batch, micro=1)
    assert big_metrics["actor/pg_loss"] == pytest.approx(small_metrics["actor/pg_loss"], abs=1e-12)
    assert big_metrics["actor/grad_norm"] == pytest.approx(small_metrics["actor/grad_norm"], rel=1e-10)
    assert big_metrics["actor/grad_norm"] > 0
    assert big_grads.keys() == small_grads.keys() and any(_vision(name) for name in big_grads)
    # transformers' Gated DeltaNet (Qwen3.5) runs its delta rule in float32 whatever the model's dtype, and GLM-4.1V
    # interpolates its learned vision position embeddings in float32 (grid_sample): there the float64 update agrees
    # to float32 rounding of each gradient's scale (measured: 1.8e-7 and 5.9e-8 of it at most)
    family = family_of(big.model.config)

    def float32_inside(name: str) -> bool:
        return family.weights.linear_attention is not None or "visual.embeddings.position_embedding" in name

    for name, grad in big_grads.items():
        if float32_inside(name):
            assert (grad - small_grads[name]).abs().max() <= 1e-6 * grad.abs().max() + 1e-12, name
        else:
            assert torch.allclose(grad, small_grads[name], rtol=1e-9, atol=1e-12), name
    for (name, p), (_, q) in zip(big.model.named_parameters(), small.model.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-6 if float32_inside(name) else 1e-9, atol=1e-12), name


def test_padding_rows_change_no_gradient(tiny_model_path, processor, batch):
    _, metrics, grads = _one_update(tiny_model_path, batch, micro=3)
    padded = upsample_to_multiple(batch, 12, eos_token_id=processor.eos_token_ids[0],
                                  pad_token_id=processor.pad_token_id)
    assert len(padded) == 12 and int(padded.is_padding.sum()) == 4
    _, padded_metrics, padded_grads = _one_update(tiny_model_path, padded, micro=3)
    assert padded_metrics["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"], abs=1e-12)
    for name, grad in grads.items():
        assert torch.allclose(grad, padded_grads[name], rtol=1e-9, atol=1e-12), name


def test_update_raises_the_logprob_of_rewarded_samples(family_batch):
    tiny_model_path, _, batch = family_batch
    actor = Actor(actor_config(tiny_model_path, optim=OptimConfig(lr=1e-2, weight_decay=0.0)), total_steps=1,
                  mini_batch_samples=len(batch))
    old, _ = actor.compute_logprobs(batch)
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding)
    actor.update(batch, old, advantages)
    new, _ = actor.compute_logprobs(batch)
    mask = batch.response_mask
    change = ((new - old) * mask).sum(1) / mask.sum(1)
    assert (change[advantages > 0] > 0).all() and (change[advantages < 0] < 0).all()


def test_reference_is_loaded_only_with_the_kl_loss(tiny_model_path, batch):
    plain = Actor(actor_config(tiny_model_path), total_steps=1, mini_batch_samples=8)
    assert plain.reference is None
    with pytest.raises(RuntimeError, match="use_kl_loss"):
        plain.compute_logprobs(batch, reference=True)

    actor = Actor(actor_config(tiny_model_path, use_kl_loss=True, kl_loss_coef=0.5), total_steps=2,
                  mini_batch_samples=8)
    initial = copy.deepcopy(actor.model.state_dict())
    old, _ = actor.compute_logprobs(batch)
    ref, _ = actor.compute_logprobs(batch, reference=True)
    assert torch.equal(old, ref)
    advantages = group_advantages(batch.rewards, batch.uids)
    first = actor.update(batch, old, advantages, ref)
    assert first["actor/kl_loss"] == pytest.approx(0.0, abs=1e-9)  # policy == reference before the first step
    second = actor.update(batch, old, advantages, ref)
    assert second["actor/kl_loss"] > 0
    for name, tensor in actor.reference.state_dict().items():
        assert torch.equal(tensor, initial[name]), f"reference weight {name} moved"


def test_update_refuses_a_batch_that_is_not_a_mini_batch_multiple(tiny_model_path, batch):
    actor = Actor(actor_config(tiny_model_path), total_steps=1, mini_batch_samples=3)
    with pytest.raises(ValueError, match="upsample"):
        actor.update(batch, torch.zeros_like(batch.response_mask), torch.zeros(len(batch)))


def test_mini_and_micro_batches_of_only_padding_rows_are_counted(tiny_model_path, processor, batch):
    """8 real rows padded to 12: with mini-batches of 4 the last one is only padding (an optimizer step skipped); with
    mini-batches of 6 and micro-batches of 2 the second mini-batch runs rows 6-7 and skips two micro-batches of
    padding. Both counts are step metrics, not only a log line."""
    padded = upsample_to_multiple(batch, 12, eos_token_id=processor.eos_token_ids[0],
                                  pad_token_id=processor.pad_token_id)
    advantages = group_advantages(padded.rewards, padded.uids, padded.is_padding)
    by_four = Actor(actor_config(tiny_model_path), total_steps=1, mini_batch_samples=4)
    metrics = by_four.update(padded, by_four.compute_logprobs(padded)[0], advantages)
    assert metrics["actor/empty_steps"] == 1 and metrics["actor/skipped_steps"] == 1
    assert metrics["actor/empty_micro_batches"] == 0
    by_six = Actor(actor_config(tiny_model_path, ppo_micro_batch_size_per_gpu=2), total_steps=1,
                   mini_batch_samples=6)
    metrics = by_six.update(padded, by_six.compute_logprobs(padded)[0], advantages)
    assert metrics["actor/empty_steps"] == 0 and metrics["actor/skipped_steps"] == 0
    assert metrics["actor/empty_micro_batches"] == 2


def test_named_tensors_cover_every_weight(tiny_model_path):
    actor = Actor(actor_config(tiny_model_path), total_steps=1, mini_batch_samples=8)
    names = dict(actor.named_tensors())
    assert set(names) == set(actor.model.state_dict())
    assert any(name.startswith("model.visual") for name in names)


def test_skipping_the_old_logprob_pass_gives_the_same_update(tiny_model_path, batch):
    """With one optimizer step per batch the old policy is the current one: its logprobs come from the update's own
    forward (ratio exactly 1) instead of a separate pass, and the update is the same."""
    with_pass, metrics, grads = _one_update(tiny_model_path, batch, micro=4)
    actor = Actor(actor_config(tiny_model_path, ppo_micro_batch_size_per_gpu=4), total_steps=1,
                  mini_batch_samples=len(batch))
    actor.model.to(torch.float64)
    assert not actor.needs_old_logprobs(len(batch)) and actor.needs_old_logprobs(2 * len(batch))
    skipped = actor.update(batch, None, group_advantages(batch.rewards, batch.uids).to(torch.float64))
    # a float64 model's separate pass returns float64 logprobs: the two differ by float64 summation order only
    assert skipped["actor/pg_loss"] == pytest.approx(metrics["actor/pg_loss"], rel=1e-12, abs=1e-15)
    assert skipped["actor/entropy"] == pytest.approx(metrics["actor/entropy"], rel=1e-12)
    for name, p in actor.model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(p.grad, grads[name], rtol=1e-9, atol=1e-12), name
    with pytest.raises(ValueError, match="old_logprobs are needed"):
        Actor(actor_config(tiny_model_path), total_steps=1, mini_batch_samples=4).update(
            batch, None, torch.zeros(len(batch)))


def test_a_float64_model_trains_in_float64(tiny_model_path, processor, batch):
    """float64 weights: logprobs, advantages, loss and gradients stay float64 (promoted to at least float32, never
    cast down), so one update equals GRPO's ppo-clip loss written out here in float64 over the model's own logits
    (transformers' own positions, one row at a time)."""
    actor = Actor(actor_config(tiny_model_path, grad_clip=0.0), total_steps=1, mini_batch_samples=len(batch))
    actor.model.to(torch.float64)
    model = copy.deepcopy(actor.model).eval()
    current, _ = actor.compute_logprobs(batch)
    assert current.dtype == torch.float64
    mask = batch.response_mask.double()
    noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    old = (current + 0.3 * noise) * mask  # ratios off 1: both clips bite
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).double()
    metrics = actor.update(batch, old, advantages)

    p_len = batch.prompt_length
    total = torch.zeros((), dtype=torch.float64)
    for row in range(len(batch)):
        ids, mm = batch.input_ids[row : row + 1], batch.multi_modal_inputs[row]
        pixels = mm.get("pixel_values")
        logits = model(input_ids=ids, attention_mask=batch.attention_mask[row : row + 1],
                       mm_token_type_ids=(ids == processor.image_token_id).int(),
                       pixel_values=pixels.double() if pixels is not None else None,
                       image_grid_thw=mm.get("image_grid_thw")).logits[0, p_len - 1 : -1]
        assert logits.dtype == torch.float64
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, batch.input_ids[row, p_len:, None])[:, 0]
        ratio = torch.exp(logprobs - old[row])
        a = advantages[row]
        clipped = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
        loss = torch.minimum(clipped, -a * 3.0) if a < 0 else clipped  # dual clip (clip_ratio_c = 3)
        total = total + (loss * mask[row]).sum()
    expected = total / mask.sum()  # token-mean over the mini-batch
    expected.backward()
    assert metrics["actor/pg_loss"] == pytest.approx(expected.item(), rel=1e-10, abs=1e-15)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    trained = {n: p.grad for n, p in actor.model.named_parameters() if p.grad is not None}
    assert trained.keys() == grads.keys() and any(_vision(n) for n in grads)
    for name, grad in trained.items():
        assert grad.dtype == torch.float64 and torch.allclose(grad, grads[name], rtol=1e-8, atol=1e-13), name


def test_mixed_precision_keeps_float32_master_weights(tiny_model_path, batch):
    """bfloat16 compute (what GPUs get by default) with float32 weights: a tiny update still lands in the weights."""
    actor = Actor(actor_config(tiny_model_path, compute_dtype="bfloat16", optim=OptimConfig(lr=1e-6)),
                  total_steps=1, mini_batch_samples=len(batch))
    exact, _ = Actor(actor_config(tiny_model_path), total_steps=1, mini_batch_samples=8).compute_logprobs(batch)
    mixed, _ = actor.compute_logprobs(batch)
    assert (mixed - exact).abs().max() < 0.1 and not torch.equal(mixed, exact)
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    actor.update(batch, None, group_advantages(batch.rewards, batch.uids))
    moved = [n for n, p in actor.model.named_parameters() if not torch.equal(p, before[n])]
    assert all(p.dtype == torch.float32 for p in actor.model.parameters())
    assert len(moved) > len(before) // 2, "an lr-1e-6 step must change float32 weights"


# ---- every policy loss and loss aggregation mode ---------------------------------------------------------------------

# (policy loss, loss_agg_mode): every mode with ppo-clip, and gspo / cispo / sapo with a token and a sequence mode
LOSS_MODES = [("ppo-clip", mode) for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                               "seq-mean-token-sum-norm")]
LOSS_MODES += [(loss, mode) for loss in ("gspo", "cispo", "sapo") for mode in ("token-mean", "seq-mean-token-mean")]
CLIPS = {"ppo-clip": dict(clip_ratio_low=0.2, clip_ratio_high=0.28), "gspo": dict(clip_ratio_low=3e-4,
         clip_ratio_high=4e-4), "cispo": dict(clip_ratio_low=1.0, clip_ratio_high=0.2),
         "sapo": dict(sapo_tau_pos=0.5, sapo_tau_neg=2.0)}


def _mode_update(tiny_model_path, batch, micro: int, loss: str, mode: str, weights: torch.Tensor | None = None):
    """One optimizer step in float64 with old logprobs off the current policy (ratios off 1: the clips bite)."""
    actor = Actor(actor_config(tiny_model_path, ppo_micro_batch_size_per_gpu=micro, policy_loss=loss,
                               loss_agg_mode=mode, entropy_coeff=0.01, **CLIPS[loss]),
                  total_steps=1, mini_batch_samples=len(batch))
    actor.model.to(torch.float64)
    current, _ = actor.compute_logprobs(batch)
    noise = torch.randn(current.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    old = (current.double() + 0.3 * noise) * batch.response_mask
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).double()
    metrics = actor.update(batch, old, advantages, loss_weights=weights)
    grads = {name: p.grad.clone() for name, p in actor.model.named_parameters() if p.grad is not None}
    return metrics, grads


@pytest.mark.parametrize("loss, mode", LOSS_MODES, ids=[f"{loss}-{mode}" for loss, mode in LOSS_MODES])
def test_every_loss_and_mode_one_micro_batch_of_8_equals_eight_of_1(tiny_model_path, batch, loss, mode):
    weights = torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    weights = (0.5 + 1.5 * weights) * batch.response_mask  # rollout-correction weights ride along
    big_metrics, big_grads = _mode_update(tiny_model_path, batch, 8, loss, mode, weights)
    small_metrics, small_grads = _mode_update(tiny_model_path, batch, 1, loss, mode, weights)
    assert big_metrics["actor/grad_norm"] > 0
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert small_metrics[key] == pytest.approx(big_metrics[key], rel=1e-9, abs=1e-12), key
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_low", "actor/pg_clipfrac_high", "actor/dual_clip_fraction",
                "actor/ratio_mean", "actor/ratio_min", "actor/ratio_max"):  # diagnostics, token means in float32
        assert small_metrics[key] == pytest.approx(big_metrics[key], rel=1e-6, abs=1e-9), key
    assert big_metrics["actor/ratio_min"] <= big_metrics["actor/ratio_mean"] <= big_metrics["actor/ratio_max"]
    assert big_grads.keys() == small_grads.keys()
    for name, grad in big_grads.items():
        assert torch.allclose(grad, small_grads[name], rtol=1e-9, atol=1e-12), name


@pytest.mark.parametrize("loss, mode", LOSS_MODES, ids=[f"{loss}-{mode}" for loss, mode in LOSS_MODES])
def test_padding_rows_change_nothing_in_any_loss_or_mode(tiny_model_path, processor, batch, loss, mode):
    metrics, grads = _mode_update(tiny_model_path, batch, 3, loss, mode)
    padded = upsample_to_multiple(batch, 12, eos_token_id=processor.eos_token_ids[0],
                                  pad_token_id=processor.pad_token_id)
    padded_metrics, padded_grads = _mode_update(tiny_model_path, padded, 3, loss, mode)
    for key in ("actor/pg_loss", "actor/entropy"):
        assert padded_metrics[key] == pytest.approx(metrics[key], rel=1e-9, abs=1e-12), key
    for key in ("actor/pg_clipfrac", "actor/ratio_mean", "actor/ratio_min", "actor/ratio_max"):
        assert padded_metrics[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-9), key
    for name, grad in grads.items():
        assert torch.allclose(grad, padded_grads[name], rtol=1e-9, atol=1e-12), name


def test_the_modes_weigh_rows_differently(tiny_model_path, batch):
    """The modes are not one computation under four names: with rows of different lengths, seq-mean-token-mean
    weighs each sequence equally and token-mean each token, so their gradients differ; the -norm mode is
    seq-mean-token-sum divided by the constant R, so their gradients are parallel (the norm clip may rescale
    either; the logits' backward runs in float32, hence float32 tolerances)."""
    _, token = _mode_update(tiny_model_path, batch, 8, "ppo-clip", "token-mean")
    _, seq_mean = _mode_update(tiny_model_path, batch, 8, "ppo-clip", "seq-mean-token-mean")
    _, seq_sum = _mode_update(tiny_model_path, batch, 8, "ppo-clip", "seq-mean-token-sum")
    _, seq_norm = _mode_update(tiny_model_path, batch, 8, "ppo-clip", "seq-mean-token-sum-norm")
    name = next(n for n in token if "visual" not in n)
    assert not torch.allclose(token[name], seq_mean[name], rtol=1e-3)
    flat = {key: torch.cat([g.flatten() for g in grads.values()]) for key, grads in
            (("sum", seq_sum), ("norm", seq_norm))}
    scale = float(flat["sum"].norm() / flat["norm"].norm())
    assert float((flat["sum"] - scale * flat["norm"]).norm() / flat["sum"].norm()) < 1e-5


def test_the_update_reports_the_engine_mismatch_of_its_own_tokens(tiny_model_path, batch):
    """mismatch/* come from the update's own pre-update logprobs (no extra forward): an engine whose logprobs are
    the trainer's shifted by a known gap gives that gap back, per data source and modality."""
    from dataclasses import replace

    actor = Actor(actor_config(tiny_model_path, ppo_micro_batch_size_per_gpu=3), total_steps=1,
                  mini_batch_samples=len(batch))
    trainer, _ = actor.compute_logprobs(batch)
    gap = 0.05
    engine = replace(batch, rollout_logprobs=(trainer - gap) * batch.response_mask)
    adv = group_advantages(batch.rewards, batch.uids, batch.is_padding)
    metrics = actor.update(engine, None, adv)  # one optimizer step: no old-logprob pass
    tokens = float(batch.response_mask.sum())
    assert metrics["mismatch/tokens"] == tokens
    assert metrics["mismatch/k1"] == pytest.approx(-gap, abs=1e-6)
    assert metrics["mismatch/k3"] == pytest.approx(math.exp(gap) - 1 - gap, rel=1e-3)
    assert metrics["mismatch/abs_dlogp_max"] == pytest.approx(gap, abs=1e-6)
    assert metrics["mismatch/over_threshold"] == 0.0
    assert metrics["mismatch/modality/text/tokens"] + metrics["mismatch/modality/image/tokens"] == tokens
    assert metrics["rollout/logprob_abs_diff"] == pytest.approx(gap, abs=1e-6)
    quiet = Actor(actor_config(tiny_model_path, mismatch_metrics=False), total_steps=1, mini_batch_samples=len(batch))
    assert not any(k.startswith("mismatch/") for k in quiet.update(engine, None, adv))
