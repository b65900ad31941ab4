"""Model FLOPs of a VLM's forward + backward, per language-model token and per vision patch, read from its config:
what vlmrl.trainer.throughput's MFU divides by, and what the actor counts of the vision encodings it shares. The
definitions (EasyR1's for the language model, plus the vision tower) are in vlmrl.trainer.throughput's docstring.

Which rule counts a model is a fact of its family (`ModelFamily.flop_rule`, a key of `RULES`); a family without one
logs no MFU, and the FLOP test over every family fails for it. Each rule is held to torch's FlopCounterMode on the
family's embedded model (tests/families/test_family_matrix.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vlmrl.models.families import ModelFamily, dense_layers, family_of


@dataclass(frozen=True)
class LinearAttentionFlops:
    """Qwen3.5's Gated DeltaNet layers, as transformers' PyTorch path computes them (`torch_chunk_gated_delta_rule`,
    `causal_conv1d_fn`): per row of s tokens, a depthwise causal convolution over the q, k, v channels (padded by
    kernel - 1 on both sides: s + kernel - 1 outputs computed, `conv_outputs`), then the chunked delta rule over s
    padded to whole chunks of 64: per chunk q·kᵀ and βk·kᵀ, two unit-triangular solves (the UT transform), then the
    scan that reads and updates the (key x value) state. Its backward is what autograd runs: the first chunk's state
    is zeros (no gradient), and the last chunk's state update feeds nothing (no backward).

    Two parts torch's FlopCounterMode does not count as computed, counted here as computed: the triangular solves
    (torch has no FLOP formula for `linalg_solve_triangular`: it sees only the matmul of their backward), and the
    convolution's weight gradient, which its `conv_backward_flop` counts as a dense convolution (channels^2 instead
    of channels: it skips the groups). On a GPU the flash-linear-attention and causal-conv1d kernels replace this path
    (the counter sees no FLOPs in them); they run the same chunked algorithm (chunks of 64)."""

    layers: int
    heads: int
    """Value heads (queries and keys are repeated to them)."""
    key_dim: int
    value_dim: int
    conv_channels: int
    """2 x key heads x key_dim + value heads x value_dim: the convolved q, k, v channels."""
    conv_kernel: int
    chunk: int = 64
    """transformers' chunk size (the kernel's too)."""

    def conv_outputs(self, s: int) -> int:
        """Positions the convolution computes for a row of s tokens: a row shorter than the kernel is first padded
        to it (transformers' fallback does so), then kernel - 1 on both sides."""
        return max(s, self.conv_kernel) + self.conv_kernel - 1

    def conv_flops(self, s: int) -> float:
        """Forward, input gradient and weight gradient of the depthwise convolution over a row of s tokens."""
        return 3 * 2.0 * self.conv_channels * self.conv_kernel * self.conv_outputs(s) * self.layers

    def solve_flops(self, s: int) -> float:
        """The triangular solves' own FLOPs (forward, and the right-hand side's gradient in the backward): C(C - 1)
        per right-hand side column of a unit-triangular C x C system, key_dim + value_dim columns a chunk."""
        c, n = self.chunk, -(-s // self.chunk)
        return 2.0 * c * (c - 1) * (self.key_dim + self.value_dim) * self.heads * n * self.layers

    def flops(self, s: int) -> float:
        """Forward + backward FLOPs of every linear-attention layer over a row of s tokens."""
        c, n, h, dk, dv = self.chunk, -(-s // self.chunk), self.heads, self.key_dim, self.value_dim
        intra = 12.0 * h * c * c * dk * n  # q·kᵀ and βk·kᵀ per chunk, forward and both gradients
        solve_grads = 2.0 * h * c * c * (dk + dv) * n  # the matrix gradient of each solve: a C x d x C matmul
        scan = h * c * dk * dv * (18.0 * n - 8) + 6.0 * h * c * c * dv * n  # state reads, updates, intra · v
        return (intra + solve_grads + scan) * self.layers + self.solve_flops(s) + self.conv_flops(s)


@dataclass(frozen=True)
class ModelFlops:
    """What a model's forward + backward costs, per token and per vision patch (`model_flops` reads it from the
    config). FLOPs of one pass over some rows: `update_flops`."""

    text_params: int
    """Matmul parameters one language-model token passes through (EasyR1's dense_N)."""
    text_attention: int
    """head_dim x heads x (softmax) attention layers: attention FLOPs are 12 x this x s^2 for a row of s tokens
    (forward + backward)."""
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
    linear: LinearAttentionFlops | None = None
    """The linear-attention layers' mixing beyond their projections (Qwen3.5); None: every layer attends."""

    def text_flops(self, seqlens: Iterable[int]) -> float:
        """Forward + backward FLOPs of the language model over rows of these token counts (EasyR1's formula, plus
        the linear-attention layers' own)."""
        seqlens = list(seqlens)
        linear = sum(self.linear.flops(s) for s in seqlens) if self.linear else 0.0
        return 6.0 * self.text_params * sum(seqlens) + 12.0 * self.text_attention * sum(s * s for s in seqlens) \
            + linear

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
    """`ModelFlops` of a model config (config.json as a dict, or a transformers config) by its family's rule; None
    for a model of no family, or of a family without a rule (no MFU then). Fields a config.json may omit take
    transformers' defaults when it is loaded through AutoConfig (as `throughput_metrics` does)."""
    config = _as_dict(model_config)
    try:
        family = family_of(config)
    except ValueError:
        return None
    if family.flop_rule is None:
        return None
    text = _as_dict(config.get("text_config") or config)
    vision = config.get("vision_config")
    return RULES[family.flop_rule](family, config, text, _as_dict(vision) if vision else None)


def _text(family: ModelFamily, text: dict[str, Any], gated_query: bool = False) -> ModelFlops:
    """The language model: per layer its token mixer (q, k, v, o of softmax attention; with `gated_query` the q
    projection also yields an output gate, twice its rows, as Qwen3.5's; a linear-attention layer's projections and
    `LinearAttentionFlops`) and its MLP (dense SwiGLU, or a MoE layer: the experts a token runs through and its
    router, as verl's flops counter does for Qwen MoE models, `hidden x top-k x moe_intermediate x 3 + hidden x
    experts`, plus a gated shared expert where the config has one); then the embedding and LM head."""
    h, heads, layers = text["hidden_size"], text["num_attention_heads"], text["num_hidden_layers"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or h // heads
    attention_params = h * ((2 if gated_query else 1) * heads * head_dim + 2 * kv_heads * head_dim + heads * head_dim)
    linear = None
    attending = layers
    if family.weights.linear_attention is not None:
        kinds = text.get("layer_types") or ["full_attention"] * layers
        attending = sum(kind == "full_attention" for kind in kinds)
        k_heads, v_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
        dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
        conv = 2 * k_heads * dk + v_heads * dv
        linear = LinearAttentionFlops(layers=layers - attending, heads=v_heads, key_dim=dk, value_dim=dv,
                                      conv_channels=conv, conv_kernel=text["linear_conv_kernel_dim"])
        # in_proj_qkv, in_proj_z (the output gate), in_proj_b and in_proj_a (per value head), out_proj
        mixer_params = attention_params * attending + h * (conv + v_heads * dv + 2 * v_heads) * linear.layers \
            + v_heads * dv * h * linear.layers
    else:
        mixer_params = attention_params * layers
    dense_mlp = 3 * h * text["intermediate_size"]
    mlp_params = dense_mlp * layers
    if family.experts is not None:
        experts = text.get("num_experts") or text["num_local_experts"]
        sparse = layers - len(dense_layers(text))
        moe_mlp = 3 * h * text["num_experts_per_tok"] * text["moe_intermediate_size"] + h * experts
        if text.get("shared_expert_intermediate_size"):  # Qwen3.5-MoE: a SwiGLU shared expert and its 1-wide gate
            moe_mlp += 3 * h * text["shared_expert_intermediate_size"] + h
        mlp_params = moe_mlp * sparse + dense_mlp * (layers - sparse)
    text_params = mlp_params + mixer_params + 2 * text["vocab_size"] * h
    return ModelFlops(text_params=text_params, text_attention=head_dim * heads * attending, linear=linear)


def _patch_embed(v: dict[str, Any], dim: int) -> int:
    return dim * v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2


def _qwen2_vl(family: ModelFamily, config: dict, text: dict, v: dict | None) -> ModelFlops:
    """Qwen2-VL (its tower has `embed_dim`: fc1 / fc2 MLPs of embed_dim x mlp_ratio, every block full attention)
    and Qwen2.5-VL (SwiGLU MLPs, blocks attending within windows but for `fullatt_block_indexes`); one merger."""
    flops = _text(family, text)
    if not v:
        return flops
    m = v["spatial_merge_size"]
    if "embed_dim" in v:  # Qwen2-VL: embed_dim is the tower's width, hidden_size the language model's
        dim, out, mlp = v["embed_dim"], v["hidden_size"], 2 * v["embed_dim"] * int(v["embed_dim"] * v["mlp_ratio"])
        full = v["depth"]
        window = 0
    else:
        dim, out, mlp = v["hidden_size"], v["out_hidden_size"], 3 * v["hidden_size"] * v["intermediate_size"]
        full = len(v.get("fullatt_block_indexes") or [])
        window = v["window_size"] // m // v["patch_size"]
    merger_per_patch = dim * (dim * m * m + out)  # (dim m^2)^2 + dim m^2 out, once per m^2 patches
    return replace(flops, vision_params=_patch_embed(v, dim) + (4 * dim * dim + mlp) * v["depth"] + merger_per_patch,
                   vision_input_params=_patch_embed(v, dim), vision_width=dim, vision_full_layers=full,
                   vision_window_layers=v["depth"] - full, window=window, merge_size=m)


def _qwen3_vl_tower(flops: ModelFlops, v: dict | None) -> ModelFlops:
    """Qwen3-VL's tower (Qwen3.5's too): fc1 / fc2 MLPs, every block full attention, a merger, and one more per
    deepstack layer (Qwen3.5 has none)."""
    if not v:
        return flops
    m, dim, out = v["spatial_merge_size"], v["hidden_size"], v["out_hidden_size"]
    mergers = 1 + len(v.get("deepstack_visual_indexes") or [])
    merger_per_patch = mergers * dim * (dim * m * m + out)
    return replace(flops, vision_params=_patch_embed(v, dim) + (4 * dim * dim + 2 * dim * v["intermediate_size"])
                   * v["depth"] + merger_per_patch, vision_input_params=_patch_embed(v, dim), vision_width=dim,
                   vision_full_layers=v["depth"], merge_size=m)


def _qwen3_vl(family: ModelFamily, config: dict, text: dict, v: dict | None) -> ModelFlops:
    """Qwen3-VL and Qwen3-VL-MoE."""
    return _qwen3_vl_tower(_text(family, text), v)


def _qwen3_5(family: ModelFamily, config: dict, text: dict, v: dict | None) -> ModelFlops:
    """Qwen3.5 and Qwen3.5-MoE: gated softmax attention every full_attention_interval-th layer, Gated DeltaNet in
    the others (`LinearAttentionFlops`), Qwen3-VL's tower without deepstack."""
    return _qwen3_vl_tower(_text(family, text, gated_query=True), v)


def _glm4v(family: ModelFamily, config: dict, text: dict, v: dict | None) -> ModelFlops:
    """GLM-4.1V: every block full attention with a SwiGLU MLP; then a m x m stride-m convolution (dim -> out) per
    merged token and the merger (proj out x out, SwiGLU over the tower's intermediate size) per merged token."""
    flops = _text(family, text)
    if not v:
        return flops
    m, dim, out, inner = v["spatial_merge_size"], v["hidden_size"], v["out_hidden_size"], v["intermediate_size"]
    merger_per_patch = dim * out + (out * out + 3 * out * inner) / (m * m)
    return replace(flops, vision_params=_patch_embed(v, dim) + (4 * dim * dim + 3 * dim * inner) * v["depth"]
                   + merger_per_patch, vision_input_params=_patch_embed(v, dim), vision_width=dim,
                   vision_full_layers=v["depth"], merge_size=m)


def _internvl(family: ModelFamily, config: dict, text: dict, v: dict | None) -> ModelFlops:
    """InternVL: per tile, the patch embedding on its patches, every InternViT block (q, k, v, o and fc1 / fc2) on its
    patches and class token, then pixel shuffle (ratio r: a token of dim/r^2 per 1/r^2 patches) and the projector
    (dim/r^2 -> hidden -> hidden) on each of them."""
    flops = _text(family, text)
    if not v:
        return flops
    side, patch = (x[0] if isinstance(x, (list, tuple)) else x for x in (v["image_size"], v["patch_size"]))
    patches = (side // patch) ** 2
    hidden, dim, ratio = text["hidden_size"], v["hidden_size"], config.get("downsample_ratio", 0.5)
    merged = int(dim / ratio**2)
    patch_embed = dim * v.get("num_channels", 3) * patch * patch * patches
    blocks = (4 * dim * dim + 2 * dim * v["intermediate_size"]) * v["num_hidden_layers"] * (patches + 1)
    projector = (merged * hidden + hidden * hidden) * int(patches * ratio**2)
    return replace(flops, vision_params=patch_embed + blocks + projector, vision_input_params=patch_embed,
                   vision_width=dim, vision_full_layers=v["num_hidden_layers"], tile_tokens=patches + 1)


RULES: dict[str, Callable[[ModelFamily, dict, dict, dict | None], ModelFlops]] = {
    "qwen2-vl": _qwen2_vl,
    "qwen3-vl": _qwen3_vl,
    "qwen3.5": _qwen3_5,
    "glm4v": _glm4v,
    "internvl": _internvl,
}
"""The FLOP rule of each `ModelFamily.flop_rule`: (family, config, text config, vision config or None) ->
`ModelFlops`."""
