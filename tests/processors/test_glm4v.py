"""The processor on the embedded GLM-4.1V (`tiny-glm4v`): its family's facts (the `<|image|>` placeholder inside
`<|begin_of_image|>..<|end_of_image|>`, pixel bounds that count an image's two temporal copies, GLM's chat template
and stop tokens) come from the model and its family. That its requests and trainer inputs are what transformers'
Glm4vProcessor and get_rope_index make of the same chat is the family matrix's
(tests/families/test_family_matrix.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_an_image_is_one_placeholder_between_its_begin_and_end_tokens(processor):
    """GLM's chat template wraps each image's `<|image|>` in `<|begin_of_image|>..<|end_of_image|>`: the request
    holds one such run per image (what the engines expand), not Qwen's vision start/end tokens."""
    request = processor.build_request(image_row("<image> and <image>: compare.", [noise_image(200, 120, seed=4),
                                                                                noise_image(64, 96, seed=5)]))
    text = processor.tokenizer.decode(request.prompt_ids)
    assert text.startswith("[gMASK]<sop><|user|>\n<|begin_of_image|><|image|><|end_of_image|>")
    assert text.count("<|begin_of_image|><|image|><|end_of_image|>") == 2 and "<|vision_start|>" not in text


def test_the_stop_and_banned_tokens_are_the_models(processor, glm_path):
    """GLM stops at <|endoftext|>, <|user|> and <|observation|> (its generation config); the image and video
    placeholders are never sampled."""
    config = json.loads((Path(glm_path) / "config.json").read_text())
    vocab = processor.tokenizer.convert_tokens_to_ids
    assert processor.image_token_id == config["image_token_id"] == vocab("<|image|>")
    assert set(processor.banned_token_ids) == {vocab("<|image|>"), vocab("<|video|>")}
    assert set(processor.eos_token_ids) == {vocab("<|endoftext|>"), vocab("<|user|>"), vocab("<|observation|>")}
    assert processor.pad_token_id == vocab("<|endoftext|>")
