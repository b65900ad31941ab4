"""The processor: rows -> requests that every backend takes, on the default family (Qwen2.5-VL): image forms, markers
and content parts, pixel bounds and config checks. That every family's trainer inputs are what transformers'
processor and get_rope_index make of the same chat is the family matrix's (tests/families/test_family_matrix.py)."""

from __future__ import annotations

import base64
import json
import shutil

import pytest

from tests.processors.helpers import image_row, noise_image, png_bytes
from vlmrl.data.config import DataConfig
from vlmrl.processors.loading import load_processor


@pytest.fixture(scope="module")
def processor(tiny_model_path):
    return load_processor(tiny_model_path)


def test_loads_the_embedded_name_and_names_the_special_tokens(processor):
    assert load_processor("tiny").image_token_id == processor.image_token_id  # `tiny` resolves like its path
    vocab = processor.tokenizer.convert_tokens_to_ids
    assert processor.image_token_id == vocab("<|image_pad|>")
    assert set(processor.banned_token_ids) == {vocab("<|image_pad|>"), vocab("<|video_pad|>")}
    assert vocab("<|im_end|>") in processor.eos_token_ids
    assert processor.pad_token_id == vocab("<|endoftext|>")


def test_rejects_other_architectures_naming_them(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]}))
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration is not supported"):
        load_processor(str(tmp_path))


def test_never_runs_code_shipped_with_a_checkpoint(tiny_model_path, tmp_path):
    """A checkpoint whose processor config points at its own Python file: loading must not execute it."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    sentinel = tmp_path / "executed"
    (folder / "evil_processor.py").write_text(f"open({str(sentinel)!r}, 'w').write('ran')\n")
    config = json.loads((folder / "processor_config.json").read_text())
    config["auto_map"] = {"AutoProcessor": "evil_processor.EvilProcessor"}
    (folder / "processor_config.json").write_text(json.dumps(config))
    processor = load_processor(str(folder))
    assert not sentinel.exists()
    assert type(processor.hf_processor).__module__.startswith("transformers.models.qwen2_5_vl")


def _forms(image, tmp_path):
    data = png_bytes(image)
    path = tmp_path / "img.png"
    path.write_bytes(data)
    return {
        "bytes": {"bytes": data},
        "raw bytes": data,
        "path dict": {"bytes": None, "path": str(path)},
        "path": str(path),
        "file uri": f"file://{path}",
        "data uri": "data:image/png;base64," + base64.b64encode(data).decode(),
        "PIL": image,
    }


def test_same_prompt_ids_and_image_bytes_whatever_the_image_form(processor, tmp_path):
    image = noise_image(173, 91, seed=3)
    requests = {name: processor.build_request(image_row("<image>What is shown?", [form]), index=5)
                for name, form in _forms(image, tmp_path).items()}
    reference = requests["bytes"]
    for name, request in requests.items():
        assert request.prompt_ids == reference.prompt_ids, name
        assert request.images[0].tobytes() == reference.images[0].tobytes(), name
        assert request.images[0].size == reference.images[0].size and request.images[0].mode == "RGB", name
        assert request.image_hashes == reference.image_hashes, name


def test_request_holds_one_placeholder_per_image_and_resized_images(processor):
    images = [noise_image(400, 300, seed=1), noise_image(30, 50, seed=2)]
    request = processor.build_request(image_row("<image> left, <image> right: which is larger?", images), 11)
    assert request.prompt_ids.count(processor.image_token_id) == 2  # unexpanded: the form engines take
    for image in request.images:
        assert image.width % 28 == 0 and image.height % 28 == 0
        assert processor.min_pixels <= image.width * image.height <= processor.max_pixels
    assert request.images[0].width > request.images[0].height  # aspect ratio kept
    assert request.data_source == "test" and request.ground_truth == "a"
    assert request.extra_info == {"split": "test"} and request.index == 11
    assert set(request.banned_token_ids) == set(processor.banned_token_ids)


def test_markers_and_content_parts_give_the_same_ids(processor):
    image = noise_image(100, 100)
    marker = processor.build_request(image_row("Look: <image> What colour?", [image]))
    parts = processor.build_request({"prompt": [{"role": "user", "content": [
        {"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " What colour?"}]}],
        "images": [image]})
    inline = processor.build_request({"prompt": [{"role": "user", "content": [
        {"type": "text", "text": "Look: "}, {"type": "image", "image": image},
        {"type": "text", "text": " What colour?"}]}]})
    assert marker.prompt_ids == parts.prompt_ids == inline.prompt_ids
    assert marker.image_hashes == parts.image_hashes == inline.image_hashes


def test_every_request_gets_its_own_uid(processor):
    row = image_row("<image>?", [noise_image(56, 56)])
    assert len({processor.build_request(row).uid for _ in range(5)}) == 5


def test_text_only_row(processor):
    request = processor.build_request({"prompt": "What is 2 + 2?", "answer": "4"})
    assert request.images == [] and processor.image_token_id not in request.prompt_ids
    assert request.ground_truth == "4"
    assert processor.multi_modal_inputs(request) == {}


def test_pixel_bounds_come_from_the_model_or_the_config(tiny_model_path):
    default = load_processor(tiny_model_path)
    assert (default.min_pixels, default.max_pixels) == (3136, 12544)  # the tiny model's image processor
    small = load_processor(tiny_model_path, DataConfig(max_pixels=28 * 28 * 4))
    request = small.build_request(image_row("<image>?", [noise_image(500, 500)]))
    assert request.images[0].size == (56, 56)


@pytest.mark.parametrize("bounds", [dict(max_pixels=28 * 28 * 64), dict(min_pixels=28 * 28)])
def test_pixel_bounds_outside_the_models_are_refused(tiny_model_path, bounds):
    with pytest.raises(ValueError, match="within the model's image processor bounds"):
        load_processor(tiny_model_path, DataConfig(**bounds))


def test_image_factor_is_the_models(tiny_model_path):
    processor = load_processor(tiny_model_path)
    assert processor.image_factor == processor.patch_size * processor.spatial_merge_size == 28
    request = processor.build_request(image_row("<image>?", [noise_image(333, 201)]))
    assert all(side % 28 == 0 for side in request.images[0].size)


@pytest.mark.parametrize("field,value", [("on_bad_image", "ignore"), ("max_prompt_length", 0),
                                         ("remote_max_bytes", 0)])
def test_invalid_config_values_say_what_to_use(tiny_model_path, field, value):
    assert any(field in problem for problem in DataConfig(**{field: value}).problems())
    with pytest.raises(ValueError, match=field):
        load_processor(tiny_model_path, DataConfig(**{field: value}))


def test_the_bomb_guard_must_admit_the_models_largest_image(tiny_model_path):
    """With max_pixels null the bound is the model's (12544 for the tiny model), known only at load."""
    assert DataConfig(max_image_pixels=10000).problems() == []
    with pytest.raises(ValueError, match="data.max_image_pixels=10000 rejects images data.max_pixels=12544"):
        load_processor(tiny_model_path, DataConfig(max_image_pixels=10000))
