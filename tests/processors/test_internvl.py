"""The processor on the embedded InternVL3.5 (`tiny-internvl`): a tiles family. Its requests (one `<IMG_CONTEXT>` per
image, the images as they came) and trainer inputs (expanded ids, tiles, 1-D positions) agree with what transformers'
InternVLProcessor and InternVLForConditionalGeneration make of the same chat."""

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


@pytest.mark.parametrize("sizes", [[], [SIZES[0]], *([s] for s in SIZES[1:]), [SIZES[1], SIZES[4]],
                                   [SIZES[6], SIZES[5], SIZES[2]]], ids=str)
def test_requests_and_trainer_inputs_equal_transformers_processor(processor, hf_processor, sizes):
    """The request keeps one placeholder per image and the image unresized; its expansion (`<img>` + 16 x tiles
    `<IMG_CONTEXT>` + `</img>`) and the tiles equal InternVLProcessor's on the chat text, and the token count the
    processor predicts (what max_prompt_length and max_model_len are checked with) is the expanded length."""
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
    if images:
        assert torch.equal(inputs.multi_modal_inputs["pixel_values"], expected["pixel_values"])
        tiles = inputs.multi_modal_inputs["image_grid_thw"]
        assert tiles[:, 1:].eq(1).all() and int(tiles[:, 0].sum()) == expected["pixel_values"].shape[0]
    else:
        assert inputs.multi_modal_inputs == {}
    # 1-D positions in three equal rows: 0 .. L-1
    assert torch.equal(inputs.position_ids, torch.arange(len(inputs.input_ids)).expand(3, -1))


def test_1d_positions_give_transformers_own_logits(path, processor):
    """The forward gets the first of the three position rows ((B, L)), and its logits equal the model's without
    any position ids (transformers counts 0 .. L-1 itself), image tokens and tiles included; on a left-padded
    batch the positions start at each row's first token."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    images = [noise_image(200, 70, seed=1), noise_image(64, 64, seed=2)]
    inputs = processor.prompt_inputs(processor.build_request(image_row("<image> and <image>?", images)))
    mm = inputs.multi_modal_inputs
    ids = inputs.input_ids[None]
    kwargs = processor.family.inputs.forward_inputs(dict(input_ids=ids, position_ids=inputs.position_ids[:, None],
                                                  pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"]))
    assert set(kwargs) == {"input_ids", "position_ids", "pixel_values"} and kwargs["position_ids"].shape == ids.shape
    with torch.no_grad():
        ours = model(**kwargs).logits
        theirs = model(input_ids=ids, pixel_values=mm["pixel_values"]).logits
    assert torch.equal(ours, theirs)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = processor.position_ids(torch.ones(2, 5, dtype=torch.long), mask, None)
    assert positions.shape == (3, 2, 5) and positions[0].tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


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
