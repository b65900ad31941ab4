"""The embedded Qwen3-VL (`tiny-qwen3-vl`, `Qwen3VLForConditionalGeneration`): text hidden 128, 3 layers, head_dim 64,
interleaved mrope [12, 10, 10]; vision depth 3, patch 16, deepstack mergers at vision layers 0 and 1 (~1.3 M params).
Qwen's tokens and template. Its config and processor are also Qwen3-VL-MoE's (`vlmrl.models.tiny.qwen3_vl_moe`);
Qwen3.5 ships the same processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
class TinyQwen3Spec:
    text_hidden: int
    text_layers: int
    text_heads: int
    head_dim: int
    text_intermediate: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    deepstack_layers: tuple[int, ...]
    """Vision layers whose features a deepstack merger adds to the first decoder layers."""
    num_position_embeddings: int
    """Learned vision position embeddings (a square grid, interpolated to each image's patch grid)."""
    min_pixels: int
    max_pixels: int


SPECS = {
    # Qwen3-VL's factor is 32 (patch 16 x merge 2): 4..16 merged tokens per image, as for `tiny`
    "tiny-qwen3-vl": TinyQwen3Spec(128, 3, 2, 64, 256, (12, 10, 10), 3, 64, 2, 128, (0, 1), 64,
                                   32 * 32 * 4, 32 * 32 * 16),
}
BUILD_FACTS = None
"""What the build writes beyond the spec (none: Qwen's tokens and template are the builder's own)."""


def qwen3_vl_config(spec: TinyQwen3Spec, ids: dict[str, int], moe: dict[str, Any] | None = None):
    """The Qwen3-VL config of `spec` (Qwen3-VL-MoE's with `moe`, the text config's expert keys)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    assert sum(spec.mrope_section) == spec.head_dim // 2, "mrope sections must sum to head_dim / 2"
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_heads, head_dim=spec.head_dim, max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            # the released checkpoints carry mrope_interleaved: the engines interleave only with it (HF always does)
            rope_parameters={"rope_type": "default", "mrope_section": list(spec.mrope_section),
                             "mrope_interleaved": True, "rope_theta": 5e6},
            **text_token_ids(ids), **(moe or {}),
        ),
        vision_config=dict(
            depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
            num_heads=spec.vision_heads, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
            out_hidden_size=spec.text_hidden, num_position_embeddings=spec.num_position_embeddings,
            deepstack_visual_indexes=list(spec.deepstack_layers),
        ),
        **vision_token_ids(ids),
        tie_word_embeddings=False,
    )


def save_qwen3_vl_processor(out: Path, min_pixels: int, max_pixels: int, tok) -> None:
    """Qwen3-VL's processor (Qwen3.5 ships the same): 16 px patches, mean = std = 0.5 as the released ones."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels,
                                               patch_size=16, temporal_patch_size=2, merge_size=2,
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                 chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)


def build(out: Path, spec: TinyQwen3Spec) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    tok, ids = qwen_tokenizer()
    save_seeded(Qwen3VLForConditionalGeneration, qwen3_vl_config(spec, ids), out)
    save_qwen3_vl_processor(out, spec.min_pixels, spec.max_pixels, tok)
    save_qwen_tokenizer(out, tok, ids)
