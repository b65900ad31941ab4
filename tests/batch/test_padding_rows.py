"""Padding rows change nothing: advantages, the policy loss and every gradient of a real model forward are the same
with and without upsampling (duplicated real rows, the usual way to pad, would change all three)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.processors.helpers import image_row, noise_image
from vlmrl.algorithms.grpo import broadcast_to_tokens, group_advantages, logprobs_from_logits, ppo_clip_loss
from vlmrl.batch.padding import pad_sample, required_batch_multiple, stack_samples, upsample_to_multiple
from vlmrl.processors.loading import load_processor
from vlmrl.types import TrainBatch

P, R, N = 48, 8, 3  # prompt length, response length, samples per prompt
TOL = 1e-6


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen3-vl"])
def model_path(request):
    """Each embedded family in turn (Qwen3-VL: its deepstack features go to the image rows' tokens only)."""
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built(request.param))


@pytest.fixture(scope="module")
def processor(model_path):
    return load_processor(model_path)


@pytest.fixture(scope="module")
def model(model_path):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_pretrained(model_path, attn_implementation="eager").train()


def _random_batch(processor, seed: int) -> TrainBatch:
    """Three prompts (two images, one image, text only) x N samples with random responses, logprobs and rewards."""
    rng = random.Random(seed)
    rows = [image_row("<image><image>Same?", [noise_image(90, 60, seed), noise_image(60, 60, seed + 1)]),
            image_row("<image>Colour?", [noise_image(120, 84, seed + 2)]),
            {"prompt": "Say yes."}]
    samples = []
    for index, row in enumerate(rows):
        prompt = processor.prompt_inputs(processor.build_request(row, index))
        for _ in range(N):
            length = rng.randint(1, R)
            response = [rng.randrange(20, 700) for _ in range(length - 1)] + [processor.eos_token_ids[0]]
            sample = pad_sample(prompt, response, prompt_length=P, response_length=R,
                                pad_token_id=processor.pad_token_id,
                                rollout_logprobs=[-rng.uniform(4.0, 9.0) for _ in range(length)])
            sample.reward = rng.choice([0.0, 0.1, 1.0])
            samples.append(sample)
    return stack_samples(samples)


def _loss_and_grads(model, batch: TrainBatch):
    """GRPO advantages, one forward with explicit 3D position ids, the PPO-clip token-mean loss and its gradients."""
    model.zero_grad(set_to_none=True)
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding)
    with_images = [m for m in batch.multi_modal_inputs if m]  # padding rows carry none
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.mrope_position_ids(),
        pixel_values=torch.cat([m["pixel_values"] for m in with_images]),
        image_grid_thw=torch.cat([m["image_grid_thw"] for m in with_images]),
    ).logits
    logprobs = logprobs_from_logits(logits[:, P - 1: -1], batch.response_ids)  # (B, R)
    loss = ppo_clip_loss(logprobs, batch.rollout_logprobs, broadcast_to_tokens(advantages, batch.response_mask),
                         batch.response_mask).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return advantages, loss.detach(), logprobs.detach(), grads


@pytest.mark.parametrize("seed", [0, 1])
def test_padding_rows_change_nothing(processor, model, seed):
    batch = _random_batch(processor, seed)  # 9 rows
    multiple = required_batch_multiple(dp_size=2, ppo_mini_batch_size=2, rollout_n=N)  # 6 -> 12 rows
    padded = upsample_to_multiple(batch, multiple, eos_token_id=processor.eos_token_ids[0],
                                  pad_token_id=processor.pad_token_id)
    assert len(padded) == 12 and int(padded.is_padding.sum()) == 3

    adv, loss, logprobs, grads = _loss_and_grads(model, batch)
    adv_p, loss_p, logprobs_p, grads_p = _loss_and_grads(model, padded)

    assert adv.abs().max() > 0.1, "the random batch should carry a learning signal"
    assert torch.allclose(adv_p[:9], adv, atol=TOL, rtol=0) and adv_p[9:].eq(0).all()
    assert abs(float(loss_p) - float(loss)) <= TOL, f"loss {float(loss)} vs padded {float(loss_p)}"
    real_tokens = batch.response_mask.bool()
    assert torch.allclose(logprobs_p[:9][real_tokens], logprobs[real_tokens], atol=1e-5, rtol=0)
    assert grads.keys() == grads_p.keys() and len(grads) == len(list(model.parameters()))
    assert any(g.abs().max() > 1e-4 for g in grads.values()), "gradients should not be trivially zero"
    for name, grad in grads.items():
        diff = float((grads_p[name] - grad).abs().max())
        assert diff <= TOL, f"{name}: gradient differs by {diff} with padding rows"
    assert not set(padded.uids[9:]) & set(batch.uids) and len(set(padded.uids[9:])) == 3
