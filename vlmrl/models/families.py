"""What vlmrl must know about each supported model family, in one place.

A `ModelFamily` holds the facts that differ between Qwen2-VL / Qwen2.5-VL, Qwen3-VL and Qwen3.5 and that more than
one component needs: the checkpoint layout the engines load (weight sync renames the trainer's parameters into it),
the engine settings without which vLLM and SGLang compute something other than transformers (or do not start), where
the vision tower, its merger and (Qwen3-VL) its deepstack mergers sit in the model, and (Qwen3.5) which decoder
layers are linear attention. Code elsewhere asks the family of the model it holds (`family_of(config)`) instead of
testing model types itself.

Image sizing facts (patch size, merge size, pixel bounds) are not here: they are read from the model's own
preprocessor config, which is the source the engines read too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Experts:
    """The routed experts of a Mixture-of-Experts family (`vlmrl.models.experts` holds the layouts)."""

    checkpoint_layout: str
    """How its checkpoints hold the experts, the layout transformers, vLLM and SGLang all load: "fused-transposed"
    (Qwen3-VL-MoE: transformers 5.19 saves the in-memory orientation, which neither engine loads, so vlmrl writes
    and syncs the hub's) or "per-expert" (Qwen3.5-MoE, as transformers saves it)."""
    router_class: str
    """transformers' router module (`forward(hidden) -> (logits, top-k weights, top-k ids)`): what routing replay
    and the routing metrics hook."""


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
    flop_rule: str | None = None
    """How `vlmrl.models.flops` counts this family's model FLOPs (a key of its `RULES`: the language model's mixers
    and MLPs, the vision tower's blocks and mergers); None: no rule, so a run logs no MFU (and the FLOP test, which
    holds every family's rule to torch's FlopCounterMode on its embedded model, fails)."""
    recipe_by_size: tuple[tuple[str, str], ...] = ()
    """(pattern on the model's name or folder, recipe) for sizes the family's `recipe` does not fit, the first
    match winning (Qwen2.5-VL named 32B or 72B: a bfloat16 actor and optimizer and the engine across 8 devices, as
    EasyR1's baseline runs them)."""
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

    linear_attention: str | None = None
    """Attribute of the decoder layers whose token mixer is linear attention (Qwen3.5's Gated DeltaNet,
    `linear_attn`); None = every layer attends. Such a layer carries a recurrent state and a causal convolution from
    token to token: a packed forward must restart both at every row (`vlmrl.actor.packing`), and LoRA adapts its
    projections (`linear_attention_projections`)."""
    linear_attention_projections: tuple[str, ...] = ()
    """The Linear layers of a linear-attention mixer (transformers-5 names): what LoRA adapts there."""
    fused_projections: tuple[str, ...] = ()
    """Language-model projections under names of their own that the default LoRA targets adapt besides Qwen's
    q/k/v/o and gate/up/down (GLM-4.1V's MLP is one fused `gate_up_proj`)."""
    cpu_engine_dtype: str | None = None
    """The one dtype vLLM and SGLang run this family in on CPU (None: any). Qwen3.5: bfloat16, since vLLM's CPU Gated
    DeltaNet op asserts it ("CPU GDN attention requires BF16"). rollout.dtype=auto then means it on CPU, for every
    backend of the run (the hf reference too, so that a comparison is of one dtype); float32 is refused."""
    cpu_linear_head_dim: int | None = None
    """The only linear-attention key / value head size vLLM's CPU kernel takes (128, as in every released Qwen3.5;
    32 fails with "Unexpected head dim size"); None: no such limit."""
    deepstack_free: bool = False
    """The vision tower has no deepstack mergers, and the config must say so to SGLang (`deepstack_visual_indexes:
    []` in vision_config, as the released Qwen3.5 configs do): SGLang builds Qwen3.5's tower from Qwen3-VL's config
    class, whose default is [8, 16, 24], and then scatters a deepstack embedding three times the hidden size where
    the model has none (measured: the scheduler dies on the first image, "index_copy_(): ... source slice shape:
    0"). transformers and vLLM read no such key for Qwen3.5."""
    sglang_cpu_args: tuple[tuple[str, Any], ...] = ()
    """SGLang server arguments this family needs on CPU. Qwen3.5: `mamba_radix_cache_strategy=no_buffer` (the
    default extra_buffer needs Mamba cache-state snapshots, which the CPU platform lacks) and, because no_buffer
    refuses it, `disable_overlap_schedule`."""
    experts: Experts | None = None
    """The routed experts (Mixture-of-Experts families); None: a dense model."""
    float32_in_engines: tuple[str, ...] = ()
    """Name parts of parameters the engines keep in float32 whatever their dtype: weight sync sends these in float32
    (a bfloat16 copy would round them, and the engine would then compute otherwise than from the checkpoint it
    loaded). Qwen3.5: the Gated DeltaNet decay `linear_attn.A_log` (vLLM 0.32 holds it in float32 in a bfloat16
    engine; measured: pushed as bfloat16, the tiny Qwen3.5-MoE's greedy outputs no longer equal its freshly loaded
    ones)."""
    sglang_deepstack_layers: int | None = None
    """The number of deepstack embeddings SGLang's text model adds whatever the config says (None: it reads the
    config). Qwen3-VL-MoE: 3 (sglang 0.5.23 hard-codes `range(3)`, the released models' count); a model with another
    count kills the scheduler on its first image ("The size of tensor a (128) must match the size of tensor b (0)"
    in `add_to_output`) or, with more, drops the extra ones silently."""
    sglang_moe_every_layer: bool = False
    """SGLang builds every decoder layer of this family as a MoE block, whatever the config says. Qwen3-VL-MoE:
    sglang 0.5.23's `Qwen3MoeDecoderLayer.stage_facts` hard-codes `is_layer_sparse = True`, so a config with dense
    layers (`mlp_only_layers`, or `decoder_sparse_step` > 1, which transformers and vLLM follow) gets experts it
    never loads in those layers (its loader skips the dense MLP's weights without an error): measured, 0 of 7
    greedy requests equal transformers, and first tokens outside transformers' top-5, differing from run to run."""
    sglang_cpu_needs_amx: bool = False
    """SGLang serves this family on a CPU only with Intel AMX. Qwen3.5-MoE: sglang 0.5.23's Qwen2-MoE block gates the
    shared expert with a Triton kernel (`fused_gate_sigmoid_mul_add`) on every CPU without the AMX backend, and Triton
    has no CPU driver ("0 active drivers"): the scheduler dies on the first forward. vLLM serves it on any CPU."""

    image_placeholder: str = "<|image_pad|>"
    """The token that stands for one image in the prompt ids vlmrl sends (one per image: the engines expand it), and
    that the trainer's ids repeat once per merged patch (config.json's image_token_id names it too)."""
    video_placeholder: str = "<|video_pad|>"
    """The same for a video."""
    image_bound_copies: int = 1
    """How many copies of an image the image processor's pixel bounds (`size.shortest_edge` / `longest_edge`) count:
    GLM-4.1V's compares them with t x h x w where an image is t = 2 temporal copies, so an image's own h x w bounds
    are half the config's; Qwen's compare h x w."""
    text_attention_bias: bool = False
    """transformers' text attention of this family always has q/k/v biases, and vLLM builds them only when the text
    config says `attention_bias: true` (GLM-4.1V: vLLM's glm4.py reads it with default false and then loads the
    checkpoint's biases into nothing, without an error; measured 0.22 nats off transformers on text alone)."""
    image_layout: str = "patches"
    """How an image reaches the model. "patches": resized to a multiple of patch x merge, `pixel_values` (patches,
    C*T*p*p) with a (t, h, w) `image_grid_thw` per image, one placeholder per merged patch (Qwen-VL, GLM-4.1V).
    "tiles": cut into square tiles by its aspect ratio (+ a thumbnail), `pixel_values` (tiles, C, S, S) with no
    grid, the placeholder expanded to `<img>` + tokens-per-tile x tiles placeholders + `</img>` (InternVL)."""
    mrope: bool = True
    """Position ids are 3-D mrope (t, h, w) rows; False: plain 1-D positions (InternVL's Qwen3). vlmrl's batches
    keep three rows either way (equal rows for 1-D) and the forward takes the first."""
    vision_blocks: str = "blocks"
    """The ModuleList of the tower's transformer blocks, under the tower (InternViT: `encoder.layer`): what
    lora.vision=tower adapts."""
    vision_projector: str | None = None
    """Module path of a projector that sits OUTSIDE the vision tower (InternVL's `model.multi_modal_projector`);
    None: the projectors are the tower's own mergers (`vision_mergers`)."""
    lora_unserved: tuple[str, ...] = ()
    """Name parts of adapted layers vLLM's LoRA serving of this family refuses (vLLM 0.32's InternS1 takes LoRA on
    q/k/v/o, the MLPs and fc1/fc2 only: "expected target modules in {...}" for InternViT's attention
    `projection_layer` and the `multi_modal_projector` linears): such adapters sync merged."""
    sglang_prompt_ids: bool = True
    """SGLang takes this family's requests as prompt ids + images. False (InternVL): sglang 0.5.23 has no native
    class for transformers' InternVL format and serves it through its Transformers fallback, whose processor takes
    chat TEXT only (an id list reaches the HF processor as text: "expected string or bytes-like object, got
    'int'"): vlmrl sends the same prompt ids decoded to text, and checks that the engine's expanded prompt is the
    trainer's (`vlmrl.rollout.sglang`)."""

    @property
    def timestamps_in_text(self) -> bool:
        """A video's timing is `<x.x seconds>` text per temporal patch, its grid split per temporal patch
        (`video_timing == "timestamps"`, Qwen3-VL)."""
        return self.video_timing == "timestamps"

    @property
    def vision_prefixes(self) -> tuple[str, ...]:
        """Name prefixes of every vision-side module or parameter: the tower's, and a projector's outside it."""
        return tuple(f"{path}." for path in (self.vision_tower, self.vision_projector) if path)

    def recipe_for(self, model: str) -> str:
        """The geo3k recipe for a model of this family named `model` (a hub id or a folder): its size's own recipe
        where `recipe_by_size` has one, else the family's.

        >>> QWEN2_5_VL.recipe_for("Qwen/Qwen2.5-VL-72B-Instruct"), QWEN2_5_VL.recipe_for("Qwen/Qwen2.5-VL-7B-Instruct")
        ('qwen2_5_vl_32b_geo3k', 'qwen2_5_vl_geo3k')
        """
        return next((recipe for pattern, recipe in self.recipe_by_size if re.search(pattern, model, re.IGNORECASE)),
                    self.recipe)

    def forward_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """vlmrl's model inputs -> the keyword arguments this family's transformers forward takes. vlmrl keeps one
        shape for every family: position ids as 3 mrope rows ((3, b, l); packed (4, 1, T), row 0 the text
        positions), and an `image_grid_thw` row per image. A 1-D family gets the first row ((b, l); packed the text
        row); a tiles family gets no grid (its `pixel_values` rows are whole tiles) and no `mm_token_type_ids`."""
        out = dict(inputs)
        if not self.mrope and out.get("position_ids") is not None:
            out["position_ids"] = out["position_ids"][0]
        if self.image_layout == "tiles":
            out.pop("image_grid_thw", None)
            out.pop("mm_token_type_ids", None)
        return out

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

    def engine_problems(self, model_config: Mapping[str, Any], backend: str | None = None) -> list[str]:
        """Why vLLM / SGLang started on this config would compute something other than transformers (empty: none).
        `backend` (vllm, sglang, sglang-server): that engine's problems only; None: either engine's.

        vlmrl starts the engines with `engine_overrides`, which settle these where the config allows; an engine
        with a problem left after them is refused before it starts, and a server given by URL is checked for them:
        both engines would otherwise silently disagree with the trainer's logprobs (or with each other).
        """
        problems = []
        sglang = backend is None or backend.startswith("sglang")
        if self.linear_attention is not None and sglang:
            problems += _attention_interval_problems(self.name, model_config)
        if self.deepstack_free and sglang and (model_config.get("vision_config") or {}).get(
                "deepstack_visual_indexes") != []:
            problems.append(f"{self.name} config without `deepstack_visual_indexes: []` in vision_config: SGLang then "
                            "assumes Qwen3-VL's deepstack layers [8, 16, 24], which this model does not have (its "
                            "scheduler dies on the first image, or adds features no layer of the model computes); "
                            'add "deepstack_visual_indexes": [] to vision_config, as the released configs have')
        deepstack = (model_config.get("vision_config") or {}).get("deepstack_visual_indexes")
        if self.sglang_deepstack_layers is not None and sglang and deepstack is not None \
                and len(deepstack) != self.sglang_deepstack_layers:
            problems.append(f"{self.name} config with {len(deepstack)} deepstack layers ({deepstack}): SGLang's "
                            f"{self.name} adds exactly {self.sglang_deepstack_layers}, as the released models have, "
                            "whatever the config says (its scheduler dies on the first image, or drops the extra "
                            "ones); use vllm or the hf backend for this model")
        text = model_config.get("text_config") or model_config
        dense = dense_layers(text)
        if self.sglang_moe_every_layer and sglang and dense:
            problems.append(f"{self.name} config with dense decoder layers {dense} (mlp_only_layers / "
                            f"decoder_sparse_step): SGLang's {self.name} builds every layer as MoE and leaves those "
                            "layers' experts uninitialised (it computes another model, without an error); use vllm "
                            "or the hf backend for this model")
        vllm = backend is None or backend == "vllm"
        if self.text_attention_bias and vllm and text.get("attention_bias") is not True:
            problems.append(f"{self.name} config without `attention_bias: true` in text_config: transformers' "
                            f"{self.name} text attention always has q/k/v biases, vLLM builds them only when the "
                            "config says so (and then drops the checkpoint's biases without an error: about 0.2 nats "
                            'per token off the trainer). The released configs carry it; add "attention_bias": true '
                            "to text_config in config.json.")
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
        overrides: dict[str, Any] = {}
        text = model_config.get("text_config") or model_config
        nested = "text_config" in model_config
        if self.interleaved_mrope and not mrope_interleaved(model_config):
            rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
            if "rope_theta" not in rope and "rope_theta" in text:
                rope["rope_theta"] = text["rope_theta"]
            rope["mrope_interleaved"] = True
            overrides = {"text_config": {"rope_parameters": rope}, "rope_parameters": rope} if nested \
                else {"rope_parameters": rope}
            if self.linear_attention is not None:
                # sglang's Qwen3.5 text config reads the rope from `rope_scaling` (it copies rope_parameters there
                # when it is built, before any override)
                overrides["text_config"]["rope_scaling"] = rope
        if self.deepstack_free and (model_config.get("vision_config") or {}).get("deepstack_visual_indexes") != []:
            overrides["vision_config"] = {"deepstack_visual_indexes": []}
        if self.text_attention_bias and text.get("attention_bias") is not True:
            overrides.setdefault("text_config", {})["attention_bias"] = True
        interval = attention_interval(text)
        if self.linear_attention is not None and interval is not None \
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
        problems = []
        if self.cpu_engine_dtype is not None and dtype != self.cpu_engine_dtype:
            problems.append(
                f"{self.name} runs in {self.cpu_engine_dtype} on CPU engines (vLLM asserts \"CPU GDN attention "
                f"requires BF16\"; SGLang's CPU kernels are its twins): got dtype={dtype}. Set rollout.dtype="
                f"{self.cpu_engine_dtype} or auto, and compare with the hf reference in the same dtype")
        if self.sglang_cpu_needs_amx and backend.startswith("sglang") and not cpu_has_amx():
            problems.append(
                f"{backend} serves {self.name} on a CPU only with Intel AMX (sglang's shared-expert gate is a Triton "
                "kernel elsewhere, and Triton has no CPU driver): use vllm or the hf backend on this CPU, or a GPU")
        text = model_config.get("text_config") or model_config
        if backend == "vllm" and self.cpu_linear_head_dim is not None:
            sizes = {key: text.get(key, self.cpu_linear_head_dim)
                     for key in ("linear_key_head_dim", "linear_value_head_dim")}
            wrong = {key: size for key, size in sizes.items() if size != self.cpu_linear_head_dim}
            if wrong:
                problems.append(
                    f"vllm on CPU takes linear-attention heads of {self.cpu_linear_head_dim} only (its "
                    f"chunk_gated_delta_rule_cpu raises \"Unexpected head dim size\"), this config has {wrong}: "
                    "use the sglang or hf backend, or a GPU")
        return problems


QWEN2_5_VL = ModelFamily(
    name="Qwen2.5-VL",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    # transformers 5 nests the decoder under model.language_model and the tower under model.visual; it saves (and
    # the engines load) the Qwen2-VL layout: model.layers.*, visual.*
    checkpoint_prefixes=(("model.visual.", "visual."), ("model.language_model.", "model.")),
    vision_tower="model.visual",
    vision_mergers=("merger",),
    interleaved_mrope=False,
    tiny_variants=("tiny", "tiny-large"),
    tiny_builder="vlmrl.models.tiny.qwen2_5_vl",
    recipe="qwen2_5_vl_geo3k",
    hub_id_pattern=r"qwen2(\.5)?[-_.]?vl",
    recipe_by_size=((r"-(32|72)B", "qwen2_5_vl_32b_geo3k"),),
    flop_rule="qwen2-vl",
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
    tiny_variants=("tiny-qwen3-vl",),
    tiny_builder="vlmrl.models.tiny.qwen3_vl",
    recipe="qwen3_vl_geo3k",
    hub_id_pattern=r"qwen3[-_.]?vl(?!.*-A\d+B)",  # no active-parameter count: dense
    flop_rule="qwen3-vl",
    sglang_caller_mm_hashes=False,
    video_timing="timestamps",
    video_bounds_per_video=True,
)

QWEN3_5 = ModelFamily(
    name="Qwen3.5",
    model_types=("qwen3_5",),
    checkpoint_prefixes=(),  # saved as it sits in memory: model.language_model.*, model.visual.*
    vision_tower="model.visual",
    vision_mergers=("merger",),  # Qwen3-VL's tower without its deepstack mergers
    interleaved_mrope=True,
    tiny_variants=("tiny-qwen3.5",),
    tiny_builder="vlmrl.models.tiny.qwen3_5",
    recipe="qwen3_5_geo3k",
    hub_id_pattern=r"qwen3[-_.]5(?!.*-A\d+B)",
    flop_rule="qwen3.5",
    sglang_caller_mm_hashes=False,  # SGLang runs it through Qwen3-VL's multimodal path
    video_timing="timestamps",
    video_bounds_per_video=True,
    linear_attention="linear_attn",
    linear_attention_projections=("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    cpu_engine_dtype="bfloat16",
    cpu_linear_head_dim=128,
    float32_in_engines=("linear_attn.A_log",),
    deepstack_free=True,
    sglang_cpu_args=(("mamba_radix_cache_strategy", "no_buffer"), ("disable_overlap_schedule", True)),
)

QWEN3_VL_MOE = replace(
    QWEN3_VL, name="Qwen3-VL-MoE", model_types=("qwen3_vl_moe",),
    tiny_variants=("tiny-qwen3-vl-moe",), tiny_builder="vlmrl.models.tiny.qwen3_vl_moe",
    recipe="qwen3_vl_moe_geo3k", hub_id_pattern=r"qwen3[-_.]?vl.*-A\d+B",  # Qwen3-VL-30B-A3B: 3B active
    experts=Experts(checkpoint_layout="fused-transposed", router_class="Qwen3VLMoeTextTopKRouter"),
    sglang_deepstack_layers=3,
    sglang_moe_every_layer=True,
)

QWEN3_5_MOE = replace(
    QWEN3_5, name="Qwen3.5-MoE", model_types=("qwen3_5_moe",),
    tiny_variants=("tiny-qwen3.5-moe",), tiny_builder="vlmrl.models.tiny.qwen3_5_moe",
    recipe="qwen3_5_moe_geo3k", hub_id_pattern=r"qwen3[-_.]5.*-A\d+B",
    experts=Experts(checkpoint_layout="per-expert", router_class="Qwen3_5MoeTopKRouter"),
    sglang_cpu_needs_amx=True,
)

GLM4V = ModelFamily(
    name="GLM-4.1V",
    model_types=("glm4v",),
    checkpoint_prefixes=(),  # saved as it sits in memory: model.language_model.*, model.visual.*
    vision_tower="model.visual",
    vision_mergers=("merger",),  # after its `downsample` convolution: the projector into the language model
    interleaved_mrope=False,  # its mrope sections rotate contiguously, over a partial rotary (as the engines do)
    tiny_variants=("tiny-glm4v",),
    tiny_builder="vlmrl.models.tiny.glm4v",
    recipe="glm4_1v_geo3k",
    hub_id_pattern=r"glm-?4\.1v",
    flop_rule="glm4v",
    image_placeholder="<|image|>",
    video_placeholder="<|video|>",
    image_bound_copies=2,
    text_attention_bias=True,
    fused_projections=("gate_up_proj",),
)

INTERNVL = ModelFamily(
    name="InternVL3.5",
    model_types=("internvl",),
    # transformers 5 saves the pre-5 layout, which both engines load: language_model.model.*, language_model.lm_head,
    # vision_tower.*, multi_modal_projector.*
    checkpoint_prefixes=(("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                         ("model.vision_tower.", "vision_tower."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")),
    vision_tower="model.vision_tower",
    vision_mergers=(),  # no merger inside the tower: pixel shuffle, then the projector below
    vision_blocks="encoder.layer",
    vision_projector="model.multi_modal_projector",
    lora_unserved=(".attention.projection_layer", ".multi_modal_projector."),
    interleaved_mrope=False,
    tiny_variants=("tiny-internvl",),
    tiny_builder="vlmrl.models.tiny.internvl",
    recipe="internvl3_5_geo3k",
    hub_id_pattern=r"internvl",
    flop_rule="internvl",
    image_placeholder="<IMG_CONTEXT>",
    video_placeholder="<video>",
    image_layout="tiles",
    mrope=False,
    sglang_prompt_ids=False,
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
