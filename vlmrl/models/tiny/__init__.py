"""The embedded models: tiny random-init models of every family, built locally without any hub access.

`build(out_dir, variant)` writes tokenizer, chat template, image processor, config, generation config and safetensors
weights. Rebuilding gives byte-identical files on any machine with the same torch/transformers: the tokenizer files
are committed (`vlmrl/models/tiny_assets/`, made by `scripts/make_tiny_tokenizer.py`) and every parameter is drawn
from one seeded generator (`vlmrl.models.tiny.common`). The result loads through `AutoProcessor` and
`AutoModelForImageTextToText`, and both vLLM and SGLang serve it.

Each family names its embedded models (`ModelFamily.tiny_variants`: pass the name wherever a model path is taken)
and the module that builds them (`tiny_builder`: `vlmrl.models.tiny.<family>`, whose docstring gives the shapes):
``tiny`` and ``tiny-large`` (Qwen2.5-VL), ``tiny-qwen3-vl``, ``tiny-qwen3.5``, ``tiny-qwen3-vl-moe``,
``tiny-qwen3.5-moe``, ``tiny-glm4v``, ``tiny-internvl``. `python -m vlmrl.models.tiny [OUT_DIR] [--variant NAME]`
builds one.
"""

from vlmrl.models.tiny.registry import (
    HUB_FILES,
    VARIANTS,
    build,
    ensure_built,
    hub_snapshot,
    is_embedded,
    is_hub_id,
    resolve_model_path,
    spec,
)

__all__ = ["HUB_FILES", "VARIANTS", "build", "ensure_built", "hub_snapshot", "is_embedded", "is_hub_id",
           "resolve_model_path", "spec"]
