"""Throughput of a training step in EasyR1's definitions: tokens per second per GPU, and the actor update's model
FLOPs utilisation (MFU).

    throughput/tokens                prompt + response tokens of the step's real samples (their attention masks:
                                     image placeholder and tool tokens count; padding rows do not). EasyR1's
                                     perf/total_num_tokens.
    throughput/tokens_per_s_per_gpu  tokens / (step seconds x GPUs). EasyR1's perf/throughput. The step is
                                     rollout -> weight sync (validation and checkpoints, which EasyR1's step also
                                     times, are left out: they would make every test_freq-th step look slow).
    throughput/actor_tflops_per_gpu  model FLOPs of the update's forwards and backwards (x actor.ppo_epochs) /
                                     (update seconds x GPUs), in TFLOP/s.
    throughput/mfu_actor             that over one device's peak (trainer.device_peak_flops, else the table
                                     DEVICE_PEAK_FLOPS by CUDA device name). EasyR1's perf/mfu_actor. Not logged
                                     without a known peak (CPU, an unknown device).

Model FLOPs (`ModelFlops`, from the model's config) follow EasyR1's flops counter for the language model, token by
token: 6 x (its matmul parameters: q, k, v, o and the three SwiGLU projections of every layer, plus the embedding
and the LM head, V x h each, as EasyR1 counts them) per token, plus 12 x head_dim x heads x layers x sum(s^2) for
attention (s = a row's tokens; no halving for the causal mask, as EasyR1 and PaLM's MFU). Unlike EasyR1 they include
the vision tower: 6 x its matmul parameters per patch (patch embedding, blocks, the mergers' share; 4 x for the patch
embedding, whose backward needs no gradient for the pixels) plus 12 x width x sum(s^2) for its attention, s = a
frame's patches in full-attention blocks and a window's in Qwen2.5-VL's windowed ones; the forward's share only
(2 x and 4 x) when the tower does not train (actor.freeze_vision_tower, or LoRA without lora.vision). Held to torch's
FlopCounterMode on the embedded models' forward and backward (tests/trainer/test_throughput.py): equal, but for the
embedding, which EasyR1 counts as a matmul and the counter sees as a lookup. Model FLOPs: a recomputed forward
(gradient checkpointing) or the old-logprob pass is not work the update needed, so neither counts. They count the
tower once per row, as EasyR1 reports them, also where actor.share_vision encodes a prompt's image once for its n
samples (actor/vision_items_encoded of actor/vision_items): the work done is then lower than the model FLOPs by the
shared rows' vision share, and the MFU above the hardware's own utilisation by as much.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vlmrl.config import Config
    from vlmrl.types import TrainBatch

logger = logging.getLogger(__name__)

DEVICE_PEAK_FLOPS: dict[str, float] = {
    "B200": 2.25e15,
    "GB200": 2.5e15,
    "H100": 989e12,  # SXM; the PCIe and NVL boards are slower
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "GH200": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L20": 119.5e12,
    "L4": 121e12,
    "A40": 149.7e12,
    "A10": 125e12,
    "MI300X": 1307e12,
}
"""Dense (no sparsity) bf16 tensor-core peak FLOP/s of one device, by its name as torch.cuda.get_device_name spells
it: the longest name found as a whole word wins ("NVIDIA H100 PCIe" -> H100 PCIe; "NVIDIA H200" is not an H20, which
EasyR1's substring test takes it for)."""


def device_peak_flops(device_name: str | None) -> float | None:
    """One device's peak FLOP/s from DEVICE_PEAK_FLOPS, None for a name it lacks (or no name: CPU).

    >>> device_peak_flops("NVIDIA H100 80GB HBM3"), device_peak_flops("NVIDIA H200"), device_peak_flops("NVIDIA H20")
    (989000000000000.0, 989000000000000.0, 148000000000000.0)
    >>> device_peak_flops("NVIDIA A100-SXM4-80GB"), device_peak_flops("NVIDIA A10G"), device_peak_flops(None)
    (312000000000000.0, None, None)
    """
    if not device_name:
        return None
    found = [key for key in DEVICE_PEAK_FLOPS if re.search(rf"\b{re.escape(key)}\b", device_name)]
    return DEVICE_PEAK_FLOPS[max(found, key=len)] if found else None


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
            full += t * (h * w) ** 2  # attention within each frame (transformers' cu_seqlens)
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
    """`ModelFlops` of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE / GLM-4.1V config (config.json as a dict, or a
    transformers config); None for another model type (no MFU then). Fields a config.json may omit take transformers'
    defaults when it is loaded through AutoConfig (as `throughput_metrics` does). A MoE layer counts the experts a
    token runs through and its router, as verl's flops counter does for Qwen MoE models (`hidden x top-k x
    moe_intermediate x 3 + hidden x experts`); layers in `mlp_only_layers` are dense."""
    config = _as_dict(model_config)
    model_type = config.get("model_type")
    if model_type not in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v"):
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
        vision_input_params=patch_embed, vision_width=dim, vision_full_layers=full, vision_window_layers=v["depth"] - full,
        window=v["window_size"] // m // v["patch_size"] if model_type == "qwen2_5_vl" else 0, merge_size=m)


def step_throughput(flops: ModelFlops | None, seqlens: Sequence[int], grids: Sequence[Sequence[int]], *,
                    step_seconds: float, update_seconds: float, gpus: int, ppo_epochs: int = 1,
                    peak_flops: float | None = None, vision_trains: bool = True) -> dict[str, float]:
    """The throughput/* metrics of the module docstring for a step whose real rows have these token counts and
    vision grids. Without `flops` only the token figures; without `peak_flops` no MFU.

    >>> f = ModelFlops(text_params=1_000_000, text_attention=0)
    >>> step_throughput(f, [600, 400], [], step_seconds=2.0, update_seconds=0.5, gpus=2, peak_flops=1e11)
    {'throughput/tokens': 1000.0, 'throughput/tokens_per_s_per_gpu': 250.0, 'throughput/actor_tflops_per_gpu': 0.006, 'throughput/mfu_actor': 0.06}
    """
    tokens = float(sum(seqlens))
    out = {"throughput/tokens": tokens, "throughput/tokens_per_s_per_gpu": tokens / max(step_seconds * gpus, 1e-9)}
    if flops is None or update_seconds <= 0:
        return out
    achieved = flops.update_flops(seqlens, grids, vision_trains) * ppo_epochs / (update_seconds * gpus)
    out["throughput/actor_tflops_per_gpu"] = achieved / 1e12
    if peak_flops:
        out["throughput/mfu_actor"] = achieved / peak_flops
    return out


def batch_shapes(attention_mask: torch.Tensor, is_padding: torch.Tensor,
                 multi_modal_inputs: Sequence[Mapping[str, torch.Tensor]]) -> tuple[list[int], list[list[int]]]:
    """(tokens of each real row, the (t, h, w) grid of every image and video of the real rows) of a TrainBatch's
    (B, L) attention mask, (B,) padding flags and per-row multimodal inputs."""
    real = (~is_padding.bool()).tolist()
    seqlens = [int(n) for n, keep in zip(attention_mask.sum(dim=-1).tolist(), real, strict=True) if keep]
    grids = [[int(x) for x in grid] for inputs, keep in zip(multi_modal_inputs, real, strict=True) if keep
             for key in ("image_grid_thw", "video_grid_thw") if key in inputs for grid in inputs[key].tolist()]
    return seqlens, grids


@functools.cache
def _run_flops(model_path: str) -> ModelFlops | None:
    from transformers import AutoConfig

    from vlmrl.models.tiny import resolve_model_path

    flops = model_flops(AutoConfig.from_pretrained(resolve_model_path(model_path)))
    if flops is None:
        logger.info("throughput: no FLOPs formula for %s, so no throughput/mfu_actor (tokens/s only)", model_path)
    else:
        logger.info("throughput: %s makes %.3g model FLOPs per token (forward + backward) and %.3g per vision patch",
                    model_path, 6.0 * flops.text_params, 6.0 * flops.vision_params)
    return flops


@functools.cache
def _run_peak(configured: float | None, device: str) -> float | None:
    if configured is not None:
        return configured
    name = torch.cuda.get_device_name() if device != "cpu" and torch.cuda.is_available() else None
    peak = device_peak_flops(name)
    if peak is None:
        logger.info("throughput: no known peak FLOP/s for %s, so no throughput/mfu_actor; set "
                    "trainer.device_peak_flops (one device's dense bf16 peak) to log it", name or "a CPU")
    return peak


def throughput_metrics(config: Config, batch: TrainBatch, step_seconds: float, update_seconds: float
                       ) -> dict[str, float]:
    """A run's throughput/* metrics for one step's batch; the model's FLOPs and the device's peak are looked up once
    per run (and logged)."""
    a = config.actor
    seqlens, grids = batch_shapes(batch.attention_mask, batch.is_padding, batch.multi_modal_inputs)
    vision_trains = not a.freeze_vision_tower and not (a.lora.enabled and a.lora.vision == "off")
    return step_throughput(_run_flops(a.model_path), seqlens, grids, step_seconds=step_seconds,
                           update_seconds=update_seconds, gpus=config.derived.world_size, ppo_epochs=a.ppo_epochs,
                           peak_flops=_run_peak(config.trainer.device_peak_flops, a.device),
                           vision_trains=vision_trains)
