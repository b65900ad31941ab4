"""The processor on the embedded InternVL3.5 (`tiny-internvl`): a tiles family. Its requests (one `<IMG_CONTEXT>` per
image, the images as they came) and trainer inputs (expanded ids, tiles) agree with what transformers'
InternVLProcessor makes of the same chat on every tile layout; its 1-D positions reach the forward as one row."""

from __future__ import annotations

import pytest
import torch

from tests.processors.helpers import image_row, noise_image
from vlmrl.data.config import DataConfig
from vlmrl.processors.loading import load_processor

# (width, height): 1 tile (square), 2 + thumbnail, 3 + thumbnail, 4 + thumbnail (wide and tall), tiny, large
SIZES = [(64, 64), (96, 64), (200, 70), (300, 40), (40, 260), (9, 13), (1000, 700)]


@pytest.fixture(scope="module")
def path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-internvl"))


@pytest.fixture(scope="module")
def processor(path):
    return load_processor(path)


@pytest.fixture(scope="module")
def hf_processor(path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


@pytest.mark.parametrize("sizes", [*([s] for s in SIZES), [SIZES[6], SIZES[5], SIZES[2]]], ids=str)
def test_every_tile_layout_equals_transformers_processor(processor, hf_processor, sizes):
    """Each tile layout (1 tile, 2 to 4 tiles and a thumbnail, wide and tall, tiny and large images, and three of
    them in one prompt): the request keeps one placeholder per image and the image unresized; its expansion
    (`<img>` + 16 x tiles `<IMG_CONTEXT>` + `</img>`) and the tiles equal InternVLProcessor's on the chat text, and
    the token count the processor predicts (what max_prompt_length and max_model_len are checked with) is the
    expanded length. Text, one and two images, and the positions, are the family matrix's
    (tests/families/test_family_matrix.py)."""
    images = [noise_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    row = image_row("<image>" * len(images) + "What is shown?", images)
    request = processor.build_request(row)
    assert request.prompt_ids.count(processor.image_token_id) == len(images)
    assert [im.size for im in request.images] == [im.size for im in images]  # tiles, not a resize
    inputs = processor.prompt_inputs(request)
    text = hf_processor.apply_chat_template(processor.prompt_messages(row), add_generation_prompt=True,
                                            tokenize=False)
    expected = hf_processor(text=text, images=images or None, return_tensors="pt")
    assert inputs.input_ids.tolist() == expected["input_ids"][0].tolist()
    expanded = len(request.prompt_ids) - len(images) + sum(processor.image_token_count(im) for im in images)
    assert expanded == len(inputs.input_ids)
    assert torch.equal(inputs.multi_modal_inputs["pixel_values"], expected["pixel_values"])
    tiles = inputs.multi_modal_inputs["image_grid_thw"]
    assert tiles[:, 1:].eq(1).all() and int(tiles[:, 0].sum()) == expected["pixel_values"].shape[0]


def test_the_forward_gets_one_row_of_positions_and_no_grid(processor):
    """A tiles family's forward takes (B, L) positions (the first of vlmrl's three equal rows) and pixel values
    whose rows are whole tiles, without the grid vlmrl keeps per image."""
    inputs = processor.prompt_inputs(processor.build_request(image_row("<image>?", [noise_image(200, 70, seed=1)])))
    ids = inputs.input_ids[None]
    kwargs = processor.family.inputs.forward_inputs(dict(input_ids=ids, position_ids=inputs.position_ids[:, None],
                                                         **inputs.multi_modal_inputs))
    assert set(kwargs) == {"input_ids", "position_ids", "pixel_values"}
    assert torch.equal(kwargs["position_ids"], inputs.position_ids[0][None])


def test_pixel_bounds_do_not_apply_and_videos_are_refused(path, processor):
    with pytest.raises(ValueError, match="min_pixels / data.max_pixels do not apply to InternVL3.5"):
        load_processor(path, DataConfig(max_pixels=64 * 64))
    assert processor.image_factor == 1  # any size: the engines get the image itself
    from vlmrl.processors.errors import BadRowError

    with pytest.raises(BadRowError, match="video 0: vlmrl takes no video for InternVL3.5"):
        processor.build_request({"prompt": [{"role": "user", "content": "<video>What happens?"}],
                                 "videos": [{"path": "clip.mp4"}]})


def test_no_engine_problem_and_sglang_takes_text(path):
    """Neither engine needs a setting for this config; SGLang takes the family's prompts as text
    (tests/rollout/internvl/test_sglang.py)."""
    from vlmrl.models.families import INTERNVL, read_model_config

    assert INTERNVL.engine_problems(read_model_config(path)) == [] and not INTERNVL.engines.sglang_prompt_ids
