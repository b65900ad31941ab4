"""Every family sizes an image as transformers' own processor of the model does: for elongated, extreme and ordinary
sizes, the request's image has the size, grid, token count and pixels that processor gives the original image, and
the expanded ids equal the processor's; an image is refused (by row and file) only where that processor refuses it,
or where it would resize its own output again (then the engines, which get the resized image, would count other
tokens than the trainer). The reference is transformers alone: nothing here asks vlmrl's sizing rule.

qwen-vl-utils' rule, used before, rounded the short side of a sliver to 0 ("height and width must be > 0") where
transformers keeps one factor: a 69x1114 image was refused on every patch family."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.processors.helpers import image_row, noise_image
from vlmrl.data.config import DataConfig
from vlmrl.processors.errors import BadRowError
from vlmrl.processors.loading import load_processor

ROW = 42

NAMED = [(69, 1114), (1114, 69), (28, 2000), (2000, 28), (1, 500), (500, 1), (3000, 30), (30, 3000), (71, 1),
         (1, 71), (5, 2000), (2000, 5), (20, 70), (27, 100), (100, 27), (31, 31), (100, 100), (333, 201), (201, 333),
         (1000, 1000), (640, 480)]
"""(width, height): the slivers of the issue, aspect ratios past 200, sides under one factor, ordinary photos."""


def _hidden_sizes(count: int = 24) -> list[tuple[int, int]]:
    """Seeded elongated sizes no one chose: a short side of 1..120 pixels, an aspect ratio of 1..260, either way."""
    rng = np.random.default_rng(53)
    sizes = []
    for _ in range(count):
        short = int(rng.integers(1, 121))
        long = min(int(short * rng.uniform(1.0, 260.0)), 4000)
        sizes.append((short, long) if rng.integers(2) else (long, short))
    return sizes


SIZES = NAMED + _hidden_sizes()

PATCH_FAMILIES = ("tiny", "tiny-qwen3-vl", "tiny-qwen3.5", "tiny-glm4v")
"""The embedded Qwen2.5-VL, Qwen3-VL, Qwen3.5 and GLM-4.1V: images resized to a multiple of patch x merge."""


def _path(name: str) -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built(name))


def _image_size(hf, image) -> tuple[int, int] | str:
    """(height, width) the model's image processor resizes `image` to, read from its grid; its error where it refuses
    the image."""
    try:
        grid = hf.image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    except ValueError as err:
        return str(err)
    patch = hf.image_processor.patch_size
    return grid[1] * patch, grid[2] * patch


def _compare(processor, hf, pil, sizes, engines=None) -> list[str]:
    """For each (width, height): what differs between vlmrl's request and the model's processor `hf`, as messages
    naming both sides (an empty list: every size agrees). `engines`: the processor the engines run on the resized
    image (the model's own bounds; default `hf`)."""
    engines = engines or hf
    differences = []
    for width, height in sizes:
        image = noise_image(width, height, seed=width * 7919 + height)
        row = image_row("<image>What is it?", [image])
        expected = _image_size(hf, image)
        if isinstance(expected, tuple):  # what the engines' processor makes of transformers' own resized image
            again = _image_size(engines, noise_image(expected[1], expected[0]))
            kept = again == expected
        try:
            request = processor.build_request(row, index=ROW)
        except BadRowError as err:
            prefix = f"row {ROW}: image 0: cannot resize PIL image ({width}x{height}): "
            if isinstance(expected, str):
                if str(err) != prefix + expected:
                    differences.append(f"{width}x{height}: transformers refuses it ({expected}); vlmrl: {err}")
            elif kept:
                differences.append(f"{width}x{height}: transformers resizes it to {expected[1]}x{expected[0]}; "
                                   f"vlmrl refuses it: {err}")
            elif not re.fullmatch(rf"row {ROW}: image 0: PIL image \({width}x{height}\) resizes to "
                                  rf"{expected[1]}x{expected[0]} .* but the engines' image processor resizes it again "
                                  rf"to {again[1]}x{again[0]}: .*", str(err)):
                differences.append(f"{width}x{height}: transformers resizes it to {expected[1]}x{expected[0]}, and "
                                   f"that again to {again[1]}x{again[0]}; vlmrl's refusal says otherwise: {err}")
            continue
        if isinstance(expected, str) or not kept:
            theirs = expected if isinstance(expected, str) else "resizes its own output again"
            differences.append(f"{width}x{height}: transformers {theirs}; vlmrl took it as {request.images[0].size}")
            continue
        (resized,) = request.images
        inputs = processor.prompt_inputs(request)
        text = hf.apply_chat_template(processor.prompt_messages(row), add_generation_prompt=True, tokenize=False)
        theirs = hf(text=[text], images=[image], return_tensors="pt")
        theirs_pixels = pil(images=[image], return_tensors="pt")["pixel_values"]
        ours_pixels = inputs.multi_modal_inputs["pixel_values"]
        if (resized.height, resized.width) != expected:
            differences.append(f"{width}x{height}: transformers resizes it to {expected[1]}x{expected[0]}, vlmrl to "
                               f"{resized.width}x{resized.height}")
        elif not torch.equal(inputs.multi_modal_inputs["image_grid_thw"], theirs["image_grid_thw"]):
            differences.append(f"{width}x{height}: grid transformers {theirs['image_grid_thw'].tolist()}, vlmrl "
                               f"{inputs.multi_modal_inputs['image_grid_thw'].tolist()}")
        elif inputs.input_ids.tolist() != theirs["input_ids"][0].tolist():
            differences.append(f"{width}x{height}: expanded ids differ: transformers {theirs['input_ids'].shape[1]} "
                               f"tokens, vlmrl {len(inputs.input_ids)}")
        elif len(inputs.input_ids) != len(request.prompt_ids) - 1 + processor.image_token_count(resized):
            differences.append(f"{width}x{height}: the request's token count {processor.image_token_count(resized)} "
                               "is not its expansion's")
        elif ours_pixels.shape != theirs_pixels.shape:
            differences.append(f"{width}x{height}: pixel values of shape {tuple(ours_pixels.shape)}, transformers' "
                               f"PIL backend's {tuple(theirs_pixels.shape)}")
        elif not torch.allclose(ours_pixels, theirs_pixels, atol=1e-3, rtol=0):  # the same 8-bit pixels normalised
            # in another order differ by float rounding (~1e-7); one level of one pixel by 1/255/std > 0.01
            differences.append(f"{width}x{height}: pixel values differ from transformers' PIL backend's by up to "
                               f"{(ours_pixels - theirs_pixels).abs().max().item():.4f}")
    return differences


def _references(path: str, **size):
    """transformers' processor of the model (its default backend: what the engines run) and its PIL-backend image
    processor (what resizes with PIL's bicubic, as vlmrl does: the pixel reference), with `size` bounds if given."""
    from transformers import AutoImageProcessor, AutoProcessor

    return (AutoProcessor.from_pretrained(path, **({"size": size} if size else {})),
            AutoImageProcessor.from_pretrained(path, backend="pil", **({"size": size} if size else {})))


@pytest.mark.parametrize("name", PATCH_FAMILIES)
def test_every_size_is_what_the_models_own_processor_makes_of_it(name):
    path = _path(name)
    processor = load_processor(path, DataConfig(max_prompt_length=4096))
    hf, pil = _references(path)
    differences = _compare(processor, hf, pil, SIZES)
    assert not differences, f"{name}: {len(differences)} of {len(SIZES)} sizes differ:\n" + "\n".join(differences)


def test_the_issues_sliver_gets_the_grid_transformers_gives_it():
    """A 69x1114 image on the embedded GLM-4.1V: Glm4vProcessor's grid (1, 32, 2), 16 image tokens (qwen-vl-utils'
    rule made it 0 pixels wide)."""
    processor = load_processor(_path("tiny-glm4v"))
    request = processor.build_request(image_row("<image>What is it?", [noise_image(69, 1114)]), index=ROW)
    assert request.images[0].size == (28, 448)
    assert processor.image_grid_thw(request.images).tolist() == [[1, 32, 2]]
    assert processor.image_token_count(request.images[0]) == 16


def _video_size(hf, frames: list) -> tuple[int, int] | str:
    """(height, width) the model's video processor resizes these frames to (the frames given as sampled, channels
    last: transformers guesses a 1-pixel side as a channel axis otherwise); its error where it refuses them."""
    video = np.stack([np.asarray(f) for f in frames])
    try:
        grid = hf.video_processor(videos=[video], do_sample_frames=False, input_data_format="channels_last",
                                  return_tensors="pt")["video_grid_thw"][0].tolist()
    except ValueError as err:
        return str(err)
    patch = hf.video_processor.patch_size
    return grid[1] * patch, grid[2] * patch


@pytest.mark.parametrize("name", ("tiny", "tiny-qwen3-vl", "tiny-qwen3.5"))
def test_video_frames_are_sized_as_the_models_video_processor_does(name):
    """A video's frames (4 here, within every pixel budget) get the size the model's video processor gives them
    (Qwen2.5-VL: per frame; Qwen3-VL and Qwen3.5: the frames together, a side under one factor scaled up first), or
    are refused by row where it refuses them or would resize its own output again."""
    from transformers import AutoProcessor

    path = _path(name)
    processor = load_processor(path, DataConfig(max_prompt_length=8192))
    hf = AutoProcessor.from_pretrained(path)
    differences = []
    for width, height in SIZES:
        frames = [noise_image(width, height, seed=i) for i in range(4)]
        expected = _video_size(hf, frames)
        kept = isinstance(expected, tuple) and _video_size(hf, [noise_image(expected[1], expected[0])] * 4) == expected
        row = {"prompt": [{"role": "user", "content": "<video>What happens?"}], "videos": [frames]}
        try:
            (video,) = processor.build_request(row, index=ROW).videos
        except BadRowError as err:
            if kept or (isinstance(expected, str) and not str(err).endswith(expected)):
                differences.append(f"{width}x{height}: transformers {expected}; vlmrl refuses: {err}")
            elif not str(err).startswith(f"row {ROW}: video 0: "):
                differences.append(f"{width}x{height}: the refusal does not name the row and video: {err}")
            continue
        if not kept or video.frames.shape[1:3] != expected:
            differences.append(f"{width}x{height}: transformers {expected} (kept: {kept}); vlmrl "
                               f"{video.frames.shape[1:3]}")
    assert not differences, f"{name}: {len(differences)} of {len(SIZES)} sizes differ:\n" + "\n".join(differences)


def _with_bounds(name: str, folder: Path, longest_edge: int) -> str:
    """A copy of an embedded model whose image processor bounds go up to `longest_edge` pixels (a released model's,
    e.g. Qwen2.5-VL's 12845056), its weights linked."""
    import json

    source = Path(_path(name))
    folder.mkdir()
    for file in source.iterdir():
        (folder / file.name).symlink_to(file) if file.suffix == ".safetensors" else shutil.copy(file, folder)
    config = json.loads((folder / "processor_config.json").read_text())
    config["image_processor"]["size"]["longest_edge"] = longest_edge
    (folder / "processor_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("name", PATCH_FAMILIES)
def test_with_a_released_models_bounds_only_what_transformers_refuses_is_refused(name, tmp_path):
    """The refusals above for slivers the processor resizes again come from the embedded models' tiny bounds (16
    image tokens): the clamped short side puts such a sliver over max_pixels. With a released model's bounds and a
    run's smaller data.max_pixels, vlmrl sizes within data.max_pixels exactly as transformers' processor given those
    bounds does, the engines' processor (the model's bounds) keeps every result, and nothing is refused but an
    aspect ratio over 200."""
    copies = 2 if name == "tiny-glm4v" else 1  # GLM-4.1V's bounds count an image's 2 temporal copies
    path = _with_bounds(name, tmp_path / "model", 12845056 * copies)
    low, high = (3136, 12544) if name in ("tiny", "tiny-glm4v") else (4096, 16384)
    processor = load_processor(path, DataConfig(min_pixels=low, max_pixels=high, max_prompt_length=4096))
    hf, pil = _references(path, shortest_edge=low * copies, longest_edge=high * copies)
    differences = _compare(processor, hf, pil, SIZES, engines=_references(path)[0])
    assert not differences, f"{name}: {len(differences)} of {len(SIZES)} sizes differ:\n" + "\n".join(differences)
    refused = []
    for width, height in SIZES:
        try:
            processor.build_request(image_row("<image>?", [noise_image(width, height)]), index=ROW)
        except BadRowError as err:
            refused.append(str(err))
    assert refused and all("aspect ratio must be smaller than 200" in reason for reason in refused), refused


def test_internvl_takes_every_size_as_its_processor_does():
    """InternVL tiles an image without resizing it: vlmrl passes every size on as it came, and the tiles, the
    expanded ids and the pixels equal InternVLProcessor's, slivers and 1-pixel sides included."""
    from transformers import AutoProcessor

    path = _path("tiny-internvl")
    processor = load_processor(path, DataConfig(max_prompt_length=4096))
    hf = AutoProcessor.from_pretrained(path)
    for width, height in SIZES:
        image = noise_image(width, height, seed=width + height)
        row = image_row("<image>What is it?", [image])
        request = processor.build_request(row, index=ROW)
        assert request.images[0].size == (width, height)
        inputs = processor.prompt_inputs(request)
        text = hf.apply_chat_template(processor.prompt_messages(row), add_generation_prompt=True, tokenize=False)
        theirs = hf(text=text, images=[image], return_tensors="pt")
        assert inputs.input_ids.tolist() == theirs["input_ids"][0].tolist(), (width, height)
        assert torch.equal(inputs.multi_modal_inputs["pixel_values"], theirs["pixel_values"]), (width, height)
        assert len(inputs.input_ids) == len(request.prompt_ids) - 1 + processor.image_token_count(image)
