"""The vision tower once per distinct image of a forward (actor.share_vision, `vlmrl.actor.vision_share`): on every
family the shared forward gives the per-row forward's logprobs, loss and every gradient (float64: the language
model's to its summation order; the tower's to float32 rounding, since transformers computes parts of the tower in
float32 whatever the model's dtype: `TOWER_ROUNDING`), padded or packed, with chunked logprobs and with LoRA on the
tower; only identical images are shared, the tower's owner is found once per model, and the update counts what it
carried and what it encoded."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.actor.test_actor import actor_config
from tests.batches import make_batch
from vlmrl.actor.local import Actor
from vlmrl.actor.vision_share import VisionCounts, distinct, shared_vision
from vlmrl.algorithms.grpo import group_advantages

FAMILIES = ["tiny", "tiny-qwen3-vl", "tiny-qwen3.5", "tiny-glm4v", "tiny-internvl"]
TOWER_ROUNDING = 8 * torch.finfo(torch.float32).eps
"""How far a float64 update's tower gradients may move with the sharing, relative to each gradient's largest entry.
transformers computes parts of the tower in float32 whatever the model's dtype (Qwen2.5-VL's and GLM-4.1V's
RMSNorm, every Qwen and GLM tower's rotary, GLM-4.1V's position-embedding interpolation), and the backward of such
a cast rounds the gradient flowing through it to float32: the shared backward rounds the sum of a prompt's rows
once, the per-row backwards each row's, and their results differ by float32's rounding of the values there, a
fraction of eps at each cast a gradient crosses. Allowed: 8 eps (9.5e-7); the embedded models reach 0.7 eps
(GLM-4.1V), and Qwen2.5-VL's tower 8e-16 with those casts computed in float64 instead."""


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, synthetic_rows):
    """(model path, batch: 3 prompts x 3 samples, prompt 1 text-only) of each family."""
    from vlmrl.data.config import DataConfig
    from vlmrl.models.tiny import ensure_built
    from vlmrl.processors.loading import load_processor

    path = str(ensure_built(request.param))
    processor = load_processor(path, DataConfig(max_prompt_length=64))
    return path, make_batch(processor, synthetic_rows[:3], n=3, text_only_rows=(1,), seed=3)


def _update(path, batch, share: bool, **overrides):
    actor = Actor(actor_config(path, share_vision=share, **overrides), total_steps=1, mini_batch_samples=len(batch))
    actor.model.to(torch.float64)  # only the summation order of shared gradients may differ
    old, _ = actor.compute_logprobs(batch)
    advantages = group_advantages(batch.rewards, batch.uids, batch.is_padding).to(torch.float64)
    metrics = actor.update(batch, old.to(torch.float64) + 0.01 * batch.response_mask, advantages)
    grads = {name: p.grad.clone() for name, p in actor.model.named_parameters() if p.grad is not None}
    return old, metrics, grads


def _vision(name: str) -> bool:
    """A parameter of the vision side (Qwen, GLM: model.visual; InternVL: its tower and the projector after it)."""
    return any(part in name for part in ("visual", "vision_tower", "multi_modal_projector"))


def _assert_same(shared, per_row, what: str):
    (old_a, metrics_a, grads_a), (old_b, metrics_b, grads_b) = shared, per_row
    assert torch.allclose(old_a, old_b, rtol=0, atol=1e-12), f"{what}: logprobs"
    for key in ("actor/pg_loss", "actor/entropy"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-10, abs=1e-13), f"{what}: {key}"
    # the norm takes the tower's gradients too: float32 rounding (TOWER_ROUNDING)
    assert metrics_a["actor/grad_norm"] == pytest.approx(metrics_b["actor/grad_norm"], rel=TOWER_ROUNDING), what
    assert grads_a.keys() == grads_b.keys() and any(_vision(name) for name in grads_a)
    for name, grad in grads_b.items():
        if _vision(name):
            assert (grads_a[name] - grad).abs().max() <= TOWER_ROUNDING * grad.abs().max(), f"{what}: {name}"
        else:
            assert torch.allclose(grads_a[name], grad, rtol=1e-9, atol=1e-13), f"{what}: {name}"


def test_shared_encoding_equals_the_per_row_forward_in_every_family(family):
    """One micro-batch of 9 rows: 6 carry an image (2 prompts x 3 samples), and the tower encodes 2."""
    path, batch = family
    shared = _update(path, batch, share=True, ppo_micro_batch_size_per_gpu=9)
    per_row = _update(path, batch, share=False, ppo_micro_batch_size_per_gpu=9)
    _assert_same(shared, per_row, path)
    items, encoded = 6, 2
    if "internvl" in path:  # a tiles family: each tile is an item (the tower's batch), distinct tiles are encoded
        tiles = torch.cat([mm["pixel_values"] for mm in batch.multi_modal_inputs if mm])
        items, encoded = len(tiles), len({t.numpy().tobytes() for t in tiles})
        assert encoded <= items // 3
    assert (shared[1]["actor/vision_items"], shared[1]["actor/vision_items_encoded"]) == (items, encoded)
    assert (per_row[1]["actor/vision_items"], per_row[1]["actor/vision_items_encoded"]) == (items, items)
    # the tower's model FLOPs of what the rows carried and of what was encoded (one image per prompt)
    from transformers import AutoConfig

    from vlmrl.models.flops import model_flops

    flops = model_flops(AutoConfig.from_pretrained(path))
    if flops is None:  # a family without a FLOPs formula (Qwen3.5): counts only
        assert "actor/vision_tflops" not in shared[1]
        return
    grids = {batch.uids[i]: m["image_grid_thw"].tolist() for i, m in enumerate(batch.multi_modal_inputs)
             if "image_grid_thw" in m}
    per_prompt = [flops.vision_flops(g) / 1e12 for g in grids.values()]
    assert shared[1]["actor/vision_tflops"] == pytest.approx(3 * sum(per_prompt), rel=1e-9)
    assert shared[1]["actor/vision_tflops_encoded"] == pytest.approx(sum(per_prompt), rel=1e-9)
    assert per_row[1]["actor/vision_tflops_encoded"] == pytest.approx(per_row[1]["actor/vision_tflops"], rel=1e-12)


@pytest.mark.parametrize("overrides", [dict(padding_free=True, logprob_chunk_size=2),
                                       dict(micro_batch_tokens=200, padding_free=True)], ids=["packed", "budget"])
def test_packed_and_budgeted_micro_batches_share_what_they_hold(tiny_qwen3_vl_path, synthetic_rows, overrides):
    """Packed (Qwen3-VL: deepstack features scattered into the pack) and token-budget micro-batches: the rows of a
    group that land together share; the update equals the per-row one either way."""
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    batch = make_batch(load_processor(tiny_qwen3_vl_path, DataConfig(max_prompt_length=64)), synthetic_rows[:3], n=3,
                       text_only_rows=(1,), seed=3)
    shared = _update(tiny_qwen3_vl_path, batch, share=True, ppo_micro_batch_size_per_gpu=9, **overrides)
    per_row = _update(tiny_qwen3_vl_path, batch, share=False, ppo_micro_batch_size_per_gpu=9, **overrides)
    _assert_same(shared, per_row, str(overrides))
    assert shared[1]["actor/vision_items_encoded"] < shared[1]["actor/vision_items"] == 6.0


def test_lora_on_the_tower_trains_the_same_adapters(tiny_model_path, synthetic_rows, processor):
    from vlmrl.actor.config import LoraConfig

    batch = make_batch(processor, synthetic_rows[:3], n=3, text_only_rows=(1,), seed=3)
    lora = LoraConfig(rank=4, alpha=8, vision="tower+merger")
    shared = _update(tiny_model_path, batch, share=True, ppo_micro_batch_size_per_gpu=9, lora=copy.deepcopy(lora))
    per_row = _update(tiny_model_path, batch, share=False, ppo_micro_batch_size_per_gpu=9, lora=copy.deepcopy(lora))
    _assert_same(shared, per_row, "lora")
    assert any("visual.blocks" in name and "lora_" in name for name in shared[2])


def test_only_identical_images_are_shared(tiny_model_path, processor):
    """Rows of one group whose images differ (an agent turn that added one, or another image of the same size) share
    only the identical ones: the distinct set is decided by grid and pixels, exactly."""
    from tests.processors.helpers import image_row, noise_image

    a, b = noise_image(112, 84, seed=1), noise_image(112, 84, seed=2)  # the same size: the same grid
    requests = [processor.build_request(image_row("<image>?", [image])) for image in (a, b)]
    inputs = [processor.multi_modal_inputs(r) for r in requests]
    pixels = [inputs[0]["pixel_values"], inputs[1]["pixel_values"], inputs[0]["pixel_values"]]
    grids = torch.cat([inputs[0]["image_grid_thw"], inputs[1]["image_grid_thw"], inputs[0]["image_grid_thw"]])
    assert distinct(pixels, grids) == ([0, 1], [0, 1, 0])
    nudged = pixels[2].clone()
    nudged[0, 0] += 1e-6
    assert distinct([pixels[0], nudged], grids[:2].clone()) == ([0, 1], [0, 1])

    actor = Actor(actor_config(tiny_model_path), total_steps=1, mini_batch_samples=2)
    model = actor.model.eval()
    counts = VisionCounts()
    owner = model.model
    with torch.no_grad(), shared_vision(model, counts):
        out = owner.get_image_features(torch.cat(pixels), grids)
    reference = owner.get_image_features(torch.cat(pixels), grids)  # outside the block: the class's method again
    assert counts.take() == {"actor/vision_items": 3.0, "actor/vision_items_encoded": 2.0}
    assert [tuple(t.shape) for t in out.pooler_output] == [tuple(t.shape) for t in reference.pooler_output]
    for ours, theirs in zip(out.pooler_output, reference.pooler_output):
        assert torch.allclose(ours, theirs, atol=1e-6)
    assert torch.equal(out.pooler_output[0], out.pooler_output[2]) and "get_image_features" not in vars(owner)


def test_the_towers_owner_is_found_once_per_model_and_through_lora(tiny_model_path, processor):
    """Every micro-batch's forward enters `shared_vision`; the module whose `get_image_features` it wraps is found by a
    walk over the model's modules once per model, not on every entry. A LoRA-wrapped model (PEFT, adapters on the
    tower) is a model of its own: found once too, the same module inside, and its encodings are still shared."""
    from tests.processors.helpers import image_row, noise_image
    from vlmrl.actor.config import LoraConfig
    from vlmrl.actor.lora import apply_lora
    from vlmrl.actor.vision_share import encoder_owner

    def walks_of(model) -> list[int]:
        walks: list[int] = []
        model.modules = lambda: walks.append(1) or torch.nn.Module.modules(model)  # counts each walk
        return walks

    model = Actor(actor_config(tiny_model_path), total_steps=1, mini_batch_samples=2).model.eval()
    walks = walks_of(model)
    for _ in range(3):
        with shared_vision(model):
            pass
    assert len(walks) == 1 and encoder_owner(model) is model.model
    wrapped = apply_lora(model, LoraConfig(rank=4, alpha=8, vision="tower+merger"))
    walks = walks_of(wrapped)
    inputs = processor.multi_modal_inputs(processor.build_request(image_row("<image>?", [noise_image(112, 84, 1)])))
    counts = VisionCounts()
    for _ in range(3):
        with torch.no_grad(), shared_vision(wrapped, counts):
            encoder_owner(wrapped).get_image_features(torch.cat([inputs["pixel_values"]] * 2),
                                                      torch.cat([inputs["image_grid_thw"]] * 2))
    assert len(walks) == 1 and encoder_owner(wrapped) is model.model
    assert any("lora_" in name for name, _ in model.model.visual.named_parameters())
    assert counts.take() == {"actor/vision_items": 6.0, "actor/vision_items_encoded": 3.0}


def test_videos_and_images_of_a_group_are_shared_on_qwen3_vl(tiny_qwen3_vl_path):
    """Qwen3-VL video rows (timestamps in the text; the tower encodes a video through get_image_features, one grid row
    per temporal patch), one prompt holding an image and a video, one text-only: with n = 3 every video and image
    is encoded once per prompt, and the update equals the per-row one."""
    from tests.processors.helpers import noise_image
    from vlmrl.data.config import DataConfig
    from vlmrl.data.synthetic import generate_rows
    from vlmrl.processors.loading import load_processor

    processor = load_processor(tiny_qwen3_vl_path, DataConfig(max_prompt_length=256))
    rows = generate_rows("last_colour", 2, seed=5, split="train")
    rows[1] = dict(rows[1], prompt=[{"role": "user", "content": "<image>then <video>: the colour at the end?"}],
                   images=[noise_image(64, 96, 2)])
    rows.append({"prompt": [{"role": "user", "content": "Name a colour."}]})
    batch = make_batch(processor, rows, n=3, prompt_length=256)
    shared = _update(tiny_qwen3_vl_path, batch, share=True, ppo_micro_batch_size_per_gpu=9)
    per_row = _update(tiny_qwen3_vl_path, batch, share=False, ppo_micro_batch_size_per_gpu=9)
    _assert_same(shared, per_row, "qwen3-vl video")
    items, encoded = shared[1]["actor/vision_items"], shared[1]["actor/vision_items_encoded"]
    assert per_row[1]["actor/vision_items"] == items and per_row[1]["actor/vision_items_encoded"] == items
    assert encoded * 3 == items, (items, encoded)  # every item of a prompt, once for its 3 samples


def test_packed_budgets_keep_a_prompts_samples_together(tiny_model_path, processor, synthetic_rows):
    """With packing and a token budget, a prompt's samples that fit one pack are planned into it (so its image is
    encoded once), where the plan without sharing balances rows across packs; padded plans are left as they are."""
    batch = make_batch(processor, synthetic_rows[:4], n=3, seed=3)
    budget = 3 * max(int(n) for n in batch.attention_mask.sum(dim=1)) + 10
    plans = {}
    for share in (False, True):
        actor = Actor(actor_config(tiny_model_path, share_vision=share, padding_free=True, micro_batch_tokens=budget),
                      total_steps=1, mini_batch_samples=len(batch))
        plans[share] = actor.micro_batches(batch, range(len(batch)))
    for micro in plans[True]:
        assert all(batch.uids[i] == batch.uids[micro[0]] for i in micro) or len(
            {batch.uids[i] for i in micro}) * 3 == len(micro), micro  # whole groups only
    groups = {uid: {i for i in range(len(batch)) if batch.uids[i] == uid} for uid in set(batch.uids)}
    assert all(any(rows <= set(micro) for micro in plans[True]) for rows in groups.values())
    split = sum(1 for rows in groups.values() if not any(rows <= set(micro) for micro in plans[False]))
    assert split > 0, "the rows' own balance split no group: nothing was shown"
