"""The processor on the embedded GLM-4.1V (`tiny-glm4v`): its family's facts (the `<|image|>` placeholder inside
`<|begin_of_image|>..<|end_of_image|>`, pixel bounds that count an image's two temporal copies, GLM's chat template
and stop tokens) come from the model and its family, and the requests and trainer inputs agree with what
transformers' Glm4vProcessor and Glm4vForConditionalGeneration make of the same chat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.processors.helpers import image_row, noise_image
from vlmrl.data.config import DataConfig
from vlmrl.processors.loading import load_processor


@pytest.fixture(scope="module")
def glm_path() -> str:
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built("tiny-glm4v"))


@pytest.fixture(scope="module")
def processor(glm_path):
    return load_processor(glm_path)


def test_the_bounds_count_an_images_two_temporal_copies(processor, glm_path):
    """The image processor's size bounds are for t x h x w with t = 2 copies of an image: an image's own h x w bounds
    are half of them, and a data.max_pixels above that half is refused (the engines would resize again)."""
    size = json.loads((Path(glm_path) / "processor_config.json").read_text())["image_processor"]["size"]
    assert (processor.min_pixels, processor.max_pixels) == (size["shortest_edge"] // 2, size["longest_edge"] // 2)
    assert processor.image_factor == 28
    request = processor.build_request(image_row("<image> <image>?", [noise_image(333, 201), noise_image(20, 70)]))
    for image in request.images:
        assert image.width % 28 == 0 and image.height % 28 == 0
        assert processor.min_pixels <= image.width * image.height <= processor.max_pixels
    with pytest.raises(ValueError, match=r"bounds \[3136, 12544\] \(preprocessor size shortest_edge/longest_edge / 2"):
        load_processor(glm_path, DataConfig(max_pixels=size["longest_edge"]))


def test_requests_give_the_ids_and_pixels_transformers_processor_gives(processor, glm_path):
    """One `<|image|>` per image in the request (what the engines expand); expanded ids, grid and pixel values
    equal Glm4vProcessor's on the already-resized images."""
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(glm_path)
    images = [noise_image(200, 120, seed=4), noise_image(64, 96, seed=5)]
    request = processor.build_request(image_row("<image> and <image>: compare.", images))
    assert request.prompt_ids.count(processor.image_token_id) == 2
    mm = processor.multi_modal_inputs(request)
    text = hf.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " and "},
                                                                {"type": "image"}, {"type": "text",
                                                                                    "text": ": compare."}]}],
                                  add_generation_prompt=True, tokenize=False)
    assert text.startswith("[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>")
    expected = hf(text=[text], images=list(request.images), return_tensors="pt")
    expanded = processor.expand_prompt_ids(request.prompt_ids, mm["image_grid_thw"])
    assert expanded == expected["input_ids"][0].tolist()
    assert torch.equal(mm["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(mm["pixel_values"], expected["pixel_values"])


def test_the_stop_and_banned_tokens_are_the_models(processor, glm_path):
    """GLM stops at <|endoftext|>, <|user|> and <|observation|> (its generation config); the image and video
    placeholders are never sampled."""
    config = json.loads((Path(glm_path) / "config.json").read_text())
    vocab = processor.tokenizer.convert_tokens_to_ids
    assert processor.image_token_id == config["image_token_id"] == vocab("<|image|>")
    assert set(processor.banned_token_ids) == {vocab("<|image|>"), vocab("<|video|>")}
    assert set(processor.eos_token_ids) == {vocab("<|endoftext|>"), vocab("<|user|>"), vocab("<|observation|>")}
    assert processor.pad_token_id == vocab("<|endoftext|>")


def test_explicit_position_ids_give_the_processor_paths_logits(processor, glm_path):
    """The trainer's forward (expanded ids, vlmrl's 3D position ids, no mm_token_type_ids) computes what
    transformers computes from its own processor's inputs (which derive the positions from mm_token_type_ids)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(glm_path).eval()
    request = processor.build_request(image_row("<image>Describe.", [noise_image(150, 100, seed=6)]))
    mm = processor.multi_modal_inputs(request)
    ids = torch.tensor([processor.expand_prompt_ids(request.prompt_ids, mm["image_grid_thw"])])
    hf = AutoProcessor.from_pretrained(glm_path)
    text = processor.tokenizer.decode(request.prompt_ids)
    theirs = hf(text=[text], images=list(request.images), return_tensors="pt")
    assert torch.equal(theirs["input_ids"], ids)
    with torch.no_grad():
        ours = model(input_ids=ids, position_ids=processor.position_ids(ids, None, mm["image_grid_thw"]), **mm).logits
        reference = model(**theirs).logits
    assert torch.equal(ours, reference)
