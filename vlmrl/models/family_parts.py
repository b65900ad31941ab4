"""The parts of a model family's entry (`vlmrl.models.families.ModelFamily`), each a record of one concern:

- `WeightsLayout`: where the weights sit, in memory (transformers 5) and in the checkpoints the engines load: the
  checkpoint prefixes weight sync renames with, the vision tower, its blocks, mergers and a projector outside it,
  the linear-attention mixers and the projections LoRA adapts beyond Qwen's.
- `InputFormat`: how a prompt, its images and its videos reach the model: placeholders, image layout (patches or
  tiles) and pixel bounds, position ids (3-D mrope or 1-D), a video's timing.
- `EngineFacts`: what vLLM and SGLang do otherwise for the family, or need told, to compute what transformers
  computes (or to start at all), each with the measurement that showed it.
- `Experts`: the routed experts of a Mixture-of-Experts family.

Each field keeps the measured reason it exists; code elsewhere reads `family.weights.vision_tower`,
`family.inputs.image_layout`, `family.engines.sglang_prompt_ids`, never the family's name.
"""

from __future__ import annotations

from dataclasses import dataclass
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
class WeightsLayout:
    """Where a family's weights sit: module paths in transformers' `...ForConditionalGeneration` and the names its
    checkpoints (what the engines load) give them."""

    checkpoint_prefixes: tuple[tuple[str, str], ...]
    """(prefix of a transformers-5 in-memory parameter name, the prefix the saved checkpoint uses instead): the
    engines load checkpoint names, so weight sync renames parameters with these. Empty: names are the same."""
    vision_tower: str
    """Module path of the vision encoder inside `...ForConditionalGeneration` (patch embed, blocks, mergers)."""
    vision_mergers: tuple[str, ...]
    """Module paths (under the tower) of the patch mergers that project vision features into the language model:
    the final merger, and for Qwen3-VL the deepstack mergers whose outputs are added to the first decoder layers."""
    vision_blocks: str = "blocks"
    """The ModuleList of the tower's transformer blocks, under the tower (InternViT: `encoder.layer`): what
    lora.vision=tower adapts."""
    vision_projector: str | None = None
    """Module path of a projector that sits OUTSIDE the vision tower (InternVL's `model.multi_modal_projector`);
    None: the projectors are the tower's own mergers (`vision_mergers`)."""
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

    @property
    def vision_prefixes(self) -> tuple[str, ...]:
        """Name prefixes of every vision-side module or parameter: the tower's, and a projector's outside it."""
        return tuple(f"{path}." for path in (self.vision_tower, self.vision_projector) if path)

    def checkpoint_name(self, name: str) -> str:
        """A transformers-5 in-memory parameter name -> the name in this family's checkpoints (what engines load).

        >>> from vlmrl.models.families import QWEN2_5_VL, QWEN3_VL
        >>> QWEN2_5_VL.weights.checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight")
        'model.layers.0.mlp.up_proj.weight'
        >>> QWEN2_5_VL.weights.checkpoint_name("model.visual.blocks.0.attn.qkv.bias")
        'visual.blocks.0.attn.qkv.bias'
        >>> QWEN3_VL.weights.checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight")
        'model.language_model.layers.0.mlp.up_proj.weight'
        """
        for memory, saved in self.checkpoint_prefixes:
            if name.startswith(memory):
                return saved + name[len(memory):]
        return name


@dataclass(frozen=True)
class InputFormat:
    """How a family's prompts, images and videos reach the model: the placeholders vlmrl's prompt ids carry, how an
    image becomes pixel values, the position ids and a video's timing. Image sizing facts (patch size, merge size,
    pixel bounds) are not here: they are read from the model's own preprocessor config, the source the engines read
    too."""

    image_placeholder: str = "<|image_pad|>"
    """The token that stands for one image in the prompt ids vlmrl sends (one per image: the engines expand it), and
    that the trainer's ids repeat once per merged patch (config.json's image_token_id names it too)."""
    video_placeholder: str = "<|video_pad|>"
    """The same for a video."""
    image_layout: str = "patches"
    """How an image reaches the model. "patches": resized to a multiple of patch x merge, `pixel_values` (patches,
    C*T*p*p) with a (t, h, w) `image_grid_thw` per image, one placeholder per merged patch (Qwen-VL, GLM-4.1V).
    "tiles": cut into square tiles by its aspect ratio (+ a thumbnail), `pixel_values` (tiles, C, S, S) with no
    grid, the placeholder expanded to `<img>` + tokens-per-tile x tiles placeholders + `</img>` (InternVL)."""
    image_bound_copies: int = 1
    """How many copies of an image the image processor's pixel bounds (`size.shortest_edge` / `longest_edge`) count:
    GLM-4.1V's compares them with t x h x w where an image is t = 2 temporal copies, so an image's own h x w bounds
    are half the config's; Qwen's compare h x w."""
    mrope: bool = True
    """Position ids are 3-D mrope (t, h, w) rows; False: plain 1-D positions (InternVL's Qwen3). vlmrl's batches
    keep three rows either way (equal rows for 1-D) and the forward takes the first."""
    interleaved_mrope: bool = False
    """transformers interleaves the three mrope frequency sections (t, h, w, t, h, w...) for this family whatever
    the config says; vLLM and SGLang interleave only when the text config's rope parameters carry
    `mrope_interleaved: true`, and otherwise drift from the trainer (about 0.1 nats per token, measured on a tiny
    Qwen3-VL) while still agreeing with each other."""
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

    @property
    def timestamps_in_text(self) -> bool:
        """A video's timing is `<x.x seconds>` text per temporal patch, its grid split per temporal patch
        (`video_timing == "timestamps"`, Qwen3-VL)."""
        return self.video_timing == "timestamps"

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


@dataclass(frozen=True)
class EngineFacts:
    """What vLLM and SGLang do otherwise for a family, or must be told, so that they compute what transformers
    computes (or start at all); `ModelFamily.engine_problems`, `engine_overrides` and `cpu_engine_problems` turn
    them into refusals and start-up settings. Defaults: an engine that needs nothing beyond vlmrl's common
    settings."""

    sglang_prompt_ids: bool = True
    """SGLang takes this family's requests as prompt ids + images. False (InternVL): sglang 0.5.23 has no native
    class for transformers' InternVL format and serves it through its Transformers fallback, whose processor takes
    chat TEXT only (an id list reaches the HF processor as text: "expected string or bytes-like object, got
    'int'"): vlmrl sends the same prompt ids decoded to text, and checks that the engine's expanded prompt is the
    trainer's (`vlmrl.rollout.sglang`)."""
    sglang_caller_mm_hashes: bool = True
    """SGLang takes caller-supplied `mm_hashes` for this family's images (vlmrl salts them with the weight version so
    that no multimodal cache serves features of old vision weights). Not Qwen3-VL with sglang 0.5.23: its image path
    pads the prompt with SGLang's own hash before the caller's replaces it, and the scheduler dies on the mismatch
    (`index_copy_(): index N is out of bounds`); the engine must then run without a multimodal embedding cache."""
    sglang_video_per_step_grids: bool = False
    """SGLang must get a video's grid split into one (1, h, w) row per temporal patch, with vlmrl's position ids.
    sglang 0.5.23's Qwen2.5-VL vision tower gives its full-attention blocks one sequence per VIDEO (cu_seqlens from
    t*h*w) where transformers, vLLM and the released model attend within each temporal patch (h*w tokens): on any
    video of more than one temporal patch (over 2 frames) its video features differ (measured on the tiny model in
    fp32: 1e-3 to 7e-3 nats per token against HF; HF with SGLang's attention span matches SGLang to 2e-6). With
    split grids its tower attends per temporal patch; its own position ids would then read t separate videos, so
    vlmrl sends the prompt's mrope positions (the trainer's) with them."""
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
    deepstack_free: bool = False
    """The vision tower has no deepstack mergers, and the config must say so to SGLang (`deepstack_visual_indexes:
    []` in vision_config, as the released Qwen3.5 configs do): SGLang builds Qwen3.5's tower from Qwen3-VL's config
    class, whose default is [8, 16, 24], and then scatters a deepstack embedding three times the hidden size where
    the model has none (measured: the scheduler dies on the first image, "index_copy_(): ... source slice shape:
    0"). transformers and vLLM read no such key for Qwen3.5."""
    text_attention_bias: bool = False
    """transformers' text attention of this family always has q/k/v biases, and vLLM builds them only when the text
    config says `attention_bias: true` (GLM-4.1V: vLLM's glm4.py reads it with default false and then loads the
    checkpoint's biases into nothing, without an error; measured 0.22 nats off transformers on text alone)."""
    cpu_engine_dtype: str | None = None
    """The one dtype vLLM and SGLang run this family in on CPU (None: any). Qwen3.5: bfloat16, since vLLM's CPU Gated
    DeltaNet op asserts it ("CPU GDN attention requires BF16"). rollout.dtype=auto then means it on CPU, for every
    backend of the run (the hf reference too, so that a comparison is of one dtype); float32 is refused."""
    cpu_linear_head_dim: int | None = None
    """The only linear-attention key / value head size vLLM's CPU kernel takes (128, as in every released Qwen3.5;
    32 fails with "Unexpected head dim size"); None: no such limit."""
    sglang_cpu_needs_amx: bool = False
    """SGLang serves this family on a CPU only with Intel AMX. Qwen3.5-MoE: sglang 0.5.23's Qwen2-MoE block gates the
    shared expert with a Triton kernel (`fused_gate_sigmoid_mul_add`) on every CPU without the AMX backend, and Triton
    has no CPU driver ("0 active drivers"): the scheduler dies on the first forward. vLLM serves it on any CPU."""
    sglang_cpu_args: tuple[tuple[str, Any], ...] = ()
    """SGLang server arguments this family needs on CPU. Qwen3.5: `mamba_radix_cache_strategy=no_buffer` (the
    default extra_buffer needs Mamba cache-state snapshots, which the CPU platform lacks) and, because no_buffer
    refuses it, `disable_overlap_schedule`."""
    float32_in_engines: tuple[str, ...] = ()
    """Name parts of parameters the engines keep in float32 whatever their dtype: weight sync sends these in float32
    (a bfloat16 copy would round them, and the engine would then compute otherwise than from the checkpoint it
    loaded). Qwen3.5: the Gated DeltaNet decay `linear_attn.A_log` (vLLM 0.32 holds it in float32 in a bfloat16
    engine; measured: pushed as bfloat16, the tiny Qwen3.5-MoE's greedy outputs no longer equal its freshly loaded
    ones)."""
    lora_unserved: tuple[str, ...] = ()
    """Name parts of adapted layers vLLM's LoRA serving of this family refuses (vLLM 0.32's InternS1 takes LoRA on
    q/k/v/o, the MLPs and fc1/fc2 only: "expected target modules in {...}" for InternViT's attention
    `projection_layer` and the `multi_modal_projector` linears): such adapters sync merged."""
