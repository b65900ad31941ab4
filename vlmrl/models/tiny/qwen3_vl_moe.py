"""The embedded Qwen3-VL-MoE (`tiny-qwen3-vl-moe`, Qwen3-VL-30B-A3B's architecture) on tiny-qwen3-vl's shapes: three
deepstack mergers, at vision layers 0-2 (as the released model has three: SGLang's Qwen3-VL-MoE adds exactly three),
every decoder layer a mixture of 4 experts, top-2, expert intermediate 48 (2 x 48 != hidden 128, so an expert tensor
loaded in the wrong orientation fails instead of loading silently); saved in the hub's layout
(`vlmrl.models.experts`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vlmrl.models.tiny import qwen3_vl
from vlmrl.models.tiny.common import TinyMoESpec, qwen_tokenizer, save_qwen_tokenizer, save_seeded

SPECS = {
    "tiny-qwen3-vl-moe": TinyMoESpec(dataclasses.replace(qwen3_vl.SPECS["tiny-qwen3-vl"], deepstack_layers=(0, 1, 2)),
                                     4, 2, 48),
}
BUILD_FACTS = None
"""What the build writes beyond the spec (none: Qwen's tokens and template are the builder's own)."""


def build(out: Path, spec: TinyMoESpec) -> None:
    from transformers import Qwen3VLMoeForConditionalGeneration

    tok, ids = qwen_tokenizer()
    moe = {**spec.text_config(), "decoder_sparse_step": 1, "mlp_only_layers": []}  # every layer sparse
    save_seeded(Qwen3VLMoeForConditionalGeneration, qwen3_vl.qwen3_vl_config(spec.base, ids, moe), out)
    qwen3_vl.save_qwen3_vl_processor(out, spec.base.min_pixels, spec.base.max_pixels, tok)
    save_qwen_tokenizer(out, tok, ids)
