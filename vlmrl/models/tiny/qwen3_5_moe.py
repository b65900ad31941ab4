"""The embedded Qwen3.5-MoE (`tiny-qwen3.5-moe`, Qwen3.5-35B-A3B's architecture) on tiny-qwen3.5's shapes: every
decoder MLP a mixture of 4 experts, top-2, expert intermediate 48, plus a gated shared expert (intermediate 64); saved
per expert, as transformers and the released checkpoints do.
"""

from __future__ import annotations

from pathlib import Path

from vlmrl.models.tiny import qwen3_5
from vlmrl.models.tiny.common import TinyMoESpec, qwen_tokenizer, save_qwen_tokenizer, save_seeded
from vlmrl.models.tiny.qwen3_vl import save_qwen3_vl_processor

SPECS = {
    "tiny-qwen3.5-moe": TinyMoESpec(qwen3_5.SPECS["tiny-qwen3.5"], 4, 2, 48, shared_expert_intermediate=64),
}
BUILD_FACTS = None
"""What the build writes beyond the spec (none: Qwen's tokens and template are the builder's own)."""


def build(out: Path, spec: TinyMoESpec) -> None:
    from transformers import Qwen3_5MoeForConditionalGeneration

    tok, ids = qwen_tokenizer()
    moe = {**spec.text_config(), "shared_expert_intermediate_size": spec.shared_expert_intermediate}
    save_seeded(Qwen3_5MoeForConditionalGeneration, qwen3_5.qwen3_5_config(spec.base, ids, moe), out)
    save_qwen3_vl_processor(out, spec.base.min_pixels, spec.base.max_pixels, tok)
    save_qwen_tokenizer(out, tok, ids)
