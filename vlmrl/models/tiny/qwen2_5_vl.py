"""The embedded Qwen2.5-VL models (`Qwen2_5_VLForConditionalGeneration`, family Qwen2.5-VL):

  - ``tiny``:  text hidden 128, 2 layers; vision depth 2, hidden 64 (~0.85 M params, ~3.5 MB). Tests and the demo.
  - ``tiny-large``: text hidden 768, 6 layers; vision depth 4, hidden 256 (~50 M params, ~200 MB). Benchmarks.

Patch 14 x merge 2 (factor 28), windowed vision blocks with the last one full, Qwen's tokens and ChatML template.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlmrl.models.tiny.common import (
    CHAT_TEMPLATE,
    VOCAB_SIZE,
    qwen_tokenizer,
    save_qwen_tokenizer,
    save_seeded,
    text_token_ids,
    vision_token_ids,
)


@dataclass(frozen=True)
class TinySpec:
    text_hidden: int
    text_layers: int
    text_heads: int
    text_intermediate: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    min_pixels: int
    max_pixels: int


SPECS = {
    "tiny": TinySpec(128, 2, 2, 256, (8, 12, 12), 2, 64, 2, 128, 28 * 28 * 4, 28 * 28 * 16),
    "tiny-large": TinySpec(768, 6, 6, 2048, (16, 24, 24), 4, 256, 4, 512, 28 * 28 * 4, 28 * 28 * 64),
}
BUILD_FACTS = None
"""What the build writes beyond the spec (none: Qwen's tokens and template are the builder's own)."""


def build(out: Path, spec: TinySpec) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok, ids = qwen_tokenizer()
    head_dim = spec.text_hidden // spec.text_heads
    assert sum(spec.mrope_section) == head_dim // 2, "mrope sections must sum to head_dim / 2"
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_heads, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": list(spec.mrope_section), "rope_theta": 1e6},
            **text_token_ids(ids),
            use_sliding_window=False, max_window_layers=spec.text_layers,
        ),
        vision_config=dict(
            depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
            num_heads=spec.vision_heads, in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            window_size=112, out_hidden_size=spec.text_hidden, fullatt_block_indexes=[spec.vision_depth - 1],
            tokens_per_second=2,
        ),
        **vision_token_ids(ids),
        tie_word_embeddings=False,
    )
    save_seeded(Qwen2_5_VLForConditionalGeneration, config, out)

    image_processor = Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                                               patch_size=14, temporal_patch_size=2, merge_size=2)
    # transformers requires a video processor; its implementation needs torchvision (pure-Python in the CPU setup).
    video_processor = Qwen2VLVideoProcessor(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                    chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    save_qwen_tokenizer(out, tok, ids)
