"""What vlmrl must know about each supported model family, in one place: `FAMILIES`, the only list of them.

A `ModelFamily` holds the facts that differ between Qwen2-VL / Qwen2.5-VL, Qwen3-VL, Qwen3.5 (dense and MoE),
GLM-4.1V and InternVL and that more than one component needs, in named parts (`vlmrl.models.family_parts`): where
its weights sit (the checkpoint layout the engines load, which weight sync renames the trainer's parameters into;
the vision tower, its blocks and mergers; which decoder layers are linear attention), how its inputs are formed
(placeholders, image layout, mrope, video timing), and the engine facts without which vLLM and SGLang compute
something other than transformers (or do not start). Beside them: its embedded tiny models, its FLOP rule and its
recipe. Code elsewhere asks the family of the model it holds (`family_of(config)`) instead of testing model types
itself (tests/test_family_questions.py holds it to that).
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vlmrl.models.family_parts import EngineFacts, Experts, InputFormat, WeightsLayout


@dataclass(frozen=True)
class ModelFamily:
    """One model family: what it is called, its parts (`WeightsLayout`, `InputFormat`, `EngineFacts`, `Experts`), its
    embedded tiny models, how its model FLOPs are counted and which recipe a run on it starts from."""

    name: str
    """How logs and errors name the family ("Qwen2.5-VL")."""
    model_types: tuple[str, ...]
    """`model_type` values of config.json that belong to it."""
    weights: WeightsLayout
    """Where its weights sit, in memory and in its checkpoints."""
    tiny_variants: tuple[str, ...]
    """The embedded tiny models of this family (names taken wherever a model path is), the first the one the family's
    tests use: deterministic random-init builds that transformers, vLLM and SGLang load (`vlmrl.models.tiny`)."""
    tiny_builder: str
    """The module that builds them (`SPECS` by name, `build(out, spec)`, `BUILD_FACTS`), imported only when one is
    built: this module stays free of transformers."""
    recipe: str
    """The geo3k recipe a run on this family starts from (examples/configs/<recipe>.yaml), what the launcher
    (examples/qwen2_5_vl_grpo.sh, through examples/recipe.py) picks for a model of this family."""
    hub_id_pattern: str
    """A regular expression (case-insensitive) that the hub ids of this family's released models match, and no other
    family's do: how the launcher knows the family of a model not downloaded yet (a folder's config.json decides
    otherwise). `family_for_hub_id` reads it."""
    inputs: InputFormat = InputFormat()
    """How its prompts, images and videos reach the model (the default: Qwen-VL's)."""
    engines: EngineFacts = EngineFacts()
    """What vLLM and SGLang need of it beyond vlmrl's common settings (the default: nothing)."""
    experts: Experts | None = None
    """The routed experts (Mixture-of-Experts families); None: a dense model."""
    flop_rule: str | None = None
    """How `vlmrl.models.flops` counts this family's model FLOPs (a key of its `RULES`: the language model's mixers
    and MLPs, the vision tower's blocks and mergers); None: no rule, so a run logs no MFU (and the FLOP test, which
    holds every family's rule to torch's FlopCounterMode on its embedded model, fails)."""
    recipe_by_size: tuple[tuple[str, str], ...] = ()
    """(pattern on the model's name or folder, recipe) for sizes the family's `recipe` does not fit, the first
    match winning (Qwen2.5-VL named 32B or 72B: a bfloat16 actor and optimizer and the engine across 8 devices, as
    EasyR1's baseline runs them)."""

    def recipe_for(self, model: str) -> str:
        """The geo3k recipe for a model of this family named `model` (a hub id or a folder): its size's own recipe
        where `recipe_by_size` has one, else the family's.

        >>> QWEN2_5_VL.recipe_for("Qwen/Qwen2.5-VL-72B-Instruct"), QWEN2_5_VL.recipe_for("Qwen/Qwen2.5-VL-7B-Instruct")
        ('qwen2_5_vl_32b_geo3k', 'qwen2_5_vl_geo3k')
        """
        return next((recipe for pattern, recipe in self.recipe_by_size if re.search(pattern, model, re.IGNORECASE)),
                    self.recipe)

    def engine_problems(self, model_config: Mapping[str, Any], backend: str | None = None) -> list[str]:
        """Why vLLM / SGLang started on this config would compute something other than transformers (empty: none).
        `backend` (vllm, sglang, sglang-server): that engine's problems only; None: either engine's.

        vlmrl starts the engines with `engine_overrides`, which settle these where the config allows; an engine
        with a problem left after them is refused before it starts, and a server given by URL is checked for them:
        both engines would otherwise silently disagree with the trainer's logprobs (or with each other).
        """
        engines = self.engines
        problems = []
        sglang = backend is None or backend.startswith("sglang")
        if self.weights.linear_attention is not None and sglang:
            problems += _attention_interval_problems(self.name, model_config)
        if engines.deepstack_free and sglang and (model_config.get("vision_config") or {}).get(
                "deepstack_visual_indexes") != []:
            problems.append(f"{self.name} config without `deepstack_visual_indexes: []` in vision_config: SGLang then "
                            "assumes Qwen3-VL's deepstack layers [8, 16, 24], which this model does not have (its "
                            "scheduler dies on the first image, or adds features no layer of the model computes); "
                            'add "deepstack_visual_indexes": [] to vision_config, as the released configs have')
        deepstack = (model_config.get("vision_config") or {}).get("deepstack_visual_indexes")
        if engines.sglang_deepstack_layers is not None and sglang and deepstack is not None \
                and len(deepstack) != engines.sglang_deepstack_layers:
            problems.append(f"{self.name} config with {len(deepstack)} deepstack layers ({deepstack}): SGLang's "
                            f"{self.name} adds exactly {engines.sglang_deepstack_layers}, as the released models have, "
                            "whatever the config says (its scheduler dies on the first image, or drops the extra "
                            "ones); use vllm or the hf backend for this model")
        text = model_config.get("text_config") or model_config
        dense = dense_layers(text)
        if engines.sglang_moe_every_layer and sglang and dense:
            problems.append(f"{self.name} config with dense decoder layers {dense} (mlp_only_layers / "
                            f"decoder_sparse_step): SGLang's {self.name} builds every layer as MoE and leaves those "
                            "layers' experts uninitialised (it computes another model, without an error); use vllm "
                            "or the hf backend for this model")
        vllm = backend is None or backend == "vllm"
        if engines.text_attention_bias and vllm and text.get("attention_bias") is not True:
            problems.append(f"{self.name} config without `attention_bias: true` in text_config: transformers' "
                            f"{self.name} text attention always has q/k/v biases, vLLM builds them only when the "
                            "config says so (and then drops the checkpoint's biases without an error: about 0.2 nats "
                            'per token off the trainer). The released configs carry it; add "attention_bias": true '
                            "to text_config in config.json.")
        if self.inputs.interleaved_mrope and not mrope_interleaved(model_config):
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
        engines = self.engines
        overrides: dict[str, Any] = {}
        text = model_config.get("text_config") or model_config
        nested = "text_config" in model_config
        if self.inputs.interleaved_mrope and not mrope_interleaved(model_config):
            rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
            if "rope_theta" not in rope and "rope_theta" in text:
                rope["rope_theta"] = text["rope_theta"]
            rope["mrope_interleaved"] = True
            overrides = {"text_config": {"rope_parameters": rope}, "rope_parameters": rope} if nested \
                else {"rope_parameters": rope}
            if self.weights.linear_attention is not None:
                # sglang's Qwen3.5 text config reads the rope from `rope_scaling` (it copies rope_parameters there
                # when it is built, before any override)
                overrides["text_config"]["rope_scaling"] = rope
        deepstack = (model_config.get("vision_config") or {}).get("deepstack_visual_indexes")
        if engines.deepstack_free and deepstack != []:
            overrides["vision_config"] = {"deepstack_visual_indexes": []}
        if engines.text_attention_bias and text.get("attention_bias") is not True:
            overrides.setdefault("text_config", {})["attention_bias"] = True
        interval = attention_interval(text)
        if self.weights.linear_attention is not None and interval is not None \
                and text.get("full_attention_interval") != interval:
            overrides.setdefault("text_config", {})["full_attention_interval"] = interval
        return overrides

    def cpu_engine_problems(self, model_config: Mapping[str, Any], backend: str, dtype: str) -> list[str]:
        """Why `backend` (vllm, sglang, sglang-server) cannot run this config in `dtype` on a CPU (empty: it can).

        >>> QWEN3_5.cpu_engine_problems({"text_config": {"linear_key_head_dim": 128,
        ...     "linear_value_head_dim": 128}}, "vllm", "float32")[0][:62]
        'Qwen3.5 runs in bfloat16 on CPU engines (vLLM asserts "CPU GDN'
        >>> QWEN3_5.cpu_engine_problems({"text_config": {"linear_key_head_dim": 32}}, "vllm", "bfloat16")[0][:46]
        'vllm on CPU takes linear-attention heads of 12'
        >>> QWEN3_VL.cpu_engine_problems({}, "vllm", "float32")
        []
        """
        engines = self.engines
        problems = []
        if engines.cpu_engine_dtype is not None and dtype != engines.cpu_engine_dtype:
            problems.append(
                f"{self.name} runs in {engines.cpu_engine_dtype} on CPU engines (vLLM asserts \"CPU GDN attention "
                f"requires BF16\"; SGLang's CPU kernels are its twins): got dtype={dtype}. Set rollout.dtype="
                f"{engines.cpu_engine_dtype} or auto, and compare with the hf reference in the same dtype")
        if engines.sglang_cpu_needs_amx and backend.startswith("sglang") and not cpu_has_amx():
            problems.append(
                f"{backend} serves {self.name} on a CPU only with Intel AMX (sglang's shared-expert gate is a Triton "
                "kernel elsewhere, and Triton has no CPU driver): use vllm or the hf backend on this CPU, or a GPU")
        text = model_config.get("text_config") or model_config
        if backend == "vllm" and engines.cpu_linear_head_dim is not None:
            sizes = {key: text.get(key, engines.cpu_linear_head_dim)
                     for key in ("linear_key_head_dim", "linear_value_head_dim")}
            wrong = {key: size for key, size in sizes.items() if size != engines.cpu_linear_head_dim}
            if wrong:
                problems.append(
                    f"vllm on CPU takes linear-attention heads of {engines.cpu_linear_head_dim} only (its "
                    f"chunk_gated_delta_rule_cpu raises \"Unexpected head dim size\"), this config has {wrong}: "
                    "use the sglang or hf backend, or a GPU")
        return problems


QWEN2_5_VL = ModelFamily(
    name="Qwen2.5-VL",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    weights=WeightsLayout(
        # transformers 5 nests the decoder under model.language_model and the tower under model.visual; it saves (and
        # the engines load) the Qwen2-VL layout: model.layers.*, visual.*
        checkpoint_prefixes=(("model.visual.", "visual."), ("model.language_model.", "model.")),
        vision_tower="model.visual",
        vision_mergers=("merger",),
    ),
    inputs=InputFormat(video_timing="second_per_grid_ts", video_model_types=("qwen2_5_vl",)),
    # harmless for qwen2_vl, whose SGLang tower already attends per step
    engines=EngineFacts(sglang_video_per_step_grids=True),
    tiny_variants=("tiny", "tiny-large"),
    tiny_builder="vlmrl.models.tiny.qwen2_5_vl",
    flop_rule="qwen2-vl",
    recipe="qwen2_5_vl_geo3k",
    recipe_by_size=((r"-(32|72)B", "qwen2_5_vl_32b_geo3k"),),
    hub_id_pattern=r"qwen2(\.5)?[-_.]?vl",
)

QWEN3_VL = ModelFamily(
    name="Qwen3-VL",
    model_types=("qwen3_vl",),
    weights=WeightsLayout(
        checkpoint_prefixes=(),  # saved as it sits in memory: model.language_model.*, model.visual.*
        vision_tower="model.visual",
        vision_mergers=("merger", "deepstack_merger_list"),
    ),
    inputs=InputFormat(interleaved_mrope=True, video_timing="timestamps", video_bounds_per_video=True),
    engines=EngineFacts(sglang_caller_mm_hashes=False),
    tiny_variants=("tiny-qwen3-vl",),
    tiny_builder="vlmrl.models.tiny.qwen3_vl",
    flop_rule="qwen3-vl",
    recipe="qwen3_vl_geo3k",
    hub_id_pattern=r"qwen3[-_.]?vl(?!.*-A\d+B)",  # no active-parameter count: dense
)

QWEN3_5 = ModelFamily(
    name="Qwen3.5",
    model_types=("qwen3_5",),
    weights=WeightsLayout(
        checkpoint_prefixes=(),  # saved as it sits in memory: model.language_model.*, model.visual.*
        vision_tower="model.visual",
        vision_mergers=("merger",),  # Qwen3-VL's tower without its deepstack mergers
        linear_attention="linear_attn",
        linear_attention_projections=("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    ),
    inputs=InputFormat(interleaved_mrope=True, video_timing="timestamps", video_bounds_per_video=True),
    engines=EngineFacts(
        sglang_caller_mm_hashes=False,  # SGLang runs it through Qwen3-VL's multimodal path
        cpu_engine_dtype="bfloat16",
        cpu_linear_head_dim=128,
        float32_in_engines=("linear_attn.A_log",),
        deepstack_free=True,
        sglang_cpu_args=(("mamba_radix_cache_strategy", "no_buffer"), ("disable_overlap_schedule", True)),
    ),
    tiny_variants=("tiny-qwen3.5",),
    tiny_builder="vlmrl.models.tiny.qwen3_5",
    flop_rule="qwen3.5",
    recipe="qwen3_5_geo3k",
    hub_id_pattern=r"qwen3[-_.]5(?!.*-A\d+B)",
)

QWEN3_VL_MOE = replace(
    QWEN3_VL, name="Qwen3-VL-MoE", model_types=("qwen3_vl_moe",),
    experts=Experts(checkpoint_layout="fused-transposed", router_class="Qwen3VLMoeTextTopKRouter"),
    engines=replace(QWEN3_VL.engines, sglang_deepstack_layers=3, sglang_moe_every_layer=True),
    tiny_variants=("tiny-qwen3-vl-moe",), tiny_builder="vlmrl.models.tiny.qwen3_vl_moe",
    recipe="qwen3_vl_moe_geo3k", hub_id_pattern=r"qwen3[-_.]?vl.*-A\d+B",  # Qwen3-VL-30B-A3B: 3B active
)

QWEN3_5_MOE = replace(
    QWEN3_5, name="Qwen3.5-MoE", model_types=("qwen3_5_moe",),
    experts=Experts(checkpoint_layout="per-expert", router_class="Qwen3_5MoeTopKRouter"),
    engines=replace(QWEN3_5.engines, sglang_cpu_needs_amx=True),
    tiny_variants=("tiny-qwen3.5-moe",), tiny_builder="vlmrl.models.tiny.qwen3_5_moe",
    recipe="qwen3_5_moe_geo3k", hub_id_pattern=r"qwen3[-_.]5.*-A\d+B",
)

GLM4V = ModelFamily(
    name="GLM-4.1V",
    model_types=("glm4v",),
    weights=WeightsLayout(
        checkpoint_prefixes=(),  # saved as it sits in memory: model.language_model.*, model.visual.*
        vision_tower="model.visual",
        vision_mergers=("merger",),  # after its `downsample` convolution: the projector into the language model
        fused_projections=("gate_up_proj",),
    ),
    # its mrope sections rotate contiguously (not interleaved), over a partial rotary (as the engines do)
    inputs=InputFormat(image_placeholder="<|image|>", video_placeholder="<|video|>", image_bound_copies=2),
    engines=EngineFacts(text_attention_bias=True),
    tiny_variants=("tiny-glm4v",),
    tiny_builder="vlmrl.models.tiny.glm4v",
    flop_rule="glm4v",
    recipe="glm4_1v_geo3k",
    hub_id_pattern=r"glm-?4\.1v",
)

INTERNVL = ModelFamily(
    name="InternVL3.5",
    model_types=("internvl",),
    weights=WeightsLayout(
        # transformers 5 saves the pre-5 layout, which both engines load: language_model.model.*,
        # language_model.lm_head, vision_tower.*, multi_modal_projector.*
        checkpoint_prefixes=(("model.language_model.", "language_model.model."),
                             ("lm_head.", "language_model.lm_head."), ("model.vision_tower.", "vision_tower."),
                             ("model.multi_modal_projector.", "multi_modal_projector.")),
        vision_tower="model.vision_tower",
        vision_mergers=(),  # no merger inside the tower: pixel shuffle, then the projector below
        vision_blocks="encoder.layer",
        vision_projector="model.multi_modal_projector",
    ),
    inputs=InputFormat(image_placeholder="<IMG_CONTEXT>", video_placeholder="<video>", image_layout="tiles",
                       mrope=False),
    engines=EngineFacts(lora_unserved=(".attention.projection_layer", ".multi_modal_projector."),
                        sglang_prompt_ids=False),
    tiny_variants=("tiny-internvl",),
    tiny_builder="vlmrl.models.tiny.internvl",
    flop_rule="internvl",
    recipe="internvl3_5_geo3k",
    hub_id_pattern=r"internvl",
)

FAMILIES: tuple[ModelFamily, ...] = (QWEN2_5_VL, QWEN3_VL, QWEN3_5, QWEN3_VL_MOE, QWEN3_5_MOE, GLM4V, INTERNVL)


def dense_layers(text_config: Mapping[str, Any]) -> list[int]:
    """The decoder layers of a MoE text config that are dense MLPs by transformers' rule (Qwen3-VL-MoE's
    `Qwen3VLMoeTextDecoderLayer`: listed in mlp_only_layers, or (index + 1) not divisible by decoder_sparse_step);
    [] for a config without experts or without those keys.

    >>> dense_layers({"num_experts": 4, "num_hidden_layers": 4, "mlp_only_layers": [1], "decoder_sparse_step": 2})
    [0, 1, 2]
    >>> dense_layers({"num_hidden_layers": 4})
    []
    """
    if not (text_config.get("num_experts") or text_config.get("num_local_experts")):
        return []
    only = set(text_config.get("mlp_only_layers") or ())
    step = int(text_config.get("decoder_sparse_step") or 1)
    return [i for i in range(int(text_config.get("num_hidden_layers") or 0)) if i in only or (i + 1) % step]


def supported() -> str:
    """'Qwen2.5-VL (qwen2_vl / qwen2_5_vl), Qwen3-VL (qwen3_vl) and Qwen3.5 (qwen3_5)', for error messages."""
    names = [f"{f.name} ({' / '.join(f.model_types)})" for f in FAMILIES]
    return ", ".join(names[:-1]) + " and " + names[-1]


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


def family_for_hub_id(repo_id: str) -> ModelFamily | None:
    """The family whose `hub_id_pattern` a hub id matches (None: no family's; ValueError: more than one's, which the
    patterns must rule out).

    >>> family_for_hub_id("Qwen/Qwen3-VL-30B-A3B-Instruct").name, family_for_hub_id("OpenGVLab/InternVL3_5-8B-HF").name
    ('Qwen3-VL-MoE', 'InternVL3.5')
    >>> family_for_hub_id("llava-hf/llava-1.5-7b-hf") is None
    True
    """
    found = [family for family in FAMILIES if re.search(family.hub_id_pattern, repo_id, re.IGNORECASE)]
    if len(found) > 1:
        raise ValueError(f"{repo_id!r} matches the hub id patterns of {', '.join(f.name for f in found)}: make them "
                         "exclusive in vlmrl.models.families")
    return found[0] if found else None


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


def cpu_has_amx() -> bool:
    """Whether this CPU has Intel AMX tiles (what SGLang's CPU backend needs for some layers)."""
    import torch

    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def mrope_interleaved(model_config: Mapping[str, Any]) -> bool:
    """Whether config.json's text rope parameters ask for interleaved mrope sections (what the engines read)."""
    text = model_config.get("text_config") or model_config
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key) or model_config.get(key) or {}
        if isinstance(rope, Mapping) and rope.get("mrope_interleaved"):
            return True
    return False


def attention_interval(text_config: Mapping[str, Any]) -> int | None:
    """The `full_attention_interval` that gives the text config's `layer_types` (every interval-th layer full
    attention, the others linear), or None when no interval gives them (or the config has none).

    >>> attention_interval({"layer_types": ["linear_attention"] * 3 + ["full_attention"]} )
    4
    >>> attention_interval({"layer_types": ["full_attention", "linear_attention"]}) is None
    True
    """
    types = text_config.get("layer_types")
    if not types:
        return None
    interval = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
    expected = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(len(types))]
    return interval if list(types) == expected else None


def _attention_interval_problems(name: str, model_config: Mapping[str, Any]) -> list[str]:
    """A hybrid config whose `full_attention_interval` is missing or disagrees with its `layer_types`: transformers
    and vLLM build the layers from layer_types, SGLang from the interval alone (sglang 0.5.23's Qwen3-Next config;
    without it SGLang does not start)."""
    text = model_config.get("text_config") or model_config
    types = text.get("layer_types")
    if not types:
        return []
    interval, given = attention_interval(text), text.get("full_attention_interval")
    if interval is None:
        return [f"{name} config whose layer_types {list(types)} no full_attention_interval can express: SGLang builds "
                "its layers from that interval alone, so it cannot serve this model (vLLM and transformers can)"]
    if given != interval:
        return [f"{name} config with full_attention_interval={given!r} where its layer_types say {interval}: "
                "transformers and vLLM build the layers from layer_types, SGLang from the interval alone (a "
                f"different model, or no start when it is missing); set \"full_attention_interval\": {interval} in "
                "text_config"]
    return []
