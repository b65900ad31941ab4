"""Model FLOPs of a VLM's forward + backward, per language-model token and per vision patch, read from its config:
what vlmrl.trainer.throughput's MFU divides by, and what the actor counts of the vision encodings it shares. The
definitions (EasyR1's for the language model, plus the vision tower) are in vlmrl.trainer.throughput's docstring."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelFlops:
    """What a model's forward + backward costs, per token and per vision patch (`model_flops` reads it from the
    config). FLOPs of one pass over some rows: `update_flops`."""

    text_params: int
    """Matmul parameters one language-model token passes through (EasyR1's dense_N)."""
    text_attention: int
    """head_dim x heads x layers: attention FLOPs are 12 x this x s^2 for a row of s tokens (forward + backward)."""
    vision_params: int = 0
    """Matmul parameters one vision patch passes through: patch embedding, every block, and the mergers' share
    (a merger runs once per merge_size^2 patches). 0 = no vision tower."""
    vision_input_params: int = 0
    """The patch embedding's share of vision_params: its backward computes only the weight gradient (the pixels need
    none), so it costs 4x its parameters per patch, not 6x (torch's FlopCounterMode counts it so)."""
    vision_width: int = 0
    """head_dim x heads of a vision block (its hidden size)."""
    vision_full_layers: int = 0
    """Vision blocks attending over a whole frame (all of them for Qwen2-VL and Qwen3-VL)."""
    vision_window_layers: int = 0
    """Qwen2.5-VL's blocks attending within windows of `window` x `window` merged tokens."""
    window: int = 0
    """Window side in merged tokens (Qwen2.5-VL: window_size / spatial_merge_size / patch_size)."""
    merge_size: int = 1
    """spatial_merge_size: a merged (language-model) token is merge_size x merge_size patches."""
    tile_tokens: int = 0
    """A tiles family (InternVL): each grid row is (tiles, 1, 1), `vision_params` are per TILE, and a tile's tower
    attends over this many tokens (its patches and a class token). 0: grids of patches."""

    def text_flops(self, seqlens: Iterable[int]) -> float:
        """Forward + backward FLOPs of the language model over rows of these token counts (EasyR1's formula)."""
        seqlens = list(seqlens)
        return 6.0 * self.text_params * sum(seqlens) + 12.0 * self.text_attention * sum(s * s for s in seqlens)

    def vision_flops(self, grids: Iterable[Sequence[int]], trains: bool = True) -> float:
        """Forward + backward (forward only when the tower does not train) FLOPs of the vision tower over images
        and videos of these (t, h, w) patch grids."""
        patches = full = windowed = 0
        for t, h, w in grids:
            patches += t * h * w
            full += t * (h * w) ** 2 if not self.tile_tokens else t * h * w * self.tile_tokens ** 2
            # attention within each frame (transformers' cu_seqlens), or within each tile
            if self.vision_window_layers:
                rows, cols = _window_sides(h // self.merge_size, self.window), _window_sides(w // self.merge_size,
                                                                                            self.window)
                windowed += t * sum(r * r for r in rows) * sum(c * c for c in cols) * self.merge_size ** 4
        attention = 4.0 * self.vision_width * (self.vision_full_layers * full + self.vision_window_layers * windowed)
        forward = 2.0 * self.vision_params * patches + attention
        backward = 4.0 * (self.vision_params - 0.5 * self.vision_input_params) * patches + 2.0 * attention
        return forward + backward if trains else forward

    def update_flops(self, seqlens: Iterable[int], grids: Iterable[Sequence[int]], vision_trains: bool = True
                     ) -> float:
        """Model FLOPs of one forward + backward over rows with these token counts and vision grids."""
        return self.text_flops(seqlens) + self.vision_flops(grids, vision_trains)


def _window_sides(length: int, window: int) -> list[int]:
    """Qwen2.5-VL tiles a frame's merged grid into windows from its top-left corner: full windows, then the rest."""
    return [window] * (length // window) + ([length % window] if length % window else [])


def _as_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    return dict(config) if isinstance(config, Mapping) else config.to_dict()


def model_flops(model_config: Mapping[str, Any] | Any) -> ModelFlops | None:
    """`ModelFlops` of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / GLM-4.1V / InternVL config (config.json as
    a dict, or a transformers config); None for another model type (no MFU then). Fields a config.json may omit take
    transformers' defaults when it is loaded through AutoConfig (as `throughput_metrics` does). A MoE layer counts
    the experts a token runs through and its router, as verl's flops counter does for Qwen MoE models (`hidden x
    top-k x moe_intermediate x 3 + hidden x experts`); layers in `mlp_only_layers` are dense."""
    config = _as_dict(model_config)
    model_type = config.get("model_type")
    if model_type not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "internvl"):
        return None
    text = _as_dict(config.get("text_config") or config)
    h, heads, layers = text["hidden_size"], text["num_attention_heads"], text["num_hidden_layers"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or h // heads
    attention_params = h * (heads * head_dim + 2 * kv_heads * head_dim + heads * head_dim)  # q, k, v, o
    dense_mlp = 3 * h * text["intermediate_size"]
    mlp_params = dense_mlp * layers
    if model_type == "qwen3_vl_moe":
        experts = text.get("num_experts") or text["num_local_experts"]
        sparse = [i for i in range(layers) if i not in (text.get("mlp_only_layers") or [])
                  and (i + 1) % (text.get("decoder_sparse_step") or 1) == 0]
        moe_mlp = 3 * h * text["num_experts_per_tok"] * text["moe_intermediate_size"] + h * experts
        mlp_params = moe_mlp * len(sparse) + dense_mlp * (layers - len(sparse))
    text_params = mlp_params + attention_params * layers + 2 * text["vocab_size"] * h
    flops = ModelFlops(text_params=text_params, text_attention=head_dim * heads * layers)
    vision = config.get("vision_config")
    if not vision:
        return flops
    v = _as_dict(vision)
    if model_type == "internvl":
        return _internvl(flops, v, config, h)
    m = v["spatial_merge_size"]
    if model_type == "glm4v":
        # every block full attention with a SwiGLU MLP; then a m x m stride-m convolution (dim -> out) per merged
        # token and the merger (proj out x out, SwiGLU over the tower's intermediate size) per merged token
        dim, out, inner = v["hidden_size"], v["out_hidden_size"], v["intermediate_size"]
        patch_embed = dim * v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2
        merger_per_patch = dim * out + (out * out + 3 * out * inner) / (m * m)
        return ModelFlops(
            text_params=text_params, text_attention=head_dim * heads * layers,
            vision_params=patch_embed + (4 * dim * dim + 3 * dim * inner) * v["depth"] + merger_per_patch,
            vision_input_params=patch_embed, vision_width=dim, vision_full_layers=v["depth"],
            vision_window_layers=0, window=0, merge_size=m)
    if model_type == "qwen2_vl":  # embed_dim is the tower's width, hidden_size the language model's
        dim, out, mergers = v["embed_dim"], v["hidden_size"], 1
        mlp = 2 * dim * int(dim * v["mlp_ratio"])  # fc1 / fc2
    else:
        dim, out = v["hidden_size"], v["out_hidden_size"]
        mlp = (3 if model_type == "qwen2_5_vl" else 2) * dim * v["intermediate_size"]  # SwiGLU vs fc1 / fc2
        mergers = 1 + len(v.get("deepstack_visual_indexes") or [])  # Qwen3-VL: a merger per deepstack layer too
    patch_embed = dim * v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2
    merger_per_patch = mergers * dim * (dim * m * m + out)  # (dim m^2)^2 + dim m^2 out, once per m^2 patches
    full = len(v.get("fullatt_block_indexes") or []) if model_type == "qwen2_5_vl" else v["depth"]
    return ModelFlops(
        text_params=text_params, text_attention=head_dim * heads * layers,
        vision_params=patch_embed + (4 * dim * dim + mlp) * v["depth"] + merger_per_patch,
        vision_input_params=patch_embed, vision_width=dim, vision_full_layers=full,
        vision_window_layers=v["depth"] - full,
        window=v["window_size"] // m // v["patch_size"] if model_type == "qwen2_5_vl" else 0, merge_size=m)


def _internvl(text: ModelFlops, v: dict[str, Any], config: dict[str, Any], hidden: int) -> ModelFlops:
    """InternVL: per tile, the patch embedding on its patches, every InternViT block (q, k, v, o and fc1 / fc2) on its
    patches and class token, then pixel shuffle (ratio r: a token of dim/r^2 per 1/r^2 patches) and the projector
    (dim/r^2 -> hidden -> hidden) on each of them."""
    side, patch = (x[0] if isinstance(x, (list, tuple)) else x for x in (v["image_size"], v["patch_size"]))
    patches = (side // patch) ** 2
    dim, ratio = v["hidden_size"], config.get("downsample_ratio", 0.5)
    merged = int(dim / ratio**2)
    patch_embed = dim * v.get("num_channels", 3) * patch * patch * patches
    blocks = (4 * dim * dim + 2 * dim * v["intermediate_size"]) * v["num_hidden_layers"] * (patches + 1)
    projector = (merged * hidden + hidden * hidden) * int(patches * ratio**2)
    return ModelFlops(text_params=text.text_params, text_attention=text.text_attention,
                      vision_params=patch_embed + blocks + projector, vision_input_params=patch_embed,
                      vision_width=dim, vision_full_layers=v["num_hidden_layers"], tile_tokens=patches + 1)
