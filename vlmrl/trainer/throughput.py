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
attention (s = a row's tokens; no halving for the causal mask, as EasyR1 and PaLM's MFU), over the softmax attention
layers only where a family mixes in linear attention (Qwen3.5: its Gated DeltaNet layers count their projections as
above, plus their convolution and chunked delta rule, `vlmrl.models.flops.LinearAttentionFlops`). Which rule counts a
model is its family's (`vlmrl.models.families.ModelFamily.flop_rule`). Unlike EasyR1 they include
the vision tower: 6 x its matmul parameters per patch (patch embedding, blocks, the mergers' share; 4 x for the patch
embedding, whose backward needs no gradient for the pixels) plus 12 x width x sum(s^2) for its attention, s = a
frame's patches in full-attention blocks and a window's in Qwen2.5-VL's windowed ones; the forward's share only
(2 x and 4 x) when the tower does not train (actor.freeze_vision_tower, or LoRA without lora.vision). Held to torch's
FlopCounterMode on every family's embedded model's forward and backward (tests/families/test_family_matrix.py): equal, but
for the embedding, which EasyR1 counts as a matmul and the counter sees as a lookup, and two parts of the Gated
DeltaNet the counter cannot count as computed (its triangular solves; its depthwise convolution's weight gradient).
Model FLOPs: a recomputed forward (gradient checkpointing) or the old-logprob pass is not work the update needed, so
neither counts. They count the tower once per row, as EasyR1 reports them, also where actor.share_vision encodes a
prompt's image once for its n samples (actor/vision_items_encoded of actor/vision_items): the work done is then lower
than the model FLOPs by the shared rows' vision share, logged beside them as throughput/actor_tflops_done_per_gpu and
throughput/mfu_actor_done (the update's actor/vision_tflops minus actor/vision_tflops_encoded taken off).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from vlmrl.models.flops import ModelFlops, model_flops

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


def step_throughput(flops: ModelFlops | None, seqlens: Sequence[int], grids: Sequence[Sequence[int]], *,
                    step_seconds: float, update_seconds: float, gpus: int, ppo_epochs: int = 1,
                    peak_flops: float | None = None, vision_trains: bool = True,
                    vision_flops_saved: float = 0.0) -> dict[str, float]:
    """The throughput/* metrics of the module docstring for a step whose real rows have these token counts and
    vision grids. Without `flops` only the token figures; without `peak_flops` no MFU. `vision_flops_saved`: the
    tower's FLOPs the update did not run because rows shared an encoding (actor/vision_tflops minus
    actor/vision_tflops_encoded): then also throughput/actor_tflops_done_per_gpu and throughput/mfu_actor_done, of
    the work done.

    >>> f = ModelFlops(text_params=1_000_000, text_attention=0)
    >>> step_throughput(f, [600, 400], [], step_seconds=2.0, update_seconds=0.5, gpus=2, peak_flops=1e11)
    {'throughput/tokens': 1000.0, 'throughput/tokens_per_s_per_gpu': 250.0, 'throughput/actor_tflops_per_gpu': 0.006, 'throughput/mfu_actor': 0.06}
    """
    tokens = float(sum(seqlens))
    out = {"throughput/tokens": tokens, "throughput/tokens_per_s_per_gpu": tokens / max(step_seconds * gpus, 1e-9)}
    if flops is None or update_seconds <= 0:
        return out
    model = flops.update_flops(seqlens, grids, vision_trains) * ppo_epochs
    achieved = model / (update_seconds * gpus)
    out["throughput/actor_tflops_per_gpu"] = achieved / 1e12
    if peak_flops:
        out["throughput/mfu_actor"] = achieved / peak_flops
    if vision_flops_saved > 0:
        done = (model - vision_flops_saved) / (update_seconds * gpus)
        out["throughput/actor_tflops_done_per_gpu"] = done / 1e12
        if peak_flops:
            out["throughput/mfu_actor_done"] = done / peak_flops
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


def throughput_metrics(config: Config, batch: TrainBatch, step_seconds: float, update_seconds: float,
                       actor_metrics: Mapping[str, float] | None = None) -> dict[str, float]:
    """A run's throughput/* metrics for one step's batch; the model's FLOPs and the device's peak are looked up once
    per run (and logged). `actor_metrics` (the update's): the vision FLOPs its shared encodings saved."""
    a = config.actor
    seqlens, grids = batch_shapes(batch.attention_mask, batch.is_padding, batch.multi_modal_inputs)
    vision_trains = not a.freeze_vision_tower and not (a.lora.enabled and a.lora.vision == "off")
    return step_throughput(_run_flops(a.model_path), seqlens, grids, step_seconds=step_seconds,
                           update_seconds=update_seconds, gpus=config.derived.world_size, ppo_epochs=a.ppo_epochs,
                           peak_flops=_run_peak(config.trainer.device_peak_flops, a.device),
                           vision_trains=vision_trains, vision_flops_saved=_saved(actor_metrics or {}))


def _saved(actor_metrics: Mapping[str, float]) -> float:
    """The tower's FLOPs the update's shared encodings saved, from its actor/vision_tflops(_encoded)."""
    saved = actor_metrics.get("actor/vision_tflops", 0.0) - actor_metrics.get("actor/vision_tflops_encoded", 0.0)
    return max(saved, 0.0) * 1e12
