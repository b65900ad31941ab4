"""What a model is made of, for the memory plan (`vlmrl.trainer.memory_plan`): every parameter tensor with its
shape, the FSDP2 unit it is sharded in and whether the run trains it, and the widths its activations and KV cache
take, read from the model itself instantiated on torch's `meta` device (no memory, no weights; exact for any
architecture transformers builds) and from its config.

    facts = model_facts(config.actor)     # config.actor.model_path: an embedded name, a folder or a hub id

The model's config.json comes from `vlmrl.models.released.model_config` (no download). The parameters are the ones
the trainer holds: tied embeddings once, LoRA adapters added by vlmrl's own `apply_lora` (so the plan counts the
adapters the run would make), the frozen vision tower and the LoRA base marked frozen.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass, field
from typing import Any

from vlmrl.actor.config import ActorConfig
from vlmrl.models.families import family_of
from vlmrl.models.released import config_object, model_config

ROOT_UNIT = ""
"""The FSDP2 root unit: every parameter outside a sharded block (embeddings, lm_head, norms, patch embedding)."""


@dataclass(frozen=True)
class TensorFact:
    """One parameter tensor of the policy as the trainer holds it."""

    name: str
    shape: tuple[int, ...]
    unit: str
    """The FSDP2 unit it is sharded in: a block's module path (`vlmrl.distributed.fsdp.shardable_blocks`), or
    ROOT_UNIT."""
    trainable: bool
    """The run trains it (not the frozen vision tower, not a LoRA base weight)."""
    kv: bool = False
    """A text attention layer's k or v projection: an engine at a tensor-parallel degree above the number of KV heads
    keeps a whole head of it on each rank (vLLM replicates KV heads then)."""

    @property
    def numel(self) -> int:
        out = 1
        for size in self.shape:
            out *= size
        return out

    def shard_numel(self, dp: int) -> int:
        """Elements on the first rank of `dp` when FSDP2 shards it: dim 0 split in `dp` chunks, padded to equal
        ceil(dim 0 / dp) rows (FSDP2's `fully_shard`); a 0-d tensor stays whole."""
        if not self.shape or dp == 1:
            return self.numel
        rows = -(-self.shape[0] // dp)
        return self.numel // self.shape[0] * rows


@dataclass(frozen=True)
class TextShape:
    """The language model's widths (from its config; layer kinds counted from the built model)."""

    hidden: int
    layers: int
    attention_layers: int
    """Layers with softmax attention (and a KV cache); the rest are linear attention (Qwen3.5's Gated DeltaNet)."""
    moe_layers: int
    """Layers whose MLP is a mixture of experts (the rest are dense)."""
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    """Dense MLP width (0 when every layer is MoE and the config names none)."""
    vocab: int
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    qk_norm: bool = False
    """The attention normalises q and k per head (Qwen3's q_norm / k_norm): two more RMSNorms' tensors saved."""


@dataclass(frozen=True)
class VisionShape:
    """The vision tower's widths."""

    depth: int
    hidden: int
    heads: int
    intermediate: int
    gated_mlp: bool
    """SwiGLU (gate, up, down: Qwen2.5-VL, GLM-4.1V) or a plain two-layer MLP (Qwen3-VL, InternViT)."""
    patch_values: int
    """Pixel values per patch (channels x temporal patch x patch^2)."""
    patches_per_token: int
    """Vision patches per language-model token (merge^2; InternVL: 1 / downsample_ratio^2)."""
    token_pixels: int
    """Image pixels per language-model token ((patch x merge)^2; InternVL: a 448-pixel tile's 256 tokens)."""
    mergers: int
    """Outputs projected into the language model: the merger, and Qwen3-VL's deepstack mergers."""


@dataclass(frozen=True)
class ModelFacts:
    """A model as the memory plan needs it."""

    model: str
    family: str
    source: str
    """Where its config.json was read."""
    tensors: tuple[TensorFact, ...]
    text: TextShape
    vision: VisionShape | None
    config: dict[str, Any] = field(default_factory=dict, compare=False)
    """Its config.json (what `vlmrl.config.tensor_parallel_problems` reads: the heads an engine splits)."""

    @property
    def parameters(self) -> int:
        """Every parameter the trainer holds (LoRA adapters included)."""
        return sum(t.numel for t in self.tensors)

    @property
    def base_parameters(self) -> int:
        """The model's own parameters: what the engine and a checkpoint hold (no adapters)."""
        return sum(t.numel for t in self.tensors if ".lora_" not in t.name)

    @property
    def trainable(self) -> int:
        return sum(t.numel for t in self.tensors if t.trainable)

    def units(self) -> dict[str, int]:
        """Elements per FSDP2 unit (ROOT_UNIT included)."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.unit] = out.get(t.unit, 0) + t.numel
        return out

    def trainable_units(self) -> dict[str, int]:
        """Trainable elements per FSDP2 unit (their unsharded gradients exist while the unit's backward runs)."""
        out: dict[str, int] = {}
        for t in self.tensors:
            if t.trainable:
                out[t.unit] = out.get(t.unit, 0) + t.numel
        return out


def text_shape(text: Any, model: Any, family: Any) -> TextShape:
    """The language model's widths: `text` its transformers config, layer kinds counted on the built `model`."""
    layers = _decoder_layers(model, family)
    mixer = family.weights.linear_attention
    linear = sum(1 for layer in layers if mixer and hasattr(layer, mixer))
    moe = sum(1 for layer in layers if hasattr(getattr(layer, "mlp", None), "experts"))
    qk_norm = any(hasattr(getattr(layer, "self_attn", None), "q_norm") for layer in layers)
    heads = text.num_attention_heads
    return TextShape(
        hidden=text.hidden_size, layers=len(layers), attention_layers=len(layers) - linear, moe_layers=moe,
        heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        intermediate=getattr(text, "intermediate_size", None) or 0, vocab=text.vocab_size,
        experts=_first(text, "num_experts", "num_local_experts") if moe else 0,
        top_k=(getattr(text, "num_experts_per_tok", 0) or 0) if moe else 0,
        expert_intermediate=(getattr(text, "moe_intermediate_size", 0) or 0) if moe else 0,
        shared_expert_intermediate=getattr(text, "shared_expert_intermediate_size", 0) or 0,
        linear_key_heads=getattr(text, "linear_num_key_heads", 0) if linear else 0,
        linear_value_heads=getattr(text, "linear_num_value_heads", 0) if linear else 0,
        linear_key_dim=getattr(text, "linear_key_head_dim", 0) if linear else 0,
        linear_value_dim=getattr(text, "linear_value_head_dim", 0) if linear else 0,
        linear_conv_kernel=getattr(text, "linear_conv_kernel_dim", 0) if linear else 0, qk_norm=qk_norm)


def vision_shape(config: Any, model: Any, family: Any) -> VisionShape | None:
    """The vision tower's widths (None without one). Config names differ by family (Qwen's depth / num_heads,
    InternViT's num_hidden_layers / num_attention_heads, Qwen2-VL's embed_dim / mlp_ratio)."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return None
    hidden = _first(vision, "embed_dim", "hidden_size")
    intermediate = getattr(vision, "intermediate_size", None) or int(hidden * vision.mlp_ratio)
    patch = _side(vision.patch_size)
    if family.inputs.image_layout == "tiles":  # InternVL: pixel shuffle by downsample_ratio after the tower
        per_token = round(1 / config.downsample_ratio ** 2)
        values, mergers = _first(vision, "num_channels", "in_channels") * patch * patch, 1
        pixels = patch * patch * per_token
    else:
        per_token = vision.spatial_merge_size ** 2
        values = vision.in_channels * vision.temporal_patch_size * patch * patch
        mergers = 1 + len(getattr(vision, "deepstack_visual_indexes", None) or [])
        pixels = (patch * vision.spatial_merge_size) ** 2
    blocks = [b for b in _blocks(model) if _name_of(model, b).startswith(family.weights.vision_prefixes)]
    mlp = getattr(blocks[0], "mlp", None) if blocks else None
    gated = mlp is not None and any("gate" in name for name, _ in mlp.named_children())
    return VisionShape(depth=_first(vision, "depth", "num_hidden_layers"), hidden=hidden,
                       heads=_first(vision, "num_heads", "num_attention_heads"), intermediate=intermediate,
                       gated_mlp=gated, patch_values=values, patches_per_token=per_token, token_pixels=pixels,
                       mergers=mergers)


def model_facts(actor: ActorConfig) -> ModelFacts:
    """The facts of actor.model_path as this actor config trains it (frozen tower, LoRA adapters). Builds the model
    on the meta device: seconds even for a 72B model, no memory."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    raw, source = model_config(actor.model_path)
    family = family_of(raw)  # ValueError naming the architecture when vlmrl does not handle it
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a released config's legacy keys make transformers chatter, not fail
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            config = config_object(raw)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
            if actor.freeze_vision_tower:
                model.get_submodule(family.weights.vision_tower).requires_grad_(False)
            if actor.lora.enabled:
                from vlmrl.actor.lora import apply_lora

                logging.getLogger("vlmrl.actor.lora").disabled = True  # its log line is the run's, not the plan's
                try:
                    model = apply_lora(model, actor.lora)
                finally:
                    logging.getLogger("vlmrl.actor.lora").disabled = False
    finally:
        hf_logging.set_verbosity(verbosity)
    base = model.get_base_model() if actor.lora.enabled else model
    units = sorted((_name_of(model, b) for b in _blocks(model)), key=len, reverse=True)
    kv_parts = (".self_attn.k_proj.", ".self_attn.v_proj.")
    own = family.weights.vision_prefixes
    vision_prefixes = tuple(f"base_model.model.{p}" for p in own) + own
    tensors = []
    for name, param in model.named_parameters():  # tied weights once, as parameters() yields them
        unit = next((u for u in units if name.startswith(u + ".")), ROOT_UNIT)
        tensors.append(TensorFact(name=name, shape=tuple(param.shape), unit=unit, trainable=param.requires_grad,
                                  kv=any(part in name for part in kv_parts) and ".lora_" not in name
                                  and not name.startswith(vision_prefixes)))
    text = text_shape(base.config.get_text_config(), base, family)
    vision = vision_shape(base.config, base, family)
    return ModelFacts(model=actor.model_path, family=family.name, source=source, tensors=tuple(tensors), text=text,
                      vision=vision, config=raw)


def _blocks(model: Any) -> list:
    from vlmrl.distributed.fsdp import shardable_blocks

    return shardable_blocks(model)


def _name_of(model: Any, module: Any) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    raise ValueError("module not in model")


def _decoder_layers(model: Any, family: Any) -> list:
    """The language model's decoder layers: the sharded blocks outside the vision side."""
    names = {id(m): n for n, m in model.named_modules()}
    return [b for b in _blocks(model) if not names[id(b)].startswith(family.weights.vision_prefixes)]


def _first(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise AttributeError(f"{type(config).__name__} has none of {names}")


def _side(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)
