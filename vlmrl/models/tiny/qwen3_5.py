"""The embedded Qwen3.5 (`tiny-qwen3.5`, `Qwen3_5ForConditionalGeneration`): text hidden 128, 3 layers [Gated DeltaNet,
Gated DeltaNet, full attention] (full_attention_interval 3), head_dim 64 with partial rotary 0.25 (interleaved mrope
[3, 3, 2] over 16 dims), linear attention 1 key / 2 value heads of 128 (the only size vLLM's CPU kernel takes, as in
the released models); vision depth 2, patch 16, no deepstack (~1.2 M params). Qwen's tokens and template, Qwen3-VL's
processor. Its config is also Qwen3.5-MoE's (`vlmrl.models.tiny.qwen3_5_moe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmrl.models.tiny.common import (
    VOCAB_SIZE,
    qwen_tokenizer,
    save_qwen_tokenizer,
    save_seeded,
    text_token_ids,
    vision_token_ids,
)
from vlmrl.models.tiny.qwen3_vl import save_qwen3_vl_processor


@dataclass(frozen=True)
class TinyQwen3_5Spec:
    text_hidden: int
    layer_types: tuple[str, ...]
    """Each decoder layer's token mixer: linear_attention (Gated DeltaNet) or full_attention."""
    text_heads: int
    head_dim: int
    text_intermediate: int
    partial_rotary_factor: float
    """Share of head_dim that rotary embeddings turn (0.25 in the released models)."""
    mrope_section: tuple[int, int, int]
    """Sums to head_dim * partial_rotary_factor / 2."""
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    """Key and value head size of the linear-attention layers."""
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    num_position_embeddings: int
    min_pixels: int
    max_pixels: int


SPECS = {
    "tiny-qwen3.5": TinyQwen3_5Spec(128, ("linear_attention", "linear_attention", "full_attention"), 2, 64, 256,
                                    0.25, (3, 3, 2), 1, 2, 128, 2, 64, 2, 128, 64, 32 * 32 * 4, 32 * 32 * 16),
}
BUILD_FACTS = None
"""What the build writes beyond the spec (none: Qwen's tokens and template are the builder's own)."""


def qwen3_5_config(spec: TinyQwen3_5Spec, ids: dict[str, int], moe: dict[str, Any] | None = None):
    """The Qwen3.5 config of `spec` (Qwen3.5-MoE's with `moe`, the text config's expert keys)."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    from vlmrl.models.families import attention_interval

    rotary = int(spec.head_dim * spec.partial_rotary_factor)
    assert sum(spec.mrope_section) == rotary // 2, "mrope sections must sum to the rotary dims / 2"
    interval = attention_interval({"layer_types": list(spec.layer_types)})
    assert interval is not None, "SGLang builds the layers from full_attention_interval: keep layer_types periodic"
    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=len(spec.layer_types), layer_types=list(spec.layer_types),
            full_attention_interval=interval,  # the released configs carry it, and SGLang reads nothing else
            num_attention_heads=spec.text_heads, num_key_value_heads=spec.text_heads, head_dim=spec.head_dim,
            max_position_embeddings=4096, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
            linear_key_head_dim=spec.linear_head_dim, linear_value_head_dim=spec.linear_head_dim,
            linear_num_key_heads=spec.linear_key_heads, linear_num_value_heads=spec.linear_value_heads,
            # as the released checkpoints: partial rotary, interleaved mrope flagged for the engines
            rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                             "partial_rotary_factor": spec.partial_rotary_factor,
                             "mrope_section": list(spec.mrope_section), "mrope_interleaved": True},
            **text_token_ids(ids), **(moe or {}),
        ),
        vision_config=dict(
            depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
            num_heads=spec.vision_heads, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
            out_hidden_size=spec.text_hidden, num_position_embeddings=spec.num_position_embeddings,
            deepstack_visual_indexes=[],  # as the released configs: SGLang would assume Qwen3-VL's [8, 16, 24]
        ),
        **vision_token_ids(ids),
        tie_word_embeddings=False,
    )


def build(out: Path, spec: TinyQwen3_5Spec) -> None:
    from transformers import Qwen3_5ForConditionalGeneration

    tok, ids = qwen_tokenizer()
    save_seeded(Qwen3_5ForConditionalGeneration, qwen3_5_config(spec, ids), out)
    save_qwen3_vl_processor(out, spec.min_pixels, spec.max_pixels, tok)
    save_qwen_tokenizer(out, tok, ids)
