"""The embedded tiny models (every family's `tiny_variants`): one builder per family that has a spec for each name
the family gives, deterministic rebuild, Auto-class loading, HF generate on a chat with an image."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmrl.models.families import FAMILIES
from vlmrl.models.tiny import VARIANTS, build, resolve_model_path


def _gradient_image(w: int, h: int) -> Image.Image:
    img = Image.new("RGB", (w, h))
    img.putdata([((x * 7) % 256, (y * 5) % 256, ((x + y) * 3) % 256) for y in range(h) for x in range(w)])
    return img


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file in a built folder."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_every_family_names_its_embedded_models_and_its_builder_builds_exactly_those():
    import importlib

    for family in FAMILIES:
        assert family.tiny_variants, f"{family.name} has no embedded tiny model"
        module = importlib.import_module(family.tiny_builder)
        assert set(module.SPECS) == set(family.tiny_variants), family.name
        assert all(VARIANTS[name] is family for name in family.tiny_variants)
    assert len(VARIANTS) == sum(len(f.tiny_variants) for f in FAMILIES)  # no name given twice


@pytest.mark.parametrize("variant", sorted(set(VARIANTS) - {"tiny-large"}))  # tiny-large: 200 MB, its builder is tiny's
def test_rebuild_is_byte_identical(tmp_path, variant):
    a = file_digests(build(tmp_path / "a", variant))
    b = file_digests(build(tmp_path / "b", variant))
    assert a == b
    assert {"model.safetensors", "config.json", "tokenizer.json", "processor_config.json"} <= set(a)


def test_the_two_families_are_different_models_with_one_tokenizer(tiny_model_path, tiny_qwen3_vl_path):
    a, b = file_digests(Path(tiny_model_path)), file_digests(Path(tiny_qwen3_vl_path))
    assert a["tokenizer.json"] == b["tokenizer.json"]
    assert a["model.safetensors"] != b["model.safetensors"]
    assert resolve_model_path("tiny-qwen3-vl") == tiny_qwen3_vl_path


def test_name_resolves_to_cached_build(tiny_model_path, tmp_path):
    assert resolve_model_path("tiny") == tiny_model_path
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="'/some/other/path': no such folder"):
        resolve_model_path("/some/other/path")


def test_a_hub_id_resolves_to_its_snapshot_in_the_hf_cache(tiny_model_path, tmp_path, monkeypatch):
    """`Qwen/Qwen2.5-VL-7B-Instruct`-style ids: the processor, checkpoint copier and engines all need a folder. No hub
    here, so the snapshot is laid out in a cache the way huggingface_hub stores it, and the hub is offline."""
    import shutil

    import huggingface_hub.constants

    from vlmrl.models import tiny
    from vlmrl.processors.loading import load_processor

    repo = tmp_path / "hub" / "models--org--tiny-vl"
    shutil.copytree(tiny_model_path, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    tiny.hub_snapshot.cache_clear()
    try:
        assert resolve_model_path("org/tiny-vl") == str(repo / "snapshots" / "abc123")
        assert load_processor("org/tiny-vl").image_token_id == load_processor(tiny_model_path).image_token_id
        with pytest.raises(FileNotFoundError, match="'org/missing' is not a local folder and could not be fetched"):
            resolve_model_path("org/missing")
    finally:
        tiny.hub_snapshot.cache_clear()


def test_unknown_embedded_name_is_rejected():
    from vlmrl.models.tiny import ensure_built

    with pytest.raises(ValueError, match="unknown embedded model"):
        ensure_built("tiny-xxl")


def test_loads_with_auto_classes_and_generates_on_image_chat(tiny_model_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_model_path)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.count("<|image_pad|>") == 1
    inputs = processor(text=[text], images=[_gradient_image(112, 112)], return_tensors="pt")
    # 112x112 -> 8x8 patches of 14 -> 16 merged tokens: the placeholder is expanded to 16 image tokens.
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8]]
    assert (inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum() == 16
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 8
    # Greedy decoding is deterministic, and the image matters: a different image changes the logits.
    again = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, again)
    other = processor(text=[text], images=[Image.new("RGB", (112, 112), (255, 0, 0))], return_tensors="pt")
    with torch.no_grad():
        l1 = model(**inputs).logits[0, -1]
        l2 = model(**other).logits[0, -1]
    assert not torch.allclose(l1, l2)


def test_tiny_qwen3_vl_loads_with_auto_classes_and_generates_on_image_chat(tiny_qwen3_vl_path):
    """The Qwen3-VL build: the Qwen3-VL classes, 16 px patches (a 128x96 image -> an 8x6 grid -> 12 tokens),
    mean/std 0.5 as in the released processors, interleaved mrope flagged for the engines, deepstack mergers."""
    import json

    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_qwen3_vl_path)
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_path, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor"
    assert processor.image_processor.patch_size == 16
    assert list(processor.image_processor.image_mean) == [0.5] * 3 == list(processor.image_processor.image_std)
    config = json.loads((Path(tiny_qwen3_vl_path) / "config.json").read_text())
    assert config["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    assert len(model.model.visual.deepstack_merger_list) == 2
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[_gradient_image(128, 96)], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 8]]
    assert (inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum() == 12
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert 1 <= out.shape[1] - inputs["input_ids"].shape[1] <= 8
    assert torch.equal(out, model.generate(**inputs, max_new_tokens=8, do_sample=False))
    other = processor(text=[text], images=[Image.new("RGB", (128, 96), (255, 0, 0))], return_tensors="pt")
    with torch.no_grad():
        assert not torch.allclose(model(**inputs).logits[0, -1], model(**other).logits[0, -1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_qwen3_5_loads_with_auto_classes_and_generates_on_image_chat(tiny_qwen3_5_path, dtype):
    """The Qwen3.5 build: transformers' own Qwen3.5 classes with Qwen3-VL's processor (16 px patches, mean/std 0.5),
    the hybrid layers [Gated DeltaNet, Gated DeltaNet, full attention] with the full_attention_interval SGLang reads,
    linear-attention heads of 128 (vLLM's CPU kernel takes no other size), interleaved mrope flagged for the engines,
    no deepstack. It generates with an image in float32 and in bfloat16 (the engines' dtype on CPU) through
    transformers' PyTorch fallbacks of the causal conv1d and gated delta rule kernels."""
    import json

    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_qwen3_5_path)
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_5_path, dtype=dtype).eval()
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor" and processor.image_processor.patch_size == 16
    text_config = json.loads((Path(tiny_qwen3_5_path) / "config.json").read_text())["text_config"]
    assert text_config["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    assert text_config["full_attention_interval"] == 3
    assert text_config["linear_key_head_dim"] == text_config["linear_value_head_dim"] == 128
    assert text_config["rope_parameters"]["mrope_interleaved"] is True
    assert [type(layer.linear_attn).__name__ for layer in model.model.language_model.layers[:2]] == [
        "Qwen3_5GatedDeltaNet"] * 2
    assert not hasattr(model.model.visual, "deepstack_merger_list")
    assert 1.0e6 < sum(p.numel() for p in model.parameters()) < 1.4e6
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[_gradient_image(128, 96)], return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 8]]
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert out.shape[1] - inputs["input_ids"].shape[1] == 8
    assert torch.equal(out, model.generate(**inputs, max_new_tokens=8, do_sample=False))
    other = processor(text=[text], images=[Image.new("RGB", (128, 96), (255, 0, 0))], return_tensors="pt")
    other["pixel_values"] = other["pixel_values"].to(dtype)
    with torch.no_grad():
        assert not torch.allclose(model(**inputs).logits[0, -1], model(**other).logits[0, -1])


def test_answer_words_are_single_tokens(tiny_model_path):
    """The synthetic tasks' answers start the assistant turn: one token each keeps the demo learnable fast."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    for word in ["red", "green", "blue", "yellow", "square", "circle", "triangle", "left", "right"]:
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word
