"""The embedded InternVL3.5 (`tiny-internvl`): transformers' own InternVL format (`InternVLForConditionalGeneration`,
model_type internvl, a Qwen3 language model), built locally from a seeded generator like the other embedded models.

Shapes: Qwen3 text hidden 128 x 2 layers, head_dim 64 (1-D rope); InternViT hidden 64 x 2 layers on 64-pixel tiles
of 8-pixel patches, pixel shuffle 0.5 -> 16 tokens per tile; an image is cut into up to 4 tiles by its aspect ratio,
plus a thumbnail when it takes more than one (released InternVL3.5: 448-pixel tiles, 256 tokens each, up to 12 tiles).
The chat template is the -hf conversions' ChatML with `<IMG_CONTEXT>\\n` per image, and tool replies as `tool` turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlmrl.models.tiny.common import SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer, save_seeded


@dataclass(frozen=True)
class TinyInternVLSpec:
    text_hidden: int
    text_layers: int
    text_heads: int
    head_dim: int
    text_intermediate: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    tile: int
    """Side of a square tile in pixels (the vision tower's image_size)."""
    patch: int
    downsample_ratio: float
    """Pixel shuffle: each tile's (tile / patch)^2 patches become (tile / patch)^2 x ratio^2 tokens."""
    max_tiles: int

    @property
    def tokens_per_tile(self) -> int:
        return int((self.tile // self.patch) ** 2 * self.downsample_ratio**2)


SPECS = {
    # 64-pixel tiles of 8-pixel patches, pixel shuffle 0.5 (16 tokens a tile), up to 4 tiles + a thumbnail
    "tiny-internvl": TinyInternVLSpec(128, 2, 2, 64, 256, 64, 2, 2, 128, 64, 8, 0.5, 4),
}

NORM_BIAS = 0.0
"""LayerNorm biases of the tiny InternVL (its tower and projector have LayerNorms; transformers inits them at 0)."""
INTERNVL_SPECIAL_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>", "<video>", "<think>", "</think>"]
# The InternVL -hf chat template (ChatML; an image part renders as <IMG_CONTEXT>\n), system turn optional
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' or 'video' in content %}{{ '<video>\n' }}"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)


BUILD_FACTS = [INTERNVL_SPECIAL_TOKENS, INTERNVL_CHAT_TEMPLATE, NORM_BIAS]
"""What the build writes beyond the spec: part of the embedded build's fingerprint (`vlmrl.models.tiny`)."""

TOKENIZER_ATTRIBUTES = {"start_image_token": "<img>", "end_image_token": "</img>",
                        "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
"""The tokenizer attributes InternVLProcessor reads (`tokenizer.start_image_token`, ...)."""


def build(out: Path, spec: TinyInternVLSpec) -> None:
    """Write the tiny InternVL3.5 folder: processor, config, weights (the embedded models' seeded init), with the
    embedded tokenizer carrying Qwen's tokens, this family's tokens, template and `TOKENIZER_ATTRIBUTES`."""
    from transformers import GenerationConfig, InternVLConfig, InternVLForConditionalGeneration, InternVLProcessor
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    tok = build_tokenizer(SPECIAL_TOKENS + INTERNVL_SPECIAL_TOKENS, INTERNVL_CHAT_TEMPLATE,
                          extra_special_tokens=TOKENIZER_ATTRIBUTES)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ["<|im_end|>", "<|endoftext|>", *INTERNVL_SPECIAL_TOKENS]}
    stops = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    config = InternVLConfig(
        text_config=dict(
            model_type="qwen3", vocab_size=VOCAB_SIZE, hidden_size=spec.text_hidden,
            intermediate_size=spec.text_intermediate, num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.text_heads, num_key_value_heads=spec.text_heads, head_dim=spec.head_dim,
            max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
            bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(hidden_size=spec.vision_hidden, num_hidden_layers=spec.vision_layers,
                           num_attention_heads=spec.vision_heads, intermediate_size=spec.vision_intermediate,
                           image_size=spec.tile, patch_size=spec.patch, norm_type="layer_norm", use_qk_norm=False),
        image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=spec.tokens_per_tile,
        downsample_ratio=spec.downsample_ratio, tie_word_embeddings=False,
    )
    save_seeded(InternVLForConditionalGeneration, config, out, norm_bias=NORM_BIAS)
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": spec.tile, "width": spec.tile}, crop_to_patches=True, min_patches=1,
        max_patches=spec.max_tiles, image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    video_processor = InternVLVideoProcessor(size={"height": spec.tile, "width": spec.tile})
    InternVLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                      image_seq_length=spec.tokens_per_tile, chat_template=INTERNVL_CHAT_TEMPLATE).save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(bos_token_id=ids["<|endoftext|>"], eos_token_id=stops, pad_token_id=ids["<|endoftext|>"],
                     do_sample=False).save_pretrained(out)
