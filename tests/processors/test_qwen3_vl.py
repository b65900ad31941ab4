"""The processor on the embedded Qwen3-VL (and Qwen3.5, whose processor is Qwen3-VL's): what differs from Qwen2.5-VL (16 px patches, so sides are multiples of
32; the model's own pixel bounds and mean/std 0.5) comes from the model's preprocessor config, and the requests and
trainer inputs agree with what transformers' Qwen3VLProcessor makes of the same chat."""

from __future__ import annotations

import pytest
import torch
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


def test_requests_give_the_ids_and_pixels_transformers_processor_gives(processor, tiny_qwen3_vl_path):
    """Expanded ids, grid and pixel values (normalised with the model's mean/std 0.5) equal Qwen3VLProcessor's on
    the already-resized images: the trainer sees what the model was built to see."""
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(tiny_qwen3_vl_path)
    images = [noise_image(200, 120, seed=4), noise_image(64, 96, seed=5)]
    request = processor.build_request(image_row("<image> and <image>: compare.", images))
    mm = processor.multi_modal_inputs(request)
    text = hf.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " and "},
                                                                {"type": "image"}, {"type": "text",
                                                                                    "text": ": compare."}]}],
                                  add_generation_prompt=True, tokenize=False)
    expected = hf(text=[text], images=list(request.images), return_tensors="pt")
    expanded = processor.expand_prompt_ids(request.prompt_ids, mm["image_grid_thw"])
    assert expanded == expected["input_ids"][0].tolist()
    assert torch.equal(mm["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(mm["pixel_values"], expected["pixel_values"])
    # mean = std = 0.5: a mid-grey image maps to about 0 (Qwen2.5-VL's CLIP mean/std would not)
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


def test_expanded_ids_run_through_the_model(processor, tiny_qwen3_vl_path):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_path).eval()
    request = processor.build_request(image_row("<image>Describe.", [noise_image(150, 100, seed=6)]))
    mm = processor.multi_modal_inputs(request)
    ids = torch.tensor([processor.expand_prompt_ids(request.prompt_ids, mm["image_grid_thw"])])
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=processor.position_ids(ids, None, mm["image_grid_thw"]), **mm)
    assert out.logits.shape[:2] == ids.shape and torch.isfinite(out.logits).all()
