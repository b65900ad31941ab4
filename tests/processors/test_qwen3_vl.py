"""The processor on the embedded Qwen3-VL (and Qwen3.5, whose processor is Qwen3-VL's): what differs from Qwen2.5-VL (16 px patches, so sides are multiples of
32; the model's own pixel bounds and mean/std 0.5) comes from the model's preprocessor config. That the requests and
trainer inputs are what transformers' Qwen3VLProcessor makes of the same chat is the family matrix's
(tests/families/test_family_matrix.py)."""

from __future__ import annotations

import pytest
from PIL import Image

from tests.processors.helpers import image_row, noise_image
from vlmrl.data.config import DataConfig
from vlmrl.processors.loading import load_processor


@pytest.fixture(scope="module", params=["tiny-qwen3-vl", "tiny-qwen3.5"])
def tiny_qwen3_vl_path(request) -> str:
    """Each embedded family with Qwen3-VL's processor, in turn."""
    from vlmrl.models.tiny import ensure_built

    return str(ensure_built(request.param))


@pytest.fixture(scope="module")
def processor(tiny_qwen3_vl_path):
    return load_processor(tiny_qwen3_vl_path)


def test_the_family_factor_and_bounds_are_the_models(processor):
    assert processor.family.name in ("Qwen3-VL", "Qwen3.5")
    assert (processor.patch_size, processor.spatial_merge_size, processor.image_factor) == (16, 2, 32)
    # the tiny Qwen3-VL's preprocessor bounds (the released models': 65536..16777216), not Qwen2.5-VL's constants
    assert (processor.min_pixels, processor.max_pixels) == (32 * 32 * 4, 32 * 32 * 16)
    request = processor.build_request(image_row("<image> <image>?", [noise_image(333, 201), noise_image(20, 70)]))
    for image in request.images:
        assert image.width % 32 == 0 and image.height % 32 == 0
        assert processor.min_pixels <= image.width * image.height <= processor.max_pixels


@pytest.mark.parametrize("bounds", [dict(min_pixels=28 * 28 * 4), dict(max_pixels=32 * 32 * 17)])
def test_bounds_outside_the_models_are_refused(tiny_qwen3_vl_path, bounds):
    """Qwen2.5-VL's demo bounds (3136) are below this model's minimum: the engines would resize again."""
    with pytest.raises(ValueError, match=r"within the model's image processor bounds \[4096, 16384\]"):
        load_processor(tiny_qwen3_vl_path, DataConfig(**bounds))


def test_pixels_are_normalised_with_the_models_mean_and_std(processor):
    """mean = std = 0.5 (the model's preprocessor config): a mid-grey image maps to about 0, where Qwen2.5-VL's CLIP
    mean/std would not."""
    grey = processor.multi_modal_inputs(processor.build_request(image_row("<image>", [Image.new("RGB", (64, 64),
                                                                                                (128, 128, 128))])))
    assert grey["pixel_values"].abs().max() < 0.01


def test_pad_tokens_are_banned_and_the_tokens_are_the_models(processor, tiny_qwen3_vl_path):
    import json
    from pathlib import Path

    config = json.loads((Path(tiny_qwen3_vl_path) / "config.json").read_text())
    assert processor.image_token_id == config["image_token_id"]
    assert set(processor.banned_token_ids) == {config["image_token_id"], config["video_token_id"]}
    vocab = processor.tokenizer.convert_tokens_to_ids
    assert vocab("<|im_end|>") in processor.eos_token_ids and processor.pad_token_id == vocab("<|endoftext|>")
