"""VisionAlwaysOn: the vision tower runs in every forward (so sharded ranks issue the same collectives), and the
model's outputs and gradients are exactly those of the plain model."""

from __future__ import annotations

import torch

from tests.batches import make_batch
from vlmrl.actor import load_policy, micro_batch
from vlmrl.distributed.vision import VisionAlwaysOn


def _forward(model, mb):
    return model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                 pixel_values=mb.pixel_values, image_grid_thw=mb.image_grid_thw, use_cache=False).logits


def test_text_only_forward_runs_the_tower_and_changes_nothing(tiny_model_path, processor, synthetic_rows):
    batch = make_batch(processor, synthetic_rows[:2], n=2, text_only_rows=(0, 1))
    plain = load_policy(tiny_model_path, torch.float64, torch.device("cpu"))
    wrapped = VisionAlwaysOn(load_policy(tiny_model_path, torch.float64, torch.device("cpu")))
    calls = []
    wrapped.model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    mb = micro_batch(batch, range(len(batch)), torch.device("cpu"))
    assert mb.pixel_values is None

    expected, got = _forward(plain, mb), _forward(wrapped, mb)
    assert calls == [1], "the vision tower must run once per forward even without images"
    assert torch.equal(expected, got)

    expected.sum().backward()
    got.sum().backward()
    for (name, p), q in zip(plain.named_parameters(), wrapped.model.parameters()):
        if "visual" in name:
            # the tower joins the backward (its gradient reduce-scatter happens on every rank) with exactly 0
            assert p.grad is None and q.grad is not None and torch.count_nonzero(q.grad) == 0, name
        else:
            assert torch.equal(p.grad, q.grad), name


def test_forward_with_images_is_the_plain_forward(tiny_model_path, processor, synthetic_rows):
    batch = make_batch(processor, synthetic_rows[:2], n=1, text_only_rows=(1,))
    plain = load_policy(tiny_model_path, torch.float32, torch.device("cpu"))
    wrapped = VisionAlwaysOn(plain)
    mb = micro_batch(batch, range(len(batch)), torch.device("cpu"))
    assert mb.pixel_values is not None
    with torch.no_grad():
        assert torch.equal(_forward(plain, mb), _forward(wrapped, mb))
