"""The family contract outside the engines: every model family in `MATRIX`, on its embedded model (the first of its
`tiny_variants`), held to the same checks:

- processor: its requests (text, one image, two images of different sizes; an image and a video where vlmrl takes
  video for the family) give the expanded ids, pixel values and grids that transformers' own processor gives for the
  same messages and images, and the position ids transformers computes (the model's `get_rope_index`; a 1-D family:
  the positions transformers' generation counts), alone and left-padded into one batch;
- packing: the padding-free (packed) logprobs and entropies are the padded ones, within float32 rounding;
- LoRA: a LoRA policy's merged weights are PEFT's merge, and give the logprobs of the unmerged PEFT model;
- MFU: the family's FLOP rule equals torch's FlopCounterMode on a forward and backward.

What differs between families is asked of the family (its video timing, its experts, its position ids), never of
its name. A family's own quirks stay beside its processor or actor tests (GLM-4.1V's two temporal copies in its pixel
bounds, InternVL's tile layouts, Qwen3-VL's timestamps, Qwen3.5's row boundaries in its linear attention...), its
engine contract in tests/rollout/test_family_contract.py.

A new family: an entry in `vlmrl.models.families.FAMILIES`, its tiny builder, and one line here.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

from tests.processors.helpers import first_difference, noise_image
from vlmrl.alignment.precision import FP32_THRESHOLDS
from vlmrl.models.families import FAMILIES, ModelFamily
from vlmrl.models.flops import ModelFlops, model_flops

MATRIX = (
    "Qwen2.5-VL",
    "Qwen3-VL",
    "Qwen3.5",
    "Qwen3-VL-MoE",
    "Qwen3.5-MoE",
    "GLM-4.1V",
    "InternVL3.5",
)
"""The families held to every check below, by `ModelFamily.name`."""

FLOAT32_ROUNDING = 1e-5
"""Nats: two layouts of the same float32 computation (packed or padded rows) differ by its rounding only, as the
actor's micro-batch invariances are held to (correct float32 engines agree to ~1e-5 nats a token)."""
FLOAT32_DRIFT = FP32_THRESHOLDS["drift_tolerance"]
"""Nats: what the compare tool calls drift between two float32 sides. A merged LoRA layer computes (W + s B A) x
where PEFT computes W x + s B (A x): the same function, other arithmetic."""

IMAGES = {"text": [], "one image": [(300, 100)], "two images": [(300, 100), (64, 96)]}
"""Image sizes (width, height) of each request: the two of a row resize (or tile) to different grids in every
family."""

BY_NAME = {family.name: family for family in FAMILIES}


def test_every_family_is_in_the_matrix():
    """A family in FAMILIES without its line here would be held to none of these checks (and a line without its
    family to nothing)."""
    missing = [name for name in BY_NAME if name not in MATRIX]
    assert not missing, f"families without a line in MATRIX: {missing}"
    assert set(MATRIX) <= set(BY_NAME), f"lines of no family in FAMILIES: {sorted(set(MATRIX) - set(BY_NAME))}"
    assert all(family.tiny_variants for family in FAMILIES), "a family without an embedded model to test"


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=MATRIX)
def family(request) -> ModelFamily:
    """Each family of the matrix in turn; every fixture below is that family's, built once."""
    return BY_NAME[request.param]


@pytest.fixture(scope="module")
def model_path(family) -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built(family.tiny_variants[0]))


@pytest.fixture(scope="module")
def family_processor(model_path):
    """vlmrl's processor of the family, prompts up to 2048 tokens (a video's expansion fits)."""
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    return load_processor(model_path, DataConfig(max_prompt_length=2048))


@pytest.fixture(scope="module")
def hf_processor(model_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_path)


@pytest.fixture(scope="module")
def hf_model(model_path):
    """The family's transformers model in float32 (its own position ids; the base of the LoRA check)."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32).eval()


# ---------------------------------------------------------------------------------------------------- processor


def _row(images: list, video: bytes | None = None) -> dict:
    """A row in content parts (what both processors are given): the images, the video, then the question."""
    content = [{"type": "image"}] * len(images) + ([{"type": "video"}] if video is not None else [])
    row = {"prompt": [{"role": "user", "content": [*content, {"type": "text", "text": "What is shown?"}]}],
           "images": images}
    if video is not None:
        row["videos"] = [{"bytes": video}]
    return row


@functools.cache
def _clip() -> bytes:
    """2 s of random frames at 10 fps, as an mp4 (encoded once: every video family decodes the same bytes)."""
    from vlmrl.processors.video import encode_mp4

    return encode_mp4(np.random.default_rng(3).integers(0, 256, size=(20, 112, 140, 3), dtype=np.uint8), 10.0)


def _video_row() -> dict:
    """An image, then the clip (sampled at data.video_fps = 2: 4 frames, 2 temporal patches)."""
    return _row([noise_image(90, 70, seed=3)], _clip())


def _image_rows() -> dict[str, dict]:
    return {name: _row([noise_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)])
            for name, sizes in IMAGES.items()}


@pytest.fixture(scope="module")
def sides(family, family_processor, hf_processor) -> dict[str, tuple]:
    """Request name -> `_both_sides` of the family's requests: those of `IMAGES`, and "image and video" where vlmrl
    takes the family's video."""
    rows = _image_rows() | ({"image and video": _video_row()} if family.inputs.video_timing is not None else {})
    return {name: _both_sides(family_processor, hf_processor, row) for name, row in rows.items()}


def _both_sides(processor, hf_processor, row: dict):
    """vlmrl's request and trainer inputs of a row, and what transformers' processor makes of the same messages and
    of the request's images and sampled frames (told not to sample again)."""
    request = processor.build_request(row, 0)
    ours = processor.prompt_inputs(request)
    text = hf_processor.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    kwargs = {"images": list(request.images)} if request.images else {}
    if request.videos:
        kwargs.update(videos=[v.frames for v in request.videos], videos_kwargs={
            "do_sample_frames": False, "video_metadata": [v.metadata() for v in request.videos]})
    theirs = hf_processor(text=[text], return_tensors="pt", **kwargs)
    return request, ours, theirs


def _transformers_positions(family: ModelFamily, hf_model, theirs: dict, ids: torch.Tensor,
                            mask: torch.Tensor | None) -> torch.Tensor:
    """(3, B, L) position ids transformers gives ids (B, L): the model's own `get_rope_index` fed as its processor
    feeds it (`theirs`: mm_token_type_ids and grids), or for a 1-D family the positions its generation counts over
    the attended tokens (its `_prepare_position_ids_for_generation`), in vlmrl's three equal rows."""
    if not family.inputs.mrope:
        kwargs = {"input_ids": ids} if mask is None else {"input_ids": ids, "attention_mask": mask}
        return hf_model._prepare_position_ids_for_generation(ids, kwargs).expand(3, *ids.shape)
    grids = {key: theirs[key] for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if key in theirs}
    positions, _ = hf_model.model.get_rope_index(ids, mm_token_type_ids=theirs["mm_token_type_ids"],
                                                 attention_mask=mask, **grids)
    return positions


def _assert_equal_sides(processor, request, ours, theirs) -> None:
    """The request holds one placeholder per image and per video (the form the engines take); its expansion is
    transformers' ids, at the length the processor predicts (what max_prompt_length is checked with); every
    pixel tensor and grid both sides give is equal."""
    assert request.prompt_ids.count(processor.image_token_id) == len(request.images)
    assert request.prompt_ids.count(processor.video_token_id) == len(request.videos)
    assert ours.input_ids.tolist() == theirs["input_ids"][0].tolist()
    predicted = (len(request.prompt_ids) - len(request.images) - len(request.videos)
                 + sum(processor.image_token_count(im) for im in request.images)
                 + sum(processor.video.token_count(v) for v in request.videos))
    assert predicted == len(ours.input_ids)
    mm = ours.multi_modal_inputs
    pixels = {"pixel_values"} if request.images else set()
    pixels |= {"pixel_values_videos"} if request.videos else set()
    assert pixels <= set(mm) & set(theirs.keys()), f"pixel values compared: {sorted(set(mm) & set(theirs.keys()))}"
    for key in sorted(set(mm) & set(theirs.keys())):
        assert torch.equal(mm[key], theirs[key]), f"{key}: vlmrl {mm[key].flatten()[:6]} vs transformers " \
                                                  f"{theirs[key].flatten()[:6]}"


@pytest.mark.parametrize("name", list(IMAGES))
def test_requests_equal_transformers_processor_and_positions(family, family_processor, hf_model, sides, name):
    request, ours, theirs = sides[name]
    _assert_equal_sides(family_processor, request, ours, theirs)
    grid = ours.multi_modal_inputs.get("image_grid_thw")
    if grid is not None and len(grid) > 1:  # the sizes really were different grids
        assert len({tuple(row) for row in grid.tolist()}) == len(grid), grid.tolist()
    expected = _transformers_positions(family, hf_model, theirs, theirs["input_ids"], None)[:, 0]
    assert torch.equal(ours.position_ids, expected), first_difference(expected[:, None], ours.position_ids[:, None])


@pytest.mark.parametrize("family", [name for name in MATRIX if name in BY_NAME
                                    and BY_NAME[name].inputs.video_timing is not None], indirect=True)
def test_a_video_request_equals_transformers_processor_and_positions(family, family_processor, hf_model, sides):
    request, ours, theirs = sides["image and video"]
    assert len(request.videos) == 1 and request.videos[0].num_frames == 4
    _assert_equal_sides(family_processor, request, ours, theirs)
    expected = _transformers_positions(family, hf_model, theirs, theirs["input_ids"], None)[:, 0]
    assert torch.equal(ours.position_ids, expected), first_difference(expected[:, None], ours.position_ids[:, None])


def test_left_padded_requests_give_transformers_positions(family, family_processor, hf_model, sides):
    """The family's requests (a video among them where it takes video) left-padded into one batch, two extra
    columns of padding: vlmrl's position ids of the batch are transformers' on every attended token."""
    sides = list(sides.values())
    length = max(len(ours.input_ids) for _, ours, _ in sides) + 2
    pad = family_processor.pad_token_id
    ids = torch.full((len(sides), length), pad, dtype=torch.long)
    mask, types = torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.int32)
    for i, (_, ours, theirs) in enumerate(sides):
        n = len(ours.input_ids)
        ids[i, -n:], mask[i, -n:] = ours.input_ids, 1
        if "mm_token_type_ids" in theirs:
            types[i, -n:] = theirs["mm_token_type_ids"][0]
    batched = {"mm_token_type_ids": types}
    for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts"):
        parts = [theirs[key] for _, _, theirs in sides if key in theirs]
        if parts:
            batched[key] = torch.cat([torch.as_tensor(part) for part in parts])
    expected = _transformers_positions(family, hf_model, batched, ids, mask)
    mm = [ours.multi_modal_inputs for _, ours, _ in sides]
    grids = {key: torch.cat([m[key] for m in mm if key in m]) if any(key in m for m in mm) else None
             for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
    actual = family_processor.position_ids(ids, mask, grids["image_grid_thw"], grids["video_grid_thw"],
                                           grids["second_per_grid_ts"])
    attended = mask.bool().expand(3, -1, -1)
    assert torch.equal(actual[attended], expected[attended]), first_difference(expected * attended, actual * attended)


# ---------------------------------------------------------------------------------------------------- packing


def test_packed_logprobs_equal_the_padded_pass(family, model_path, synthetic_rows):
    """Three image rows, a text-only row and two padding rows: the packed forward (rows laid end to end in one
    sequence, logprobs 2 positions at a time) gives the padded pass's logprobs and entropies. A pack is one (4, 1, T)
    sequence without a mask: transformers 5.19 builds its block-diagonal mask only from the text-position row 0,
    which restarts at each row (from an mrope family's (3, 1, T) ids alone it builds one causal mask), and vlmrl's
    linear-attention layers read their row boundaries there too. So a pack of an image row, the text-only row and
    another image row whose text positions count on through it (one causal sequence, one linear-attention state)
    gives other logprobs on the rows after the first."""
    from tests.actor.test_actor import actor_config
    from tests.batches import make_batch
    from vlmrl.actor.forward import forward_response, micro_batch
    from vlmrl.actor.local import Actor
    from vlmrl.batch.padding import upsample_to_multiple
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    processor = load_processor(model_path, DataConfig(max_prompt_length=64))
    plain = make_batch(processor, synthetic_rows[:4], n=1, text_only_rows=(2,), response_length=8)
    data = upsample_to_multiple(plain, 6, eos_token_id=processor.eos_token_ids[0], pad_token_id=processor.pad_token_id)
    assert data.is_padding.any()
    actor = Actor(actor_config(model_path, ppo_micro_batch_size_per_gpu=3), total_steps=1, mini_batch_samples=6)
    expected, expected_entropy = actor.compute_logprobs(data, with_entropy=True)
    assert (expected[data.response_mask > 0] != 0).all()
    actor.config.padding_free, actor.config.logprob_chunk_size = True, 2
    got, entropy = actor.compute_logprobs(data, with_entropy=True)
    assert (got - expected).abs().max() <= FLOAT32_ROUNDING, (got - expected).abs().max()
    assert (entropy - expected_entropy).abs().max() <= FLOAT32_ROUNDING, (entropy - expected_entropy).abs().max()

    rows = [0, 2, 3]  # an image row, the text-only row, an image row
    assert [bool(data.multi_modal_inputs[r]) for r in rows] == [True, False, True]
    mb = micro_batch(data, rows, actor.device, packed=True)
    assert mb.position_ids.shape[:2] == (4, 1) and mb.attention_mask is None
    mb.position_ids[0] = torch.arange(mb.input_ids.shape[1])
    with torch.no_grad():
        leaky, _ = forward_response(actor.model.eval(), mb, 1.0, False)
    width = mb.response_width
    gaps = (leaky * data.response_mask[rows, :width] - expected[rows, :width]).abs().amax(dim=1)
    assert gaps[0] <= FLOAT32_ROUNDING and (gaps[1:] > FLOAT32_DRIFT).all(), gaps.tolist()


# ---------------------------------------------------------------------------------------------------- LoRA


def test_lora_merged_weights_give_the_peft_models_logprobs(family, hf_model, sides):
    """Adapters on the language layers, the vision tower and its merger (and the routed experts of a MoE family),
    every lora_B drawn at random: vlmrl's merged tensors are PEFT's merge_and_unload exactly, and the plain model
    holding them gives the unmerged PEFT model's logprobs on the prompt with two images, within float32 drift, where
    the adapters moved them beyond it."""
    from vlmrl.actor.lora import apply_lora, lora_scaling, merged_tensors
    from vlmrl.config import LoraConfig

    lora = LoraConfig(rank=4, alpha=8, vision="tower+merger", experts=family.experts is not None)
    peft = apply_lora(copy.deepcopy(hf_model), lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:  # 0.1: adapters that move the policy by nats, as a trained one does
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    _, prompt, _ = sides["two images"]
    inputs = family.inputs.forward_inputs(dict(input_ids=prompt.input_ids[None],
                                               position_ids=prompt.position_ids[:, None],
                                               **prompt.multi_modal_inputs))
    with torch.no_grad():
        unmerged, base = (m(**inputs).logits.log_softmax(-1) for m in (peft, hf_model))

    ours = dict(merged_tensors(peft.state_dict().items(), lora_scaling(lora)))
    merged = peft.merge_and_unload()  # PEFT's merge, in place: the plain model
    theirs = merged.state_dict()
    assert ours.keys() == theirs.keys()
    differ = [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    assert not differ, f"merged != merge_and_unload for {differ[:3]}"
    merged.load_state_dict(ours, strict=True)  # vlmrl's tensors in it
    with torch.no_grad():
        folded = merged(**inputs).logits.log_softmax(-1)
    assert (folded - unmerged).abs().max() <= FLOAT32_DRIFT, (folded - unmerged).abs().max()
    assert (unmerged - base).abs().max() > FLOAT32_DRIFT, "the adapters did not move the policy: nothing compared"


# ---------------------------------------------------------------------------------------------------- MFU


def _counted(run) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


def _not_counted_by_torch(flops: ModelFlops, seqlens: list[int]) -> float:
    """What FlopCounterMode counts otherwise than it is computed (`LinearAttentionFlops`' docstring): it has no
    formula for the Gated DeltaNet's triangular solves, and counts the depthwise convolution's weight gradient as a
    dense convolution's (2 x channels^2 x kernel per output position, where 2 x channels x kernel are computed)."""
    linear = flops.linear
    if linear is None:
        return 0.0
    c, k = linear.conv_channels, linear.conv_kernel
    return sum(linear.solve_flops(s) - 2.0 * c * (c - 1) * k * linear.conv_outputs(s) * linear.layers
               for s in seqlens)


def test_model_flops_are_torchs_flop_counter_on_a_forward_and_backward(family):
    """Every family's FLOP rule, on its embedded model: torch's FlopCounterMode on the model's own forward and
    backward (eager attention and experts, so that every matmul is one it counts) over a row with an image, a short
    text-only row and one over 64 tokens (two chunks of Qwen3.5's linear attention) equals
    `ModelFlops.update_flops` exactly, but for declared differences: EasyR1's formula counts the embedding as a
    matmul (6 x V x h per token), the counter sees a lookup; and what the counter cannot see or miscounts of the
    Gated DeltaNet (`_not_counted_by_torch`). The tower alone on larger grids (Qwen2.5-VL's windows: 4 windows a
    frame; a video of two temporal patches on the Qwen3-VL towers, attending within each, their deepstack mergers in
    the loss) equals `vision_flops` exactly; InternVL's tiles too, with its class tokens and the projector outside
    the tower. A family without a rule (`ModelFamily.flop_rule`) fails here."""
    from transformers import AutoModelForImageTextToText

    from tests.processors.helpers import image_row, noise_image
    from vlmrl.data.config import DataConfig
    from vlmrl.models.tiny import ensure_built
    from vlmrl.processors.loading import load_processor

    variant = family.tiny_variants[0]
    path = str(ensure_built(variant))
    processor = load_processor(path, DataConfig(max_prompt_length=256))
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    if processor.family.experts is not None:
        model.set_experts_implementation("eager")  # the routed tokens only, as the formula counts
    flops = model_flops(model.config)
    assert flops is not None, f"{family.name} has no FLOP rule (ModelFamily.flop_rule): a run on it logs no MFU"
    text = model.config.text_config
    for images, words in (([noise_image(112, 112, seed=1)], 1), ([], 1), ([], 16)):
        request = processor.build_request(image_row("<image>" * len(images) + "Say what you see. " * words, images))
        prompt = processor.prompt_inputs(request)
        ids = prompt.input_ids[None]

        def step():
            inputs = processor.family.inputs.forward_inputs(dict(
                input_ids=ids, position_ids=prompt.position_ids[:, None], **prompt.multi_modal_inputs))
            model(**inputs).logits.sum().backward()

        grids = prompt.multi_modal_inputs["image_grid_thw"].tolist() if images else []
        embedding = 6 * text.vocab_size * text.hidden_size * ids.shape[1]
        expected = flops.update_flops([ids.shape[1]], grids) - embedding - _not_counted_by_torch(flops, [ids.shape[1]])
        assert _counted(step) == expected, (variant, len(images), ids.shape[1])
    if family.inputs.image_layout == "tiles":  # InternVL: 3 tiles through the tower and the projector after it
        tiles = torch.randn(3, 3, processor.tile, processor.tile)

        def encode_tiles():
            model.model.get_image_features(pixel_values=tiles).pooler_output.sum().backward()

        assert _counted(encode_tiles) == flops.vision_flops([[3, 1, 1]])
        return
    tower = model.model.visual
    patch = model.config.vision_config
    width = patch.in_channels * patch.temporal_patch_size * patch.patch_size ** 2
    # GLM-4.1V's tower takes a video's frames as one grid row each (its get_video_features flattens them)
    for grid in ([1, 16, 16], [1, 8, 12] if family.inputs.video_timing is None else [2, 8, 12]):
        pixels = torch.randn(grid[0] * grid[1] * grid[2], width)

        def encode():
            out = tower(pixels, grid_thw=torch.tensor([grid]))
            outputs = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]  # every merger's
            sum(o.sum() for o in outputs).backward()

        assert _counted(encode) == flops.vision_flops([grid]), (variant, grid)
