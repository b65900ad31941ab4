"""The embedded GLM-4.1V (`tiny-glm4v`, `Glm4vForConditionalGeneration`, model_type glm4v): text hidden 128 x 2
layers, head_dim 64, partial rotary 0.5 (32 of head_dim 64) with mrope sections [4, 6, 6] over it; vision depth 2,
hidden 64, patch 14 x merge 2 as `tiny`, learned position embeddings. GLM's special tokens, chat template and stop
tokens (EOS, <|user|>, <|observation|>).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vlmrl.models.tiny.common import VOCAB_SIZE, build_tokenizer, save_seeded


@dataclass(frozen=True)
class TinyGlm4vSpec:
    text_hidden: int
    text_layers: int
    text_heads: int
    head_dim: int
    text_intermediate: int
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    vision_image_size: int
    """Side of the square its learned position embeddings cover (image_size / patch 14 patches a side), interpolated
    to each image's grid."""
    min_pixels: int
    max_pixels: int
    """Per image (h x w); GLM-4.1V's image processor counts an image's two temporal copies, so its config says 2x."""


SPECS = {
    "tiny-glm4v": TinyGlm4vSpec(128, 2, 2, 64, 256, 0.5, (4, 6, 6), 2, 64, 2, 128, 56, 28 * 28 * 4, 28 * 28 * 16),
}

GLM_SPECIAL_TOKENS = [
    "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>",
    "<think>", "</think>", "<|begin_of_box|>", "<|end_of_box|>",
]
# GLM-4.1V's chat template reduced to what a prompt needs: images and videos as content parts, tool replies as
# <|observation|> turns (the agent loop's `template` tool-turn format)
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{%- for msg in messages %}"
    "{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}"
    "{%- elif msg.role == 'user' %}<|user|>\n"
    "{% if msg.content is string %}{{ msg.content }}{%- else %}{%- for item in msg.content %}"
    "{%- if item.type == 'video' or 'video' in item %}<|begin_of_video|><|video|><|end_of_video|>"
    "{%- elif item.type == 'image' or 'image' in item or 'image_url' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- elif msg.role == 'assistant' %}<|assistant|>\n{{ msg.content }}"
    "{%- elif msg.role == 'tool' or msg.role == 'observation' %}<|observation|>\n"
    "{% if msg.content is string %}{{ msg.content }}{%- else %}{%- for item in msg.content %}"
    "{%- if item.type == 'image' or 'image' in item %}<|begin_of_image|><|image|><|end_of_image|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
BUILD_FACTS = [GLM_SPECIAL_TOKENS, GLM_CHAT_TEMPLATE]
"""What the build writes beyond the spec: part of the embedded build's fingerprint (`vlmrl.models.tiny`)."""


def build(out: Path, spec: TinyGlm4vSpec) -> None:
    """Its config carries `text_config.attention_bias: true`, as the released ones do: transformers' GLM-4.1V text
    attention always has q/k/v biases, and vLLM builds them only when the config says so."""
    from transformers import GenerationConfig, Glm4vConfig, Glm4vForConditionalGeneration, Glm4vProcessor
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    tok = build_tokenizer(GLM_SPECIAL_TOKENS, GLM_CHAT_TEMPLATE, eos="<|endoftext|>",
                          extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"})
    ids = {t: tok.convert_tokens_to_ids(t) for t in GLM_SPECIAL_TOKENS}
    stops = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    rotary = int(spec.head_dim * spec.partial_rotary_factor)
    assert sum(spec.mrope_section) == rotary // 2, "mrope sections must sum to the rotary dims / 2"
    config = Glm4vConfig(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_heads, head_dim=spec.head_dim, max_position_embeddings=4096,
            rms_norm_eps=1e-5, attention_bias=True, eos_token_id=stops, pad_token_id=ids["<|endoftext|>"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": spec.partial_rotary_factor,
                             "mrope_section": list(spec.mrope_section)}),
        vision_config=dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, num_heads=spec.vision_heads,
                           intermediate_size=spec.vision_intermediate, image_size=spec.vision_image_size,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=spec.text_hidden),
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    save_seeded(Glm4vForConditionalGeneration, config, out)
    config_path = out / "config.json"  # transformers 5.19 leaves attention_bias out of the saved text_config
    saved = json.loads(config_path.read_text())
    saved["text_config"]["attention_bias"] = True
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    size = {"shortest_edge": 2 * spec.min_pixels, "longest_edge": 2 * spec.max_pixels}  # counts t = 2 copies
    image_processor = Glm4vImageProcessorPil(size=size, patch_size=14, temporal_patch_size=2, merge_size=2)
    video_processor = Glm4vVideoProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2)
    Glm4vProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                   chat_template=GLM_CHAT_TEMPLATE).save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=stops, pad_token_id=ids["<|endoftext|>"], do_sample=False).save_pretrained(out)
