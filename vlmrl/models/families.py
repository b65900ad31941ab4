"""What vlmrl must know about each supported model family, in one place.

A `ModelFamily` holds the facts that differ between Qwen2-VL / Qwen2.5-VL and Qwen3-VL and that more than one
component needs: the checkpoint layout the engines load (weight sync renames the trainer's parameters into it), the
engine settings without which vLLM and SGLang compute something other than transformers, and where the vision
tower, its merger and (Qwen3-VL) its deepstack mergers sit in the model. Code elsewhere asks the family of the model
it holds (`family_of(config)`) instead of testing model types itself.

Image sizing facts (patch size, merge size, pixel bounds) are not here: they are read from the model's own
preprocessor config, which is the source the engines read too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """How logs and errors name the family ("Qwen2.5-VL")."""
    model_types: tuple[str, ...]
    """`model_type` values of config.json that belong to it."""
    checkpoint_prefixes: tuple[tuple[str, str], ...]
    """(prefix of a transformers-5 in-memory parameter name, the prefix the saved checkpoint uses instead): the
    engines load checkpoint names, so weight sync renames parameters with these. Empty: names are the same."""
    vision_tower: str
    """Module path of the vision encoder inside `...ForConditionalGeneration` (patch embed, blocks, mergers)."""
    vision_mergers: tuple[str, ...]
    """Module paths (under the tower) of the patch mergers that project vision features into the language model:
    the final merger, and for Qwen3-VL the deepstack mergers whose outputs are added to the first decoder layers."""
    interleaved_mrope: bool
    """transformers interleaves the three mrope frequency sections (t, h, w, t, h, w...) for this family whatever
    the config says; vLLM and SGLang interleave only when the text config's rope parameters carry
    `mrope_interleaved: true`, and otherwise drift from the trainer (about 0.1 nats per token, measured on a tiny
    Qwen3-VL) while still agreeing with each other."""
    sglang_caller_mm_hashes: bool = True
    """SGLang takes caller-supplied `mm_hashes` for this family's images (vlmrl salts them with the weight version so
    that no multimodal cache serves features of old vision weights). Not Qwen3-VL with sglang 0.5.23: its image path
    pads the prompt with SGLang's own hash before the caller's replaces it, and the scheduler dies on the mismatch
    (`index_copy_(): index N is out of bounds`); the engine must then run without a multimodal embedding cache."""
    video_timing: str | None = None
    """How the model's inputs carry a video's timing: "second_per_grid_ts" (Qwen2/2.5-VL: one grid per video,
    temporal position ids spaced by tokens_per_second x seconds per temporal patch); "timestamps" (Qwen3-VL: each
    temporal patch of 2 frames is its own `<x.x seconds><|vision_start|>...<|vision_end|>` group in the TEXT, the
    grid is split per temporal patch for position ids, t = 1 each); None = vlmrl takes no video for this family."""
    video_model_types: tuple[str, ...] | None = None
    """The model types of this family whose video vlmrl takes (None: all with a `video_timing`). Qwen2.5-VL only,
    not Qwen2-VL: Qwen2-VL gives a video one temporal position id per temporal patch (no tokens_per_second, no
    second_per_grid_ts in its forward), a rule vlmrl's trainer inputs and position ids do not follow yet, and no
    embedded Qwen2-VL model exists to test the engines against it."""
    video_bounds_per_video: bool = False
    """The video processor's size bounds (`shortest_edge` / `longest_edge` pixels) hold for all frames of a video
    together (Qwen3-VL's processor: t x h x w), not for each frame (Qwen2/2.5-VL's)."""
    sglang_video_per_step_grids: bool = False
    """SGLang must get a video's grid split into one (1, h, w) row per temporal patch, with vlmrl's position ids.
    sglang 0.5.23's Qwen2.5-VL vision tower gives its full-attention blocks one sequence per VIDEO (cu_seqlens from
    t*h*w) where transformers, vLLM and the released model attend within each temporal patch (h*w tokens): on any
    video of more than one temporal patch (over 2 frames) its video features differ (measured on the tiny model in
    fp32: 1e-3 to 7e-3 nats per token against HF; HF with SGLang's attention span matches SGLang to 2e-6). With
    split grids its tower attends per temporal patch; its own position ids would then read t separate videos, so
    vlmrl sends the prompt's mrope positions (the trainer's) with them."""

    @property
    def timestamps_in_text(self) -> bool:
        """A video's timing is `<x.x seconds>` text per temporal patch, its grid split per temporal patch
        (`video_timing == "timestamps"`, Qwen3-VL)."""
        return self.video_timing == "timestamps"

    def checkpoint_name(self, name: str) -> str:
        """A transformers-5 in-memory parameter name -> the name in this family's checkpoints (what engines load).

        >>> QWEN2_5_VL.checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight")
        'model.layers.0.mlp.up_proj.weight'
        >>> QWEN2_5_VL.checkpoint_name("model.visual.blocks.0.attn.qkv.bias")
        'visual.blocks.0.attn.qkv.bias'
        >>> QWEN3_VL.checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight")
        'model.language_model.layers.0.mlp.up_proj.weight'
        """
        for memory, saved in self.checkpoint_prefixes:
            if name.startswith(memory):
                return saved + name[len(memory):]
        return name

    def engine_problems(self, model_config: Mapping[str, Any]) -> list[str]:
        """Why vLLM / SGLang started on this config would compute something other than transformers (empty: none).

        A config named here is refused before any engine starts: both engines would agree with each other and
        silently disagree with the trainer's logprobs.
        """
        problems = []
        if self.interleaved_mrope and not mrope_interleaved(model_config):
            problems.append(
                f"{self.name} config without `mrope_interleaved: true` in text_config.rope_parameters (or "
                "rope_scaling): transformers interleaves the mrope frequency sections for this model whatever the "
                "config says, vLLM and SGLang only when the flag is set, so rollout logprobs would drift from the "
                "trainer's (about 0.1 nats per token). The released checkpoints carry the flag; add "
                '"mrope_interleaved": true next to "mrope_section" in config.json.')
        return problems

    def engine_overrides(self, model_config: Mapping[str, Any]) -> dict[str, Any]:
        """Config values the engines must be started with so that they compute what transformers computes on this
        config (empty: none needed). The same nested dict serves vLLM (`hf_overrides`) and SGLang
        (`json_model_override_args`); a sub-dict replaces the whole key there (SGLang does not merge), so the rope
        parameters come back whole, the released layout (`rope_scaling` + `rope_theta`) as transformers 5 reads it.
        They are given twice: in text_config (where vLLM reads them) and at the top level, where SGLang's Qwen3-VL
        reads the copy it flattens out of text_config when it loads the config (before any override).

        >>> QWEN3_VL.engine_overrides({"text_config": {"rope_parameters": {"rope_type": "default",
        ...     "mrope_section": [12, 10, 10], "rope_theta": 5e6}}})["text_config"]["rope_parameters"]
        {'rope_type': 'default', 'mrope_section': [12, 10, 10], 'rope_theta': 5000000.0, 'mrope_interleaved': True}
        >>> QWEN3_VL.engine_overrides({"text_config": {"rope_scaling": {"rope_type": "default",
        ...     "mrope_section": [24, 20, 20]}, "rope_theta": 5e6}})["text_config"]["rope_parameters"]["rope_theta"]
        5000000.0
        >>> QWEN3_VL.engine_overrides({"text_config": {"rope_parameters": {"mrope_section": [12, 10, 10],
        ...     "mrope_interleaved": True}}})
        {}
        >>> QWEN2_5_VL.engine_overrides({"text_config": {"rope_parameters": {"mrope_section": [16, 24, 24]}}})
        {}
        """
        if not (self.interleaved_mrope and not mrope_interleaved(model_config)):
            return {}
        text = model_config.get("text_config") or model_config
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        if "rope_theta" not in rope and "rope_theta" in text:
            rope["rope_theta"] = text["rope_theta"]
        rope["mrope_interleaved"] = True
        return {"text_config": {"rope_parameters": rope}, "rope_parameters": rope} if "text_config" in model_config \
            else {"rope_parameters": rope}


QWEN2_5_VL = ModelFamily(
    name="Qwen2.5-VL",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    # transformers 5 nests the decoder under model.language_model and the tower under model.visual; it saves (and
    # the engines load) the Qwen2-VL layout: model.layers.*, visual.*
    checkpoint_prefixes=(("model.visual.", "visual."), ("model.language_model.", "model.")),
    vision_tower="model.visual",
    vision_mergers=("merger",),
    interleaved_mrope=False,
    video_timing="second_per_grid_ts",
    video_model_types=("qwen2_5_vl",),
    sglang_video_per_step_grids=True,  # harmless for qwen2_vl, whose SGLang tower already attends per step
)

QWEN3_VL = ModelFamily(
    name="Qwen3-VL",
    model_types=("qwen3_vl",),
    checkpoint_prefixes=(),  # saved as it sits in memory: model.language_model.*, model.visual.*
    vision_tower="model.visual",
    vision_mergers=("merger", "deepstack_merger_list"),
    interleaved_mrope=True,
    sglang_caller_mm_hashes=False,
    video_timing="timestamps",
    video_bounds_per_video=True,
)

FAMILIES: tuple[ModelFamily, ...] = (QWEN2_5_VL, QWEN3_VL)


def supported() -> str:
    """'Qwen2.5-VL (qwen2_vl / qwen2_5_vl) and Qwen3-VL (qwen3_vl)', for error messages."""
    return " and ".join(f"{f.name} ({' / '.join(f.model_types)})" for f in FAMILIES)


def family_of(model_config: Mapping[str, Any] | Any) -> ModelFamily:
    """The family of a model config (config.json as a dict, or a transformers config object).

    Raises ValueError naming the architecture and the supported families for any other model.
    """
    if isinstance(model_config, Mapping):
        model_type, architectures = model_config.get("model_type"), model_config.get("architectures")
    else:
        model_type, architectures = getattr(model_config, "model_type", None), getattr(model_config, "architectures",
                                                                                       None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    arch = ", ".join(architectures or []) or f"model_type={model_type!r}"
    raise ValueError(f"architecture {arch} is not supported; vlmrl handles {supported()}")


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of a local model folder, as a dict (FileNotFoundError naming the folder if it has none)."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path} not found: is {path.parent} a Hugging Face model folder?") from err


def family_for_path(model_dir: str | Path) -> ModelFamily:
    """The family of the model in a local folder (its config.json)."""
    try:
        return family_of(read_model_config(model_dir))
    except ValueError as err:
        raise ValueError(f"{model_dir}: {err}") from None


def mrope_interleaved(model_config: Mapping[str, Any]) -> bool:
    """Whether config.json's text rope parameters ask for interleaved mrope sections (what the engines read)."""
    text = model_config.get("text_config") or model_config
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key) or model_config.get(key) or {}
        if isinstance(rope, Mapping) and rope.get("mrope_interleaved"):
            return True
    return False
