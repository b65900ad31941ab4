"""VisionAlwaysOn: the vision tower runs in every forward (so sharded ranks issue the same collectives), every vision
tensor (Qwen3-VL's deepstack mergers included) joins the backward, and the model's outputs and gradients are exactly
those of the plain model. Each test runs on both embedded families."""

from __future__ import annotations

import torch

from tests.batches import make_batch
from vlmrl.actor.forward import micro_batch
from vlmrl.actor.policy import load_policy
from vlmrl.distributed.vision import VisionAlwaysOn
from vlmrl.models.families import family_of


def _forward(model, mb):
    inputs = family_of(model.config).inputs.forward_inputs(dict(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
        pixel_values=mb.pixel_values, image_grid_thw=mb.image_grid_thw))
    return model(**inputs, use_cache=False).logits


def _vision(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The tower's parameters, and a projector's outside it (InternVL)."""
    family = family_of(model.config)
    prefixes = tuple(p + "." for p in (family.weights.vision_tower, family.weights.vision_projector) if p)
    return {n: p for n, p in model.named_parameters() if n.startswith(prefixes)}


def test_text_only_forward_runs_the_tower_and_changes_nothing(tiny_family, synthetic_rows):
    path, processor = tiny_family
    batch = make_batch(processor, synthetic_rows[:2], n=2, text_only_rows=(0, 1))
    plain = load_policy(path, torch.float64, torch.device("cpu"))
    wrapped = VisionAlwaysOn(load_policy(path, torch.float64, torch.device("cpu")))
    calls = []
    wrapped.model.get_submodule(family_of(plain.config).weights.vision_tower).register_forward_hook(
        lambda *args: calls.append(1))
    mb = micro_batch(batch, range(len(batch)), torch.device("cpu"))
    assert mb.pixel_values is None

    expected, got = _forward(plain, mb), _forward(wrapped, mb)
    assert calls == [1], "the vision tower must run once per forward even without images"
    assert torch.equal(expected, got)

    expected.sum().backward()
    got.sum().backward()
    vision = _vision(plain)
    for (name, p), q in zip(plain.named_parameters(), wrapped.model.parameters()):
        if name in vision:
            # the tower joins the backward (its gradient reduce-scatter happens on every rank) with exactly 0
            assert p.grad is None and q.grad is not None and torch.count_nonzero(q.grad) == 0, name
        else:
            assert torch.equal(p.grad, q.grad), name


def test_every_vision_tensor_gets_a_gradient_on_a_text_only_micro_batch(tiny_family, synthetic_rows):
    """Counted over the whole tower: a tensor left out (Qwen3-VL's deepstack mergers, before the fix 12 of 57) would
    skip its gradient reduce-scatter on a text-only rank while an image rank runs it: FSDP2 then hangs."""
    path, processor = tiny_family
    batch = make_batch(processor, synthetic_rows[:2], n=1, text_only_rows=(0, 1))
    wrapped = VisionAlwaysOn(load_policy(path, torch.float32, torch.device("cpu")))
    _forward(wrapped, micro_batch(batch, range(len(batch)), torch.device("cpu"))).sum().backward()
    vision = _vision(wrapped.model)
    with_grad = [n for n, p in vision.items() if p.grad is not None]
    missing = sorted(set(vision) - set(with_grad))
    assert len(with_grad) == len(vision), f"{len(missing)} of {len(vision)} vision tensors got no gradient: {missing}"
    if family_of(wrapped.config).name == "Qwen3-VL":
        assert any("deepstack_merger_list" in n for n in with_grad)


def test_forward_with_images_is_the_plain_forward(tiny_family, synthetic_rows):
    path, processor = tiny_family
    batch = make_batch(processor, synthetic_rows[:2], n=1, text_only_rows=(1,))
    plain = load_policy(path, torch.float32, torch.device("cpu"))
    wrapped = VisionAlwaysOn(plain)
    mb = micro_batch(batch, range(len(batch)), torch.device("cpu"))
    assert mb.pixel_values is not None
    with torch.no_grad():
        assert torch.equal(_forward(plain, mb), _forward(wrapped, mb))
