"""`load_processor`: a model folder's processor, of the class its family's image layout takes
(`vlmrl.processors.patches.PatchesProcessor` or `vlmrl.processors.tiles.TilesProcessor`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from vlmrl.data.config import DataConfig
from vlmrl.models.families import family_for_path, read_model_config
from vlmrl.processors.base import Processor
from vlmrl.processors.patches import PatchesProcessor
from vlmrl.processors.tiles import TilesProcessor

logger = logging.getLogger(__name__)


def load_processor(model_path: str, config: DataConfig | None = None) -> Processor:
    """The processor of a supported model's checkpoint folder (or an embedded name: `tiny`, `tiny-qwen3-vl`, ...).

    `config` is the run's data section (its image, video and prompt-length keys). Raises ValueError naming the
    architecture for any other model (vlmrl.models.families lists the supported ones), or listing what is wrong
    with the config. Loads no remote code.
    """
    from transformers import AutoProcessor

    from vlmrl.models.tiny import resolve_model_path

    config = config or DataConfig()
    problems = config.problems()
    if problems:
        raise ValueError("invalid processor configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    path = Path(resolve_model_path(model_path))
    family = family_for_path(path)
    model_config = read_model_config(path)
    hf_processor = AutoProcessor.from_pretrained(str(path))
    generation = _read_json(path / "generation_config.json") if (path / "generation_config.json").exists() else {}
    kind = TilesProcessor if family.inputs.image_layout == "tiles" else PatchesProcessor
    processor = kind(hf_processor, model_config, generation, config, family)
    logger.info("processor for %s (%s): %s, max_prompt_length %d", path, family.name, processor.image_summary(),
                processor.config.max_prompt_length)
    return processor


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path} not found: is {path.parent} a Hugging Face model folder?") from err
