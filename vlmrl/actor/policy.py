"""Building the policy: ONE construction path for the single-process actor and every rank of the sharded one.

Device and dtypes are resolved once, the model is loaded with its cache off (training never decodes), gradient
checkpointing and the frozen vision tower are applied, LoRA adapters are added (actor.lora: then the KL reference is
the same model with its adapters disabled) or else the KL reference is copied from the initial weights, and AdamW
plus the lr schedule are built over the trainable parameters. With on-policy distillation (algorithm.distill) a
frozen teacher is loaded beside them and wrapped like the reference. A sharded rank passes `wrap` (FSDP2 around the
model) and gets everything else unchanged, so the two actors cannot differ in what they train or in which dtype.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlmrl.actor.config import ActorConfig, OptimConfig
from vlmrl.algorithms.config import DistillConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
"""Weight and compute dtypes by name. float64 is for exactness tests (the config accepts float32 and bfloat16)."""


def resolve_device(name: str) -> torch.device:
    """auto = cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_policy(model_path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Load a Qwen-VL checkpoint of a supported family (HF format, or an embedded name or hub id) for training."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.actor.packing import add_row_boundaries
    from vlmrl.models.families import family_for_path
    from vlmrl.models.tiny import resolve_model_path

    path = resolve_model_path(model_path)
    extra = {}
    if dtype == torch.float64 and family_for_path(path).experts is not None:
        # transformers' default experts kernel (torch's grouped_mm) has no float64; its eager loop computes the same
        extra["experts_implementation"] = "eager"
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, **extra)
    add_row_boundaries(model)  # linear-attention layers (Qwen3.5) keep a packed forward's rows apart
    return model.to(device)


def lr_lambda(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """step -> lr factor for LambdaLR: linear warm-up over optim.lr_warmup_steps, then constant or cosine to 0 at
    `total_steps`."""
    warmup, kind = optim.lr_warmup_steps, optim.lr_scheduler

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


@dataclass
class Policy:
    """A built policy: what `vlmrl.actor.core.ActorCore` runs on."""

    device: torch.device
    dtype: torch.dtype
    """Master weights (and optimizer state)."""
    compute_dtype: torch.dtype
    """Forward/backward precision: autocast when lower than `dtype`."""
    model: torch.nn.Module
    """The policy (wrapped, when built with `wrap`)."""
    reference: torch.nn.Module | None
    """The frozen initial weights, when actor.use_kl_loss without LoRA (wrapped like the model)."""
    trainable: list[torch.nn.Parameter]
    """The model's parameters that require grad (all but a frozen vision tower; with LoRA the adapters only)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """One step per training step (not per optimizer step)."""
    peft_config: Any = None
    """The PEFT LoraConfig when actor.lora is on (the model is then a PeftModel, its reference the base inside)."""
    reference_on_host: bool = False
    """The (unsharded) reference waits in host memory and is moved to `device` for its logprob pass only."""
    teacher: torch.nn.Module | None = None
    """The frozen distillation teacher (algorithm.distill.teacher; wrapped like the reference) when it runs in the
    trainer (teacher_engine=trainer), else None."""
    distill: DistillConfig | None = None
    """Distillation's settings when it is on, wherever its teacher runs (the loss mode's estimator and coefficient)."""
    teacher_on_host: bool = False
    """The (unsharded) teacher waits in host memory and is moved to `device` for its logprob pass only
    (actor.offload.reference, as the reference)."""


def build_policy(config: ActorConfig, total_steps: int, init_path: str | None = None,
                 wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                 wrap_reference: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
                 distill: DistillConfig | None = None) -> Policy:
    """Load, configure and wrap the policy (and reference), and build its optimizer and lr schedule.

    Args:
        config: actor settings.
        total_steps: training steps (the lr schedule's length).
        init_path: load the policy from here instead of config.model_path (a checkpoint to resume from); the
            reference always comes from config.model_path. With LoRA the base is config.model_path and the adapters
            come from the checkpoint's adapter folder (the merged weights beside it are for the engines).
        wrap: applied to the policy and to the reference after freezing (a sharded rank: FSDP2); the optimizer is
            built on the wrapped model's parameters, which wrapping may replace.
        wrap_reference: applied to the reference instead of `wrap` (a sharded rank offloading it); None = `wrap`.
        distill: on-policy distillation's settings: with a teacher in the trainer (teacher_engine=trainer), it is
            loaded frozen in its own dtype and wrapped by `wrap_reference` (or `wrap`), as the reference is.
    """
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    compute_dtype = resolve_dtype(config.compute_dtype, device)
    lora = config.lora.enabled
    model = load_policy(config.model_path if lora else init_path or config.model_path, dtype, device)
    model.config.use_cache = False
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if lora:  # the frozen embeddings' output must carry grad for the checkpointed blocks' adapters
            model.enable_input_require_grads()
    if config.freeze_vision_tower:  # the tower with its mergers; a projector after it (InternVL) still trains
        from vlmrl.models.families import family_of

        model.get_submodule(family_of(model.config).weights.vision_tower).requires_grad_(False)
    reference, adapters = None, None
    if lora:
        from vlmrl.actor.lora import ADAPTER_DIR, apply_lora, load_adapter_weights

        model = apply_lora(model, config.lora)
        adapters = model.peft_config["default"]
        if init_path is not None:
            load_adapter_weights(model, Path(init_path) / ADAPTER_DIR)
            logger.info("LoRA adapters restored from %s", Path(init_path) / ADAPTER_DIR)
        if config.use_kl_loss:
            logger.info("KL reference: the base model with its adapters disabled (no copy loaded; KL %s, coef %g)",
                        config.kl_loss_type, config.kl_loss_coef)
    elif config.use_kl_loss:
        # resuming: the reference is the initial weights, loaded as they are (no second, deep-copied instance)
        initial = copy.deepcopy(model) if init_path is None else load_policy(config.model_path, dtype, device)
        reference = initial.eval().requires_grad_(False)
        logger.info("frozen reference loaded from %s (KL %s, coef %g)", config.model_path, config.kl_loss_type,
                    config.kl_loss_coef)
    reference_on_host = False
    if wrap is not None:
        model = wrap(model)
        reference = (wrap_reference or wrap)(reference).eval() if reference is not None else None
    elif config.offload.params:
        logger.warning("actor.offload.params needs FSDP sharding (dp >= 2): this single-device actor keeps its "
                       "parameters on %s", device)
    if wrap is None and reference is not None and config.offload.reference and device.type != "cpu":
        reference, reference_on_host = reference.to("cpu"), True  # actor.offload.reference
    teacher, teacher_on_host = None, False
    distilling = distill is not None and distill.enabled
    if distilling and distill.teacher_engine == "trainer":  # else an engine of the run's scores the samples
        teacher = load_policy(distill.teacher, resolve_dtype(distill.teacher_dtype, device), device)
        teacher.config.use_cache = False
        teacher = teacher.eval().requires_grad_(False)
        if wrap is not None:
            teacher = (wrap_reference or wrap)(teacher).eval()
        elif config.offload.reference and device.type != "cpu":  # like the reference: on the device for its pass
            teacher, teacher_on_host = teacher.to("cpu"), True
        logger.info("distillation teacher loaded from %s (%s, mode %s%s)", distill.teacher,
                    next(teacher.parameters()).dtype, distill.mode, ", in host memory" if teacher_on_host else "")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.optim.lr, betas=tuple(config.optim.betas),
                                  weight_decay=config.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config.optim, total_steps))
    logger.info("actor %s: %.2fM trainable parameters, %s weights, %s compute on %s", init_path or config.model_path,
                sum(p.numel() for p in trainable) / 1e6, dtype, compute_dtype, device)
    return Policy(device, dtype, compute_dtype, model, reference, trainable, optimizer, scheduler, adapters,
                  reference_on_host, teacher, distill if distilling else None, teacher_on_host)


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Every tensor of the optimizer's state (AdamW's moments and step; a sharded model's local shards) to `device`:
    the CPU between steps, the parameters' device for a step (actor.offload.optimizer, verl's optimizer offload)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)
